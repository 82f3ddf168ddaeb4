"""Holding a whole training step to the chain's (Note [a whole step] in lenet/steps.py): the state a step
changes, kept aside and put back while the planner checks and times one; and the comparison, a pure function
of host arrays (``compare``), tested without a GPU.

Note [checking a whole step]: a whole step is held to the chain's step from the same state, on the input the
buffers hold (random normals until a batch is loaded) and on blank images (every pooling window an exact
four-way tie, every conv1 output its bias). Each parameter tensor's gradient, its change in the update, its
momentum and its moving average's change are within TOLERANCE of the chain's (norm-wise relative), and so
are the loss, its running sum and the logits; the right answers are equal. A change is compared, not the
new value: the value is dominated by the old one, which hides an update that is 1% off. Two float32 updates
of one parameter may still differ by an ulp of its new value, so a change may also differ by ULPS of the
new values' norm (it matters only where the learning rate makes the change that small). The two sum in
different orders; a ReLU or pooling decision decided by a hair could differ and fail the check, so a
failure names the tensor, and the chain runs.
"""

from __future__ import annotations

import numpy as np

TOLERANCE = 1e-4
ULPS = 1e-6   # of a new value's norm: about eight float32 ulps


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _change(before, mine, ref) -> tuple[float, bool]:
    """(how far ``mine``'s change from ``before`` is from ``ref``'s, relative to ``ref``'s change; whether that
    is within TOLERANCE of it, or ULPS of the new values' norm)."""
    b, m, r = (np.asarray(v, np.float64) for v in (before, mine, ref))
    off, change = np.linalg.norm(m - r), np.linalg.norm(r - b)
    return float(off / max(change, 1e-30)), bool(off <= TOLERANCE * change + ULPS * np.linalg.norm(r))


def compare(before: dict, mine: dict, ref: dict, tensors: dict) -> tuple[float, str | None]:
    """(the largest relative distance seen, None) where the whole step's state ``mine`` passes Note [checking a
    whole step] against the chain's ``ref`` from ``before``, else (that distance, why). Each dict holds host
    arrays: "grads", "params", "velocity" (or None: no momentum), "ema" (or None) as flat buffers, "logits",
    and the numbers "loss", "correct", "running"; ``tensors`` names each parameter tensor's (offset, size)."""
    def rel(a, b) -> tuple[float, bool]:
        d = _rel(a, b)
        return d, d <= TOLERANCE

    rows = []   # (what, distance, passes)
    for name, (off, size) in tensors.items():
        s = slice(off, off + size)
        rows.append((f"{name}'s gradient", *rel(mine["grads"][s], ref["grads"][s])))
        rows.append((f"{name}'s change in the update", *_change(before["params"][s], mine["params"][s],
                                                                 ref["params"][s])))
        if ref.get("velocity") is not None:
            rows.append((f"{name}'s momentum", *rel(mine["velocity"][s], ref["velocity"][s])))
        if ref.get("ema") is not None:
            rows.append((f"{name}'s moving average's change", *_change(before["ema"][s], mine["ema"][s],
                                                                        ref["ema"][s])))
    for key in ("loss", "running"):
        rows.append((f"the {key}", *rel([mine[key]], [ref[key]])))
    rows.append(("the logits", *rel(mine["logits"], ref["logits"])))
    worst = 0.0
    for what, d, passes in rows:
        worst = max(worst, d)
        if not passes:
            return worst, f"{what} is {d:.2e} from the chain's (at most {TOLERANCE:g})"
    if int(mine["correct"]) != int(ref["correct"]):
        return worst, f"{int(mine['correct'])} right answers where the chain has {int(ref['correct'])}"
    return worst, None


class StepState:
    """What a training step changes (the parameters, their momentum and moving average, the loss totals),
    kept aside and put back while a whole step is checked and timed; and the check itself."""

    def __init__(self, op, stream):
        u, t = op.update, op.loss
        self.op, self.stream = op, stream
        self.kept = [a for a in (u.params, u.velocity, u.ema, t.loss, t.correct, t.running) if a is not None]

    def save(self) -> None:
        from .kernels import copy_of

        with self.stream:
            self.saved = [copy_of(a) for a in self.kept]

    def restore(self) -> None:
        from .kernels import device_copy

        with self.stream:
            for a, s in zip(self.kept, self.saved):
                device_copy(a, s)

    def _host(self, n: int) -> dict:
        """The state a step left, on the host (waits for the stream)."""
        u, t = self.op.update, self.op.loss
        self.stream.synchronize()
        return {"grads": u.grads.get(), "params": u.params.get(),
                "velocity": u.velocity.get() if u.momentum else None,
                "ema": u.ema.get() if u.ema is not None else None, "logits": t.logits[:n].get(),
                "loss": float(t.loss.get()[0]), "correct": int(t.correct.get()[0]),
                "running": float(t.running.get()[0]) if t.running is not None else 0.0}

    def _after(self, fn, n: int) -> dict:
        """The state one call of ``fn`` leaves from the state now, which is then put back."""
        self.save()
        try:
            fn()
            return self._host(n)
        finally:
            self.restore()

    def check(self, whole, chain, n: int) -> tuple[float | None, str | None]:
        """(the largest distance, None) where ``whole`` passes Note [checking a whole step], else (None, why)."""
        from . import params as P
        from .kernels import copy_of, device_copy, fill

        tensors = {name: (off, int(np.prod(P.SHAPES[name]))) for name, off in P.OFFSETS.items()}
        x = self.op.stages[0].tensors.x[:n]
        with self.stream:
            images = copy_of(x)
        worst = 0.0
        try:
            for inputs in ("the buffers' images", "blank images"):
                if inputs == "blank images":
                    with self.stream:
                        fill(x, 0.0)
                before = self._host(n)
                ref, mine = self._after(chain, n), self._after(whole, n)
                d, why = compare(before, mine, ref, tensors)
                worst = max(worst, d)
                if why is not None:
                    return None, f"{why} on {inputs}"
        finally:
            with self.stream:
                device_copy(x, images)
        return worst, None
