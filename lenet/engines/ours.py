"""Our engine: kernels of our own (lenet/kernels/), for every operation of the network.

  stage   each direction fused into one kernel (stage*.cu; the backward plus one reduction of the
          per-block weight and bias gradients): the candidates are launch shapes and kernel versions
          (lenet/kernels/stages.py), chosen per direction by the planner, each checked against cuDNN's
          exact result first (Note [checking a stage] in lenet/engines/reference.py)
  head    the forward, loss, dlogits and data gradients in one kernel (head.cu: G images per block
          iteration) or two (head_split.cu: fc1 over 15 blocks a slice of G images, then the rest over 8;
          Note [head split]), and the weight gradients on the side stream (head_weights.cu); or, at large
          batches, fc1 and its two gradient products on cuBLASLt and the rest in one pass of ours
          (head_tail.cu: Note [head tail]); the form and G are the candidates (Note [head latency] in
          lenet/kernels/head.cu); a pack's, their pack versions, each model on its lone run's grid
          (head_common.cu)
  loss    softmax cross-entropy (softmax_ce.cu), where the head does not fuse it; and evaluation's
  update  SGD with momentum, weight decay and the moving average, one launch (sgd.cu)
  step    the whole training step at small batches in one launch of thread-block clusters (step_cluster.cu,
          sm_90 and newer; ours_step.py), timed against the chain of the launches above (Note [a whole
          step] in lenet/steps.py)

``heuristic`` takes each list's first launch shape (a rule: no timing), ``exhaustive`` times them all.
Our kernels are float32 and deterministic: a fixed launch shape sums the gradients in a fixed order (Note
[stage backward through the argmax] in stage_common.cu). FMA float32, but for conv2's backward versions 7 and 8,
whose weight gradient runs on the tensor cores as three TF32 products per float32 product, within float32's
accuracy (Note [three tf32 products] in lenet/kernels/tf32.cu); it passes the same check.

The engine's parts: its stages (ours_stage.py), their checks against cuDNN (ours_check.py), its head
(ours_head.py), its whole step (ours_step.py); this file holds its rules, the protocol, and the loss and the update.

Note [pinned candidates]: --algo may name one of our candidates as train_step prints it:
``fused-fwd-v1-i1-g8`` pins the stages' forward, ``fused-bwd-v2-g4`` their backward (both backward
directions of the policy). A pinned candidate still passes the check against cuDNN's exact result;
one a stage does not offer (conv1 ships forward version 1 and backward version 2, conv2 forward versions 1
and 2 and backward versions 3, 4, 5, 7 and 8: ``fused-bwd-v3-...`` to ``fused-bwd-v8-...`` pin conv2's and are
refused for conv1; a version that moved to dev/ is no kernel of ours) is an error naming those it has.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from descriptors.algorithms import UnknownAlgorithmError

from ..kernels import SoftmaxCE, prefetch, sgd_launch, source_digest
from ..kernels import head as head_kernels
from ..kernels.head import HeadShape
from ..kernels import stages
from ..kernels.stages import Forward
from .base import Engine, Named, PlannedOp, sums_as_lone
from .ours_head import OurHead
from .ours_stage import OurStages
from .ours_step import OurStep


def pins(name: str) -> tuple[str, ...]:
    """The policy directions a candidate name of ours fixes: a forward's, "fwd"; a backward's, both
    backward directions (one kernel computes the stage's data and weight gradients). A name of our form
    that no stage's kernels offer (a version, an image count or a grid that does not exist) is an
    UnknownAlgorithmError naming those that do: checked with the flags, before any GPU work."""
    c = stages.parse_name(name)
    if c is None:
        return ()
    if not any(ks.offers(c) for ks in stages.kernels().values()):
        raise UnknownAlgorithmError(f"--algo {name}: no kernel of ours has that name; ours are {stages.names()}")
    return ("fwd",) if isinstance(c, Forward) else ("bwd-data", "bwd-filter")




class Ours(OurStages, OurHead, OurStep, Engine):
    name = "ours"
    flag = "ours"
    runs = "our kernels only"
    kinds = ("stage", "head", "loss", "update", "step")
    everywhere = ("loss", "update")   # our kernels alone run these, under every engine

    # ---------------------------------------------------------------- rules

    def pins(self, name: str) -> tuple[str, ...]:
        return pins(name)

    def refuses(self, op, policy) -> str | None:
        if op.kind in self.everywhere:
            return None
        if not policy.fused:
            return "fusion is off (--no-fused), and our stages and head are fused kernels"
        if op.kind == "step":
            return self._step_refuses(op, policy)
        if op.kind != "stage":
            return None
        if policy.chunk is not None:
            return "runs the whole batch in one launch, and --chunk fixes cuDNN's calls"
        theirs = [name for name, owner in policy.owners().items() if owner != self.name]
        if theirs:
            return f"--algo names cuDNN's {theirs[0]}"
        if op.spec.dx and not op.spec.dx_mask:
            return f"no kernel of ours computes stage {op.spec.name}'s unmasked input gradient (the images')"
        if stages.for_spec(op.spec) is None:
            return f"no kernel of ours for x {op.spec.x}, w {op.spec.w}"
        return None

    def refuses_flags(self, policy) -> str | None:
        if not policy.fused:
            return "runs our fused stage kernels only: drop --no-fused, or name a cuDNN engine"
        if policy.chunk is not None:
            return "runs each stage in one launch over the whole batch: --chunk applies to cuDNN's engines only"
        return None

    def version(self) -> str:
        """The kernels' sources and the architecture they are compiled for (Note [kernel architecture] in
        lenet/kernels/nvrtc.py): a stored choice of another either is searched again."""
        from ..kernels import nvrtc

        want = nvrtc.requested_arch()
        return source_digest() + (f"-compute_{want}" if want is not None else "")

    def scratch_per_image(self, op, policy) -> int:
        """Bytes per image of max_batch this engine allocates for ``op``: a stage's argmax bytes; in a pack,
        its head's partial rows, and under --deterministic its stages' on each model's lone grid (at most
        one row per image: Note [a pack and a lone run] in lenet/pack.py)."""
        if op.kind == "stage":
            lone = op.models > 1 and policy.deterministic
            return int(np.prod(op.spec.y)) + (4 * stages.for_spec(op.spec).width if lone else 0)
        return -(-4 * head_kernels.WIDTH // head_kernels.HEAD_PER[0]) if op.kind == "head" and op.models > 1 else 0

    def warm(self, batches=None, pack: bool = False, policy=None) -> None:
        """Start compiling the kernels the heuristic runs at these batch sizes (or reading them from the
        kernel cache) on threads of their own (Note [first run] in lenet/kernels/nvrtc.py), and the whole
        step's forms offered at them, which the planner checks and times at its first plan of each size
        (Note [the whole step's batch sizes] in lenet/kernels/step.py): compiled there, one after the other,
        two forms held a first plan at 64 images 1.3 and 1.8 s (docs/performance.md, "Time to accuracy").
        The rest compile when a plan asks for them: versions only a search times would share the CPU with
        the compiles a first step waits for. A program of packs (``pack``) runs no whole step, nor one whose
        ``policy`` lets none run (--algo fixing a stage's candidate, --chunk, --deterministic): no form then."""
        from ..kernels import arch, step as step_kernels

        large = not batches or max(batches) >= head_kernels.TAIL_HEURISTIC_MIN   # the tail form's kernels
        prefetch(stages.heuristic_modules(batches) + (("head_tail",) if large else ()))
        if batches and not pack and arch() >= step_kernels.ARCH and self._step_may_run(policy):
            prefetch(dict.fromkeys(f.module for n in batches for f in step_kernels.forms(n)))

    # ---------------------------------------------------------------- the protocol

    def candidates(self, op, n: int, planner) -> list:
        """A stage's directions are checked as they are chosen (``_direction``); the head, the loss and the
        update are held to PyTorch's in float64 by the GPU tests, not at plan time."""
        if op.kind == "head":
            # A pack that sums as its lone runs takes its lone run's shapes (Note [a pack and a lone run] in
            # lenet/pack.py); a reproducible policy's rule never the tail form, whose sums are cuBLASLt's
            # algorithms' (a search still may).
            policy, K = planner.policy, op.models
            heuristic = policy.choice("fwd") == "heuristic"
            lone = K > 1 and sums_as_lone(K, n, policy)
            return [replace(s, engine=self.name) for s in head_kernels.shapes(n, heuristic, 1 if lone else K)
                    if not (policy.reproducible and s.form == "tail")]
        if op.kind == "step":
            return self._step_candidates(op, n)
        return [Named(self.name, {"stage": "fused kernels", "loss": "softmax_ce", "update": "sgd"}[op.kind])]

    def recall(self, op, n: int, stored: dict, planner):
        if op.kind == "head":
            shape = HeadShape.decode(stored)
            return next((c for c in self.candidates(op, n, planner) if c == shape), None)
        if op.kind == "step":
            return next((c for c in self.candidates(op, n, planner) if c.name == stored.get("name")), None)
        return next(iter(self.candidates(op, n, planner)), None)

    def bind(self, op, n: int, candidate, planner) -> PlannedOp:
        if op.kind == "stage":
            return self._stage(op, n, planner)
        if op.kind == "head":
            return self._head(op, n, candidate, planner)
        if op.kind == "step":
            return self._step_bind(op, n, candidate, planner)
        if op.kind == "loss":
            K = op.models
            sce = self._scratch(planner, ("sce", K), lambda: SoftmaxCE(models=K))
            return PlannedLoss(self.name, op.tensors, n, sce, planner.ctx.stream, K)
        return PlannedUpdate(self.name, op.tensors, planner.ctx.stream)


class PlannedLoss(PlannedOp):
    """Softmax cross-entropy at batch n. ``train()``: the mean loss (label-smoothed) into ``loss``,
    dlogits, and the running sum; ``evaluate()``: the summed plain loss and right answers added to the
    device totals, scored on the mean of the logits and ``mean_with`` when given."""

    def __init__(self, engine: str, t, n: int, sce: SoftmaxCE, stream, models: int = 1):
        self.engine, self.n, self.t, self.sce, self.stream, self.models = engine, n, t, sce, stream, models
        rows = models * n   # a pack's models one after another (Note [packs] in lenet/ops.py)
        self.logits, self.labels, self.dlogits = t.logits[:rows], t.labels[:rows], t.dlogits[:rows]

    def train(self) -> None:
        t, n = self.t, self.n
        with self.stream:
            self.sce.forward_backward(self.logits, self.labels, self.dlogits, t.loss, t.correct, n,
                                      grad_scale=1.0 / n, loss_scale=1.0 / n, running=t.running,
                                      label_smoothing=t.label_smoothing, models=self.models)

    def evaluate(self, mean_with=None) -> None:
        t, n = self.t, self.n
        with self.stream:
            self.sce.forward_backward(self.logits, self.labels, None, t.loss, t.correct, n,
                                      grad_scale=1.0 / n, loss_scale=1.0, accumulate=True, mean_with=mean_with,
                                      models=self.models)

    def describe(self, ms: float | None = None) -> list[dict]:
        return [{"layer": "loss", "op": "softmax-CE fwd+bwd", "engine": self.engine, "algo": "softmax_ce_kernel",
                 "chunk": self.n, "chunks": 1, "workspace_bytes": 0}]


class PlannedUpdate(PlannedOp):
    """PyTorch's torch.optim.SGD rule with momentum (plain or Nesterov) and weight decay, the learning
    rate read from device memory; then ema += (1 - ema_decay) * (params - ema) when the model keeps a
    moving average. One launch over the flat buffers (lenet.ops.UpdateTensors)."""

    def __init__(self, engine: str, t, stream):
        self.engine, self.t = engine, t
        self._launch = sgd_launch(stream, t.params, t.grads, t.velocity, t.lr, t.momentum, t.weight_decay,
                                  t.nesterov, t.ema, t.ema_decay or 0.0, t.models, t.hyper)

    def __call__(self) -> None:
        self._launch()

    def describe(self, ms: float | None = None) -> list[dict]:
        what = ("nesterov " if self.t.nesterov else "") + ("+ ema" if self.t.ema_decay else "")
        return [{"layer": "sgd", "op": ("update " + what).strip(), "engine": self.engine, "algo": "sgd_kernel",
                 "chunk": None, "chunks": 1, "workspace_bytes": 0}]

