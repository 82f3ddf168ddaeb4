"""The network's operations: what each one computes and the tensors it reads and writes, with no word of
how. An engine (lenet/engines/) runs an operation; the planner (lenet/plan.py) chooses which.

    stage    conv (5x5, valid) + bias + ReLU + 2x2/2 max-pool, forward and backward
    head     fc1 + ReLU + fc2, forward and backward (an engine may fuse the loss into it)
             (either one forward only, for a batch size that is only evaluated: Note [forward-only plans])
    loss     softmax cross-entropy, mean over the batch, and its gradient
    update   SGD with momentum (plain or Nesterov), weight decay, and the weights' moving average
    step     all of the above for one training step, as one operation (an engine may run it whole:
             Note [a whole step] in lenet/steps.py)

Each holds its full-batch tensors (a batch of n uses their first n rows) and the largest batch it
takes; ``key()`` is what a stored choice names of it (pointer-free).

Note [packs]: ``models`` K > 1 is a pack (lenet sweep): K models of one architecture trained in one
step. A batch of n images per model is then the first K n rows of each activation, model m's at
[m n, (m + 1) n); the flat parameter buffers are (K, TOTAL), model m's row its own, and the tensors
an operation holds (w, b, the head's weights) are model 0's views. An engine that cannot take the
model from its grid refuses a pack.

Note [forward-only plans]: a batch size only an evaluation runs (the evaluation's own, the last batch of a
split) needs the forward alone. Its stages and head are then planned as ``forward_only`` operations
(``forward_only(op)``): the planner times their forward alone, and an engine may bind no backward (cuDNN
searches no gradient convolution, ours checks no backward kernel), which is what a search at a size costs
most. On a first run of the fast recipe the evaluation's batch of 1000 cost a whole step's plan (0.21-0.24 s
of the start-up's critical path, docs/performance.md). Their keys name it, so a stored choice of one form is
never taken for the other; a size a step then trains at is planned whole (lenet/steps.py: Plans).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from descriptors.candidates import ConvSpec


@dataclass(frozen=True)
class StageSpec:
    """conv (K x C x R x S, valid, stride 1) + bias + ReLU + 2x2/2 max-pool on (C, H, W) inputs:
    pointer-free, so it keys caches and stored choices. ``dx``: the stage computes its input's
    gradient, masked by the input being > 0 (``dx_mask``: the input is the previous stage's ReLU output)
    or not (the images' own gradient, which lenet.torch asks for where they require one)."""

    name: str       # the parameters' prefix: "conv1"
    x: tuple        # (C, H, W)
    w: tuple        # (K, C, R, S)
    dx: bool = False
    dx_mask: bool = True

    def __post_init__(self):
        object.__setattr__(self, "x", tuple(int(v) for v in self.x))
        object.__setattr__(self, "w", tuple(int(v) for v in self.w))
        if len(self.x) != 3 or len(self.w) != 4 or self.x[0] != self.w[1]:
            raise ValueError(f"stage {self.name}: x must be (C, H, W) and w (K, C, R, S) with the same C, "
                             f"got {self.x} and {self.w}")
        h, w = self.conv_hw
        if h < 2 or w < 2 or h % 2 or w % 2:
            raise ValueError(f"stage {self.name}: the {h}x{w} convolution output cannot be pooled 2x2/2")

    @property
    def conv_hw(self) -> tuple[int, int]:
        return self.x[1] - self.w[2] + 1, self.x[2] - self.w[3] + 1

    @property
    def conv_chw(self) -> tuple[int, int, int]:
        return (self.w[0], *self.conv_hw)

    @property
    def y(self) -> tuple[int, int, int]:
        """The pooled output's (K, H / 2, W / 2)."""
        h, w = self.conv_hw
        return self.w[0], h // 2, w // 2

    def conv(self, direction: str, n: int, epilogue: str = "") -> ConvSpec:
        """The ConvSpec of one direction of this stage's convolution at batch n."""
        return ConvSpec(direction, int(n), self.x, self.w, epilogue=epilogue)

    def key(self) -> dict:
        k = dataclasses.asdict(self)
        if k.pop("dx_mask"):   # the masked form's key is the one stored before the images' gradient existed
            return k
        return {**k, "dx_mask": False}


def shifted(a, floats: int):
    """A view of a's shape ``floats`` elements further into its allocation (model m's parameter of a pack)."""
    if floats == 0:
        return a
    import cupy

    return cupy.ndarray(a.shape, a.dtype, a.data + floats * a.itemsize)


def _rows(a, n: int):
    return None if a is None else a[:n]


@dataclass(frozen=True)
class StageTensors:
    """x (N, C, H, W) input; y (N, K, H/2, W/2) pooled output; dy its gradient, masked by y > 0 (Note
    [relu at the pooled level] in lenet/engines/cudnn.py) unless the stage's engine masks it itself
    (``masks_dy`` in lenet/engines/base.py); dx the input's gradient (or None),
    masked by x > 0; w, b the parameters; dw, db their gradients (views into the flat buffers)."""

    x: object
    y: object
    dy: object
    w: object
    b: object
    dw: object
    db: object
    dx: object = None

    def model(self, m: int, n: int, stride: int) -> "StageTensors":
        """Model m's tensors in a pack of n images per model whose parameters lie ``stride`` floats apart
        (Note [packs]): an engine that runs a pack one model at a time binds each model's."""
        rows = slice(m * n, (m + 1) * n)
        return StageTensors(x=self.x[rows], y=self.y[rows], dy=self.dy[rows], w=shifted(self.w, m * stride),
                            b=shifted(self.b, m * stride), dw=shifted(self.dw, m * stride),
                            db=shifted(self.db, m * stride), dx=None if self.dx is None else self.dx[rows])

    def rows(self, n: int) -> "StageTensors":
        """The first n rows (a pack's K models at n images each: K n rows)."""
        return dataclasses.replace(self, x=self.x[:n], y=self.y[:n], dy=self.dy[:n], dx=_rows(self.dx, n))


@dataclass(frozen=True)
class HeadTensors:
    """x (N, 256) the flattened stage output, a ReLU's output (its mask masks dx); dx (N, 256) its
    gradient; h1 (N, 120) relu(fc1), dh1 its gradient; logits, dlogits (N, 10); w, g the parameters'
    and gradients' named views (fc1.weight .. fc2.bias); grads the flat gradient buffer from fc1.weight
    to fc2.bias (padding included)."""

    x: object
    dx: object
    h1: object
    dh1: object
    logits: object
    dlogits: object
    w: dict
    g: dict
    grads: object


@dataclass(frozen=True)
class LossTensors:
    """labels (N,) int32; loss (1,) the mean loss of the last training forward, or the summed loss of
    an evaluation; correct (1,) int32 right answers; running (1,) the sum of step losses since its
    reset; label_smoothing, PyTorch's cross_entropy(label_smoothing=)."""

    logits: object
    dlogits: object
    labels: object
    loss: object
    correct: object
    running: object
    label_smoothing: object = 0.0   # a float, or a pack's (K,) device array


@dataclass(frozen=True)
class UpdateTensors:
    """The flat buffers of one layout: params, grads, velocity (momentum), ema (the weights' moving
    average, or None); lr (1,) the learning rate on the device; and the rule's constants."""

    params: object
    grads: object
    velocity: object
    lr: object
    ema: object = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    ema_decay: float | None = None
    models: int = 1
    hyper: object = None   # a pack's (K, 4) device array: momentum, weight decay, nesterov, 1 - ema decay


def _pack_key(key: dict, models: int) -> dict:
    """A pack's key names its models; one model's is the key stored before packs existed."""
    return key if models == 1 else {**key, "models": int(models)}


def _forward_key(key: dict, forward_only: bool) -> dict:
    """A forward-only operation's key names it; the whole one's is the key stored before."""
    return {**key, "forward_only": True} if forward_only else key


def forward_only(op):
    """The stage or head ``op`` for a batch size only evaluated (Note [forward-only plans])."""
    return dataclasses.replace(op, forward_only=True)


def either_form_key(op) -> dict:
    """``op``'s key whichever its form: what a choice that serves both forms is stored under (a forward's)."""
    return {k: v for k, v in op.key().items() if k != "forward_only"}


@dataclass(frozen=True, eq=False)
class Stage:
    kind = "stage"
    spec: StageSpec
    tensors: StageTensors
    max_batch: int
    models: int = 1
    forward_only: bool = False   # Note [forward-only plans]

    @property
    def name(self) -> str:
        return self.spec.name

    def key(self) -> dict:
        return _forward_key(_pack_key(self.spec.key(), self.models), self.forward_only)

    def totals(self) -> tuple:
        """The device totals its planning must put back: none (lenet/plan.py)."""
        return ()


@dataclass(frozen=True, eq=False)
class Head:
    """fc1 + ReLU + fc2, and the loss after it (which an engine may fuse into its forward). ``dx_mask``:
    dx must be masked by x > 0 (the stage below takes its gradient masked), or may be left unmasked (the
    stage below masks it itself: ``masks_dy`` in lenet/engines/base.py; an engine may mask anyway)."""

    kind = "head"
    tensors: HeadTensors
    loss: LossTensors
    max_batch: int
    models: int = 1
    dx_mask: bool = True
    forward_only: bool = False   # Note [forward-only plans]
    name = "fc1+fc2"

    def key(self) -> dict:
        k = _pack_key({"fc1": list(self.tensors.w["fc1.weight"].shape),
                       "fc2": list(self.tensors.w["fc2.weight"].shape)}, self.models)
        k = k if self.dx_mask else {**k, "dx_mask": False}   # the masked form's key: the one stored before
        return _forward_key(k, self.forward_only)

    def totals(self) -> tuple:
        """The device totals a training forward adds to, which planning puts back (lenet/plan.py)."""
        return self.loss.loss, self.loss.correct, self.loss.running


@dataclass(frozen=True, eq=False)
class Loss:
    kind = "loss"
    tensors: LossTensors
    max_batch: int
    models: int = 1
    name = "loss"

    def key(self) -> dict:
        return _pack_key({"classes": int(self.tensors.logits.shape[1])}, self.models)


@dataclass(frozen=True, eq=False)
class Update:
    kind = "update"
    tensors: UpdateTensors
    name = "sgd"

    @property
    def models(self) -> int:
        return self.tensors.models

    def key(self) -> dict:
        t = self.tensors
        return _pack_key({"size": int(t.params.size) // t.models, "nesterov": t.nesterov, "ema": t.ema is not None},
                         t.models)


@dataclass(frozen=True, eq=False)
class WholeStep:
    """One training step (the stages, the head, the loss and the update) as one operation: what it reads
    and writes are the stages' input and parameters, the loss's tensors (its logits too) and the update's
    buffers; its activations in between are the engine's own."""

    kind = "step"
    stages: tuple          # the network's Stage operations, in order
    loss: LossTensors
    update: UpdateTensors
    max_batch: int
    models: int = 1
    name = "train step"

    def key(self) -> dict:
        t = self.update
        return _pack_key({"stages": [s.spec.key() for s in self.stages], "size": int(t.params.size) // t.models,
                          "nesterov": t.nesterov, "ema": t.ema is not None}, self.models)


__all__ = ["StageSpec", "StageTensors", "HeadTensors", "LossTensors", "UpdateTensors", "Stage", "Head", "Loss",
           "Update", "WholeStep", "forward_only", "either_form_key"]
