"""A model's operations planned per batch size: a Step for each n, made on first use and kept.

Note [a whole step]: at small batches a training step is a chain of about ten short launches whose
latencies make its time (docs/performance.md). Our engine offers the whole step as one launch of
thread-block clusters on sm_90 and newer, up to lenet.kernels.step.LIMIT images (lenet/kernels/
step_cluster.cu). The planner times it against the chain (the chain first: under a reproducible policy the
chain runs, as it did before), after checking it against the chain's result from the same state (Note
[checking a whole step] in lenet/step_check.py), and keeps the faster. A Step then trains with it (``train()``),
and its planned operations still run everything else: an evaluation, ``forward()`` and ``backward()`` alone,
lenet.torch's operators. The whole step writes what a training step's caller reads (the loss's totals, the
logits, every gradient, the updated state), not the activations in between.
"""

from __future__ import annotations

from dataclasses import dataclass

from .engines.base import forward_only_error
from .ops import forward_only


@dataclass
class Step:
    """The planned operations for one batch size, in the network's order: the stages, the head, and
    the loss (which the head's forward may run itself in a training step)."""

    n: int
    stages: list
    head: object
    loss: object
    side: object   # lenet.engines.context.SideStream
    update: object = None   # the planned update (lenet.engines.base.PlannedOp)
    whole: object = None    # the whole step, where it beats the chain (Note [a whole step]), else None
    forward_only: bool = False   # planned for an evaluation alone (Note [forward-only plans] in lenet/ops.py)

    @property
    def layers(self) -> list:
        return [*self.stages, self.head]

    def forward(self) -> None:
        """The logits (evaluation: the loss is the caller's, ``loss.evaluate()``)."""
        for layer in self.layers:
            layer.forward()

    def forward_loss(self) -> None:
        """A training step's forward: the logits, the mean loss and dlogits (the loss's total may still be
        on the side stream: ``side.join()`` before reading it; ``backward()`` joins)."""
        for stage in self.stages:
            stage.forward()
        self.head.forward_loss()

    def train(self) -> None:
        """One training step: the forward with the loss, every gradient, the update (the whole step's one or
        two launches where it was chosen)."""
        self._trains()
        if self.whole is not None:
            self.whole.train()
            return
        self.chain()

    def chain(self) -> None:
        """One training step of the planned operations, one after another."""
        self._trains()
        self.forward_loss()
        self.backward()
        self.update()

    def backward(self) -> None:
        """Every gradient, the side stream's work included (Note [side stream] in lenet/engines/context.py)."""
        self._trains()
        for layer in reversed(self.layers):
            layer.backward()
        self.side.join()

    def backward_given(self) -> None:
        """Every gradient from dlogits the caller wrote after ``forward()`` (a loss of its own:
        lenet/torch.py), the side stream's work included."""
        self._trains()
        self.head.backward_given()
        for stage in reversed(self.stages):
            stage.backward()
        self.side.join()

    def _trains(self) -> None:
        """Refuses, before any launch, what a Step planned forward only cannot run (a head of it may have bound a
        backward, which would write gradients before a stage refused)."""
        if self.forward_only:
            raise forward_only_error("the step", self.n)

    @property
    def workspace_bytes(self) -> int:
        return max(layer.workspace_bytes for layer in self.layers)

    def describe(self) -> list[dict]:
        rows = []
        for op in self.layers:
            for row in op.describe():
                rows.append({**row, "candidates_ms": op.times})
        rows = rows if self.head.fuses_loss else rows + self.loss.describe()
        if self.whole is not None:   # what a training step runs; the rows above, what the rest runs
            rows = [{**row, "candidates_ms": self.whole.times} for row in self.whole.describe()] + rows
        return rows


class Plans:
    """The Steps of a model's operations (lenet.network.Operations), planned by ``planner`` (lenet/plan.py)
    for batch sizes 1 to ``max_batch``; choices stored in ``store`` (lenet/plancache.py) when given. A batch
    size only evaluated is planned forward only (``plan_forward``; Note [forward-only plans] in lenet/ops.py)."""

    def __init__(self, planner, operations, max_batch: int, store=None, update=None, superseded=None):
        self.planner, self.operations, self.max_batch, self.store = planner, operations, max_batch, store
        self.update = update   # the planned update, which a training step runs after the chain
        self.superseded = superseded   # called when a size planned forward only is planned for training
        self.steps: dict[int, Step] = {}
        self.forward_steps: dict[int, Step] = {}   # sizes planned forward only, and not (yet) for training

    def planned(self, n: int) -> bool:
        """Whether batch size n has its training Step (``plan`` would not search)."""
        return n in self.steps

    def plan(self, n: int) -> Step:
        """Every operation planned for batch size n (made once, then kept). Where n was planned forward only,
        that Step is let go and ``superseded`` called: what was captured with it (an evaluation's graph) must
        be captured again with this one."""
        step = self.steps.get(n)
        if step is not None:
            return step
        step = self._make(n, False)
        if self.update is not None:
            step.whole = self.planner.plan_whole(self.operations.step, n, step.chain)
        self.steps[n] = step
        if self.forward_steps.pop(n, None) is not None and self.superseded is not None:
            self.superseded()
        self._flush()
        return step

    def plan_forward(self, n: int) -> Step:
        """What an evaluation at batch size n runs: the Step planned for training where there is one, else one
        planned forward only (made once, then kept)."""
        step = self.steps.get(n) or self.forward_steps.get(n)
        if step is not None:
            return step
        step = self.forward_steps[n] = self._make(n, True)
        self._flush()
        return step

    def _make(self, n: int, forward: bool) -> Step:
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"batch size {n} is outside 1..{self.max_batch} (this model's max_batch)")
        plan, ops = self.planner.plan, self.operations

        def form(op):
            return forward_only(op) if forward else op
        stages = [plan(form(s), n) for s in ops.stages]
        head = plan(form(ops.head_unmasked if stages[-1].masks_dy else ops.head), n)
        step = Step(n, stages, head, plan(ops.loss, n), self.planner.ctx.side, None if forward else self.update,
                    forward_only=forward)
        self.planner.ctx.workspace.reserve(step.workspace_bytes)   # may re-allocate: see Note [re-capture]
        return step

    def _flush(self) -> None:
        if self.store is not None:
            self.store.flush()

    def clear(self) -> None:
        self.steps.clear()
        self.forward_steps.clear()

    def replan(self) -> None:
        """Every planned batch size's Step made again (under the planner's policy now), in its form."""
        sizes, forward = list(self.steps), list(self.forward_steps)
        self.clear()
        for n in sizes:
            self.plan(n)
        for n in forward:
            self.plan_forward(n)
