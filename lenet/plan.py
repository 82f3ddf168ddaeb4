"""The one planner: for an operation of the network at a batch size, recall a stored choice, else check
every candidate of every engine the policy lets compete against the exact reference, time the
survivors as the step runs them, pick, and store. A model owns one (its decisions, its store, every
engine's GPU objects for it); nothing here is shared between two models.

    planner = Planner(handle, policy, max_batch=64, store=plan_cache)
    planned = planner.plan(stage, n)          # lenet/ops.py's operation at batch n: a PlannedOp
    planned.forward(); planned.backward()     # no arguments: a step can be captured in a CUDA graph

Every choice made by measurement goes through ``choose`` (the loop) under a key from ``key`` (the one
format: the operation, its shape, the policy, the versions of the competing engines, the device and
how candidates are timed); engines make their own finer choices through the same two, each one loop
whose candidates are whole ways to run their part: a convolution direction's chunk size with the
candidates of its calls (lenet/engines/cudnn.py: ConvSearch), the pooling's chunk size, our kernels'
launch shapes, the tail's matmul algorithms and slices. Each is made while binding the engine's
candidate for the operation, one level below ``plan``'s loop, never inside another part's loop; an
operation another one runs (the head's loss) is planned before it (Note [the head's loss]).

Note [search state]: what planning learns (every decision, the checks and references the engines
keep, the cuDNN objects they make) and the store of choices across processes belong to one Planner,
which a model owns: two models in one process share nothing mutable, and a model's state goes with it
(``close``).

Note [stage engines]: what a stage's forward leaves for its backward differs by engine (cuDNN's
pooling backward reads the unpooled output, ours one argmax byte per window), so one engine runs both
directions of a stage. Each engine chooses its candidates for each direction itself (cuDNN: the
convolution's candidates and chunks; ours: launch shapes), and the engines then compete on forward +
backward, each timed on the stage's own tensors as the step runs them (in a CUDA graph, or as eager
launches). Planning therefore writes the stage's outputs and gradients, never a parameter; planning
the head runs a training forward, whose loss totals are put back after (an evaluation may be planning
a batch size in the middle of its sums).

Note [reproducible choices]: timing is not reproducible, and a different candidate or chunk size
changes float32 rounding. With ``deterministic`` and the heuristic policy, timing therefore decides
nothing: the first engine (in the registry's order) that runs an operation wins, each engine takes its
first-ranked candidate that runs and passes its check, and chunks are chosen by rule, so reruns and
resumed runs are bit-identical. exhaustive always times.

Note [stored choices]: a search times candidates, from under a second for LeNet's step at batch 64 to
minutes at 65536 (docs/engines.md, "What a search costs"). A Planner given a store (lenet/plancache.py keeps one on disk) puts every choice there under
its key and, before searching, recalls one: the choice's engine must still serve the operation and
the engine must still offer the stored candidate (a graph plan is built alone for it: Note [one plan]
in descriptors/graph.py), else it is searched again. The store adds the GPU, the driver and the
libraries' versions to the key; the key holds the rest (ours: a digest of our kernel sources).

Note [the head's loss]: the loss after the head (softmax cross-entropy) is an operation of its own,
which the model plans and runs after the head (lenet/model.py: Step). A head that computes it itself
(``fuses_loss``) runs none; one that does not runs the planned loss in its training forward, and is
timed with it. So planning a head first plans its loss, as its own operation at the same batch size
(the same decision the model's own asks for, made once), and a head engine's ``bind`` takes it from
``planner.loss(op, n)``: no engine plans another operation inside its own.

Note [side stream] is in lenet/engines/context.py, with the other resources the engines share.
"""

from __future__ import annotations

import json
import math

from descriptors.algorithms import AlgorithmNotSupportedError

from .engines import registry
from .engines.base import Check, Chosen, Decision, Named, Trial, label
from .engines.context import Context, SideStream
from .ops import Loss
from .step_check import StepState
from .timing import time_forward_backward, time_launcher


class Planner:
    """One model's planning (Note [search state]): the policy, the store of choices (or None), and ``ctx``,
    what the planned operations share (lenet/engines/context.py: the handle and its stream, the workspace,
    cuBLAS and cuBLASLt, the side stream, how the step runs)."""

    def __init__(self, handle, policy, *, max_batch: int, store=None, captured: bool = True):
        self.policy, self.store = policy, store
        self.ctx = Context(handle, max_batch, captured)
        self.decisions: dict[str, Decision] = {}
        self._states: dict[str, dict] = {}
        self._losses: dict[tuple, Chosen] = {}

    def state(self, engine: str) -> dict:
        """What engine ``engine`` keeps for this model (its cuDNN objects, scratch buffers, checks)."""
        return self._states.setdefault(engine, {})

    def key(self, op: str, shape: dict, engines, policy=None) -> dict:
        """The one key format of every choice (under the model's policy, or ``policy``)."""
        return {"op": op, "shape": shape, "policy": (policy or self.policy).key(),
                "engines": {e.name: e.version() for e in engines}, "device": self.ctx.device_id,
                "captured": self.ctx.captured}

    # ------------------------------------------------------------------ the loop

    def choose(self, key: dict, candidates, trial, *, rule: str = "fastest", recall=None, encode=None,
               what: str = "") -> Decision:
        """The one loop: a decision made before under ``key`` (this model's, then the store's, rebuilt by
        ``recall(stored) -> Trial | None``), else every candidate (a list, or a callable returning one)
        tried by ``trial(candidate, best_ms) -> Trial | str`` (a str: why it is refused) under ``rule``:
        "fastest" (every candidate), "first-per-engine" (each engine's first that passes; the heuristic),
        "first" (the first that passes; timing decides nothing). The survivors are sorted by time (but
        under "first"); ``encode(decision) -> dict`` is what the store keeps."""
        k = json.dumps(key, sort_keys=True, default=str)
        hit = self.decisions.get(k)
        if hit is not None:
            return hit
        d = self._recall(key, recall)
        if d is None:
            d = self._search(candidates() if callable(candidates) else candidates, trial, rule, what)
            if encode is not None and self.store is not None:
                self.store.put(key, encode(d))
        self.decisions[k] = d
        return d

    def _recall(self, key: dict, recall) -> Decision | None:
        if recall is None or self.store is None:
            return None
        stored = self.store.get(key)
        if not isinstance(stored, dict):
            return None
        try:
            t = recall(stored)
        except (AlgorithmNotSupportedError, KeyError, TypeError, ValueError):
            return None
        return None if t is None else Decision([t], {}, recalled=True)

    @staticmethod
    def _search(candidates, trial, rule: str, what: str) -> Decision:
        table, refused, engines, best = [], {}, set(), math.inf
        for c in candidates:
            engine = c.engine
            if (rule == "first" and table) or (rule == "first-per-engine" and engine in engines):
                continue
            t = trial(c, best)
            if isinstance(t, str):
                refused[label(c)] = t
                continue
            table.append(t)
            engines.add(engine)
            if t.ms is not None:
                best = min(best, t.ms)
        if not table:
            raise AlgorithmNotSupportedError(f"no candidate for {what} passed: "
                                             + ("; ".join(f"{k} {v}" for k, v in list(refused.items())[:6])
                                                or "none offered"))
        if rule != "first":
            table.sort(key=lambda t: math.inf if t.ms is None else t.ms)
        return Decision(table, refused)

    # ------------------------------------------------------------------ operations

    def plan(self, op, n: int) -> Chosen:
        """Operation ``op`` (lenet/ops.py) at batch n, run by the engine that wins (Note [stage engines]):
        the winner's planned operation with every engine's measured time and why the others were refused.
        A head's loss first (Note [the head's loss])."""
        if op.kind == "head":
            loss = Loss(op.loss, op.max_batch, op.models)
            self._losses[(n, json.dumps(loss.key(), sort_keys=True))] = self.plan(loss, n)
        engines, why_not = registry.serving(op, self.policy)
        if not engines:
            raise AlgorithmNotSupportedError(f"no engine runs {op.kind} {op.name} under {self.policy}: "
                                             + "; ".join(f"{k} {v}" for k, v in why_not.items()))
        by_name = {e.name: e for e in engines}
        timed = op.kind in ("stage", "head")
        # one engine: no other to time it against; a pack (lenet sweep): its engines were not measured against each other
        lead = self.lead(op.kind) if len(engines) > 1 and getattr(op, "models", 1) == 1 else None
        if lead in by_name:   # Note [the heuristic's engine] in lenet/engines/registry.py: its first that passes
            engines = [by_name[lead], *(e for e in engines if e.name != lead)]
        untimed = self.policy.reproducible or lead in by_name

        def trial(c, best):
            try:
                planned = by_name[c.engine].bind(op, n, c, self)
            except AlgorithmNotSupportedError as err:
                return f"failed: {err}"
            self.ctx.workspace.reserve(planned.workspace_bytes)   # may re-allocate: see Note [re-capture]
            return Trial(c, self.time_step(op, planned) if timed else None, Check(), planned)

        def recall(stored):
            e = by_name.get(stored.get("engine"))
            c = e.recall(op, n, stored, self) if e is not None else None
            if c is None:
                return None
            planned = e.bind(op, n, c, self)
            self.ctx.workspace.reserve(planned.workspace_bytes)
            return Trial(c, stored.get("ms"), Check(stored.get("error")), planned)

        def encode(d):
            return {"engine": d.best.candidate.engine, **d.best.candidate.encode(), "ms": d.best.ms,
                    "error": d.best.check.error, "times": {label(t.candidate): t.ms for t in d.table}}

        key = self.key(f"{op.kind} {op.name}", {"n": n, **op.key()}, engines)
        d = self.choose(key, lambda: [c for e in engines for c in e.candidates(op, n, self)], trial,
                        rule="first" if untimed else "fastest", recall=recall if timed else None,
                        encode=encode if timed else None, what=f"{op.kind} {op.name} at batch {n}")
        return Chosen(d.best.plan, d.best.ms, {label(t.candidate): t.ms for t in d.table}, why_not)

    def plan_whole(self, op, n: int, chain) -> Chosen | None:
        """A whole training step (lenet.ops.WholeStep) at batch n where an engine offers one and it beats the
        chain of planned operations (``chain()`` runs one training step of them), checked against the chain's
        result first; None where the chain runs (Note [a whole step] in lenet/steps.py)."""
        engines, why_not = registry.serving(op, self.policy)
        offered = [c for e in engines for c in e.candidates(op, n, self)]
        if not offered:
            return None
        by_name = {e.name: e for e in engines}
        state = StepState(op, self.ctx.stream)
        first = self.policy.reproducible   # the chain, first, is taken untimed (Note [reproducible choices])

        def timed(fn) -> float:
            state.save()
            try:
                return self.time(fn)
            finally:
                state.restore()

        def trial(c, best):
            if c is CHAIN:
                return Trial(c, None if first else timed(chain), Check(), None)
            try:   # a launch this GPU refuses (a cluster it cannot place, shared memory it lacks): the chain runs
                planned = by_name[c.engine].bind(op, n, c, self)
                error, why = state.check(planned.train, chain, n)
                if why is not None:
                    return why
                return Trial(c, timed(planned.train), Check(error), planned)
            except _refusals() as err:
                return f"failed: {err}"

        def recall(stored):
            if stored.get("engine") == CHAIN.engine:
                return Trial(CHAIN, stored.get("ms"), Check(), None)
            e = by_name.get(stored.get("engine"))
            c = e.recall(op, n, stored, self) if e is not None else None
            return None if c is None else Trial(c, stored.get("ms"), Check(stored.get("error")), e.bind(op, n, c, self))

        def encode(d):
            return {"engine": d.best.candidate.engine, **d.best.candidate.encode(), "ms": d.best.ms,
                    "error": d.best.check.error, "times": {label(t.candidate): t.ms for t in d.table}}

        key = self.key(f"{op.kind} {op.name}", {"n": n, **op.key()}, engines)
        d = self.choose(key, [CHAIN, *offered], trial, rule="first" if first else "fastest",
                        recall=recall, encode=encode, what=f"the whole step at batch {n}")
        if d.best.candidate == CHAIN:
            return None
        return Chosen(d.best.plan, d.best.ms, {label(t.candidate): t.ms for t in d.table}, why_not)

    def lead(self, kind: str) -> str | None:
        """The engine the heuristic takes for operations of ``kind`` on this GPU without timing the others (Note
        [the heuristic's engine] in lenet/engines/registry.py); None: they are timed against each other."""
        from .kernels import arch

        return registry.measured_first(kind, self.policy, arch())

    def loss(self, head, n: int) -> Chosen:
        """The planned loss after ``head`` at batch n, for a head that leaves the loss to it (planned before
        the head's candidates were bound: Note [the head's loss])."""
        key = (n, json.dumps(Loss(head.loss, head.max_batch, head.models).key(), sort_keys=True))
        if key not in self._losses:
            raise AlgorithmNotSupportedError(f"the loss after {head.name} at batch {n} was not planned before it")
        return self._losses[key]

    def part_engines(self, kind: str, part, policy=None) -> list:
        """The engines that offer parts of ``kind`` (a convolution direction) and may run them under the
        model's policy (or ``policy``): what an engine that runs an operation by parts asks."""
        return registry.serving_parts(kind, part, policy or self.policy)

    # ------------------------------------------------------------------ timing

    def time(self, fn, cutoff_ms: float | None = None) -> float:
        """ms per call of ``fn`` (which launches on the model's stream), as the step runs it."""
        return time_launcher(fn, self.ctx.stream, graph=self.ctx.captured, cutoff_ms=cutoff_ms)

    def time_step(self, op, planned) -> float:
        """ms of what a training step runs of a planned stage or head: its forward (the head's with the
        loss), then its backward with the side stream's work joined; the loss totals put back after. A
        forward-only one's: its forward alone, as an evaluation runs it."""
        from .kernels import copy_of, device_copy

        ctx = self.ctx
        kept = op.totals()
        with ctx.stream:
            saved = [copy_of(a) for a in kept]
        if op.forward_only:   # what an evaluation runs of it (Note [forward-only plans] in lenet/ops.py)
            ms = time_launcher(planned.forward, ctx.stream, graph=ctx.captured)
        else:
            fwd = ctx.side.joined(planned.forward_loss)   # a loss beside it: joined
            ms = sum(time_forward_backward(fwd, ctx.side.joined(planned.backward), ctx.stream, graph=ctx.captured))
        with ctx.stream:
            for a, s in zip(kept, saved):
                device_copy(a, s)
        return ms

    def close(self) -> None:
        """Close what the engines made for this model (cuDNN's descriptors and graphs)."""
        registry.close(self._states)
        self._states.clear()
        self.decisions.clear()
        self._losses.clear()
        self.ctx.close()


# The chain of planned operations, as the whole step's first candidate (Note [a whole step] in lenet/steps.py).
CHAIN = Named("chain", "planned operations")


def _refusals() -> tuple:
    """The errors a candidate's binding or launch may raise that make it refused, not the plan failed."""
    from cupy_backends.cuda.api.driver import CUDADriverError
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    from .kernels.launch import LaunchError

    return AlgorithmNotSupportedError, LaunchError, ValueError, CUDADriverError, CUDARuntimeError

__all__ = ["Planner", "SideStream", "Context", "Trial", "Decision", "Chosen"]
