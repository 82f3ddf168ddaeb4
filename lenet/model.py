"""LeNet-5 as a list of planned operations on one CUDA stream.

    x (N,1,28,28)
    conv1 6@5x5 + bias -> ReLU -> maxpool 2x2/2     (N,6,12,12)
    conv2 16@5x5 + bias -> ReLU -> maxpool 2x2/2    (N,16,4,4)
    flatten 256 -> fc1 120 + bias -> ReLU -> fc2 10 + bias  (N,10)
    softmax cross-entropy, mean over the batch

Everything a step touches is made once, at construction, for ``max_batch``: every activation and
gradient buffer (BUFFERS), the flat parameter / gradient / velocity buffers. A batch of n <= max_batch
images uses the first n rows of each buffer and a Step made for n on first use (or by ``plan(n)``): each
operation (lenet/ops.py) planned for n by the model's planner (lenet/plan.py), which chooses the engine
and its candidates by measurement. A step then allocates nothing, never waits for the host and branches
on no device value, so lenet/runner.py can capture it in a CUDA graph and replay it (``cuda_graph=True``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from descriptors import Handle

from . import params as P
from .engines import Policy, registry
from .kernels import MIRROR, copy_of, count_nonfinite, device_copy, fill, gather_batch, gather_pack
from .ops import (Head, HeadTensors, Loss, LossTensors, Stage, StageSpec, StageTensors, Update,
                  UpdateTensors)
from .plan import Planner
from .runner import Runner

CLASSES = 10
IMAGE = (1, 28, 28)
STAGES = (StageSpec("conv1", (1, 28, 28), (6, 1, 5, 5)), StageSpec("conv2", (6, 12, 12), (16, 6, 5, 5), dx=True))
# The step's buffers: name -> (shape of one image's rows, dtype). Gradients of the pooled outputs are
# masked by them (Note [relu at the pooled level] in lenet/engines/cudnn.py).
BUFFERS = {
    "x": ((1, 28, 28), np.float32),        # input, random until loaded
    "labels": ((), np.int32),
    "p1": ((6, 12, 12), np.float32),       # maxpool(relu(conv1 + bias))
    "p2": ((16, 4, 4), np.float32),        # maxpool(relu(conv2 + bias)) = flat (N, 256)
    "h1": ((120,), np.float32),            # relu(fc1 + bias)
    "logits": ((CLASSES,), np.float32),
    "logits_kept": ((CLASSES,), np.float32),   # the first view's, under test-time augmentation
    "dlogits": ((CLASSES,), np.float32),
    "dh1": ((120,), np.float32),
    "dp2": ((16, 4, 4), np.float32),       # masked by p2 > 0
    "dp1": ((6, 12, 12), np.float32),      # masked by p1 > 0
}


def check_batch(x, y, max_batch: int) -> int:
    """Validate a host batch; return n. One-line ValueErrors, before any GPU work."""
    x_shape = tuple(getattr(x, "shape", ()) or ())
    if x_shape[1:] not in ((1, 28, 28), (28, 28)):
        raise ValueError(f"images must have shape (N, 1, 28, 28) or (N, 28, 28), got {x_shape or type(x)}")
    n = int(x_shape[0])
    if not 1 <= n <= max_batch:
        raise ValueError(f"batch of {n} images; this model takes 1 to {max_batch} (its max_batch)")
    y_shape = getattr(y, "shape", None)
    if y_shape != (n,):
        raise ValueError(f"labels must have shape ({n},) to match the images, got {y_shape}")
    if not np.issubdtype(np.dtype(y.dtype), np.integer):
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    if not np.issubdtype(np.dtype(x.dtype), np.floating):
        raise ValueError(f"images must be floating point, got dtype {x.dtype}")
    on_gpu = type(x).__module__.split(".")[0] != "numpy"
    # The labels (n integers) are read on the host; a device batch's images are counted by a kernel of
    # ours: CuPy's min, max and isfinite().all() reduce through CUB, each a module NVRTC compiles for
    # 2-2.5 s on a first run (Note [first run] in lenet/kernels/nvrtc.py).
    labels = y.get() if hasattr(y, "get") else np.asarray(y)
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= CLASSES:
        raise ValueError(f"labels must be in [0, {CLASSES}), got values from {lo} to {hi}")
    if count_nonfinite(x) if on_gpu else not bool(np.isfinite(x).all()):
        raise ValueError("images contain NaN or infinite values")
    return n


def bytes_per_image(policy: Policy | None = None, models: int = 1) -> int:
    """Bytes per image of max_batch that a model allocates under ``policy``: its buffers, and the scratch
    of every engine that may run its operations (cuDNN's unpooled outputs, our argmax bytes, fc1's ReLU
    bits for cuBLASLt)."""
    policy = policy or Policy()
    own = sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in BUFFERS.values())
    ops = [Stage(spec, None, 1, models) for spec in STAGES] + [Head(None, None, 1, models)]
    return own + sum(e.scratch_per_image(op, policy) for op in ops for e in registry.serving(op, policy)[0])


def check_pack(policy: Policy, models: int) -> None:
    """A one-line ValueError, before any GPU work, when no engine runs some operation of a pack of ``models``
    models under ``policy`` (the engines' own rules: Note [packs] in lenet/ops.py)."""
    for op in [Stage(spec, None, 1, models) for spec in STAGES] + [Head(None, None, 1, models)]:
        engines, why = registry.serving(op, policy)
        if not engines:
            raise ValueError(f"no engine runs the {op.kind} {op.name} of a pack of {models} models under this policy: "
                             + "; ".join(f"{k} {v}" for k, v in why.items()))


def models_that_fit(max_batch: int, free_bytes: int, policy: Policy | None = None) -> int:
    """How many models of ``max_batch`` images a pack may hold in ``free_bytes`` (check_memory's margin)."""
    return max(0, int((0.9 * free_bytes - (256 << 20)) // (max_batch * bytes_per_image(policy, 2))))


def check_memory(max_batch: int, free_bytes: int, total_bytes: int, policy: Policy | None = None,
                 models: int = 1) -> None:
    """A one-line ValueError, before anything is allocated, when a model (or a pack of ``models``) for
    ``max_batch`` images each cannot fit the GPU's free memory (with 10% and 256 MB kept for workspaces
    and libraries)."""
    need = models * max_batch * bytes_per_image(policy, models)
    if need > 0.9 * free_bytes - (256 << 20):
        gb = 1 << 30
        if models > 1:
            fit = models_that_fit(max_batch, free_bytes, policy)
            raise ValueError(f"a pack of {models} models at {max_batch:,} images each needs about {need / gb:.1f} GB "
                             f"of GPU memory; the GPU has {free_bytes / gb:.1f} GB free of {total_bytes / gb:.1f} GB: "
                             f"{fit} such models fit")
        raise ValueError(f"a model for {max_batch:,} images needs about {need / gb:.1f} GB of GPU memory; the GPU "
                         f"has {free_bytes / gb:.1f} GB free of {total_bytes / gb:.1f} GB: use a smaller batch")


def check_hyperparameters(momentum, weight_decay, nesterov, label_smoothing, ema_decay) -> None:
    """One-line ValueErrors for the optimizer's and the loss's constants, before any GPU work."""
    if not (0.0 <= momentum < 1.0):
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if not (weight_decay >= 0.0 and math.isfinite(weight_decay)):
        raise ValueError(f"weight decay must be >= 0, got {weight_decay}")
    if nesterov and momentum == 0.0:
        raise ValueError("Nesterov momentum needs a momentum > 0")
    if not (0.0 <= label_smoothing < 1.0):
        raise ValueError(f"label smoothing must be in [0, 1), got {label_smoothing}")
    if ema_decay is not None and not (0.0 < ema_decay < 1.0):
        raise ValueError(f"the EMA decay must be in (0, 1), got {ema_decay}")


def _constants(momentum, weight_decay, nesterov, ema_decay) -> np.ndarray:
    """A pack model's row of the update's constants (sgd.cu): momentum, weight decay, nesterov, ema weight
    (1: no average kept, the buffer copies the weights)."""
    return np.array([momentum, weight_decay, float(bool(nesterov)), 1.0 - (ema_decay or 0.0)], np.float32)


def per_model(value, models: int, name: str) -> list:
    """A setting of a pack (Note [packs] in lenet/ops.py): one value for every model, or a sequence of
    one per model."""
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != models:
            raise ValueError(f"{name}: {len(value)} values for a pack of {models} models; give one or {models}")
        return list(value)
    return [value] * models


def _policy(policy, fused) -> Policy:
    if policy is None:
        policy = Policy()
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a lenet.engines.Policy, got {type(policy).__name__}")
    return policy if fused is None else policy.replace(fused=bool(fused))


@dataclass
class Step:
    """The planned operations for one batch size, in the network's order: the stages, the head, and
    the loss (which the head's forward may run itself in a training step)."""

    n: int
    stages: list
    head: object
    loss: object
    side: object   # lenet.engines.context.SideStream

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

    def backward(self) -> None:
        """Every gradient, the side stream's work included (Note [side stream] in lenet/plan.py)."""
        for layer in reversed(self.layers):
            layer.backward()
        self.side.join()

    def backward_given(self) -> None:
        """Every gradient from dlogits the caller wrote after ``forward()`` (a loss of its own:
        lenet/torch.py), the side stream's work included."""
        self.head.backward_given()
        for stage in reversed(self.stages):
            stage.backward()
        self.side.join()

    @property
    def workspace_bytes(self) -> int:
        return max(layer.workspace_bytes for layer in self.layers)

    def describe(self) -> list[dict]:
        rows = []
        for op in self.layers:
            for row in op.describe():
                rows.append({**row, "candidates_ms": op.times})
        return rows if self.head.fuses_loss else rows + self.loss.describe()


class LeNet:
    """The network, its parameters and its optimizer state, on one CUDA stream.

    >>> model = LeNet(max_batch=64, seed=0)
    >>> model.train_step(x, y, lr=0.01)   # queued on model.stream; returns the device loss (1,)
    >>> model.loss()                      # waits for the stream, then reads it

    The device scalar lives on the model's own (non-blocking) stream: read it with ``loss()``, or
    after ``model.stream.synchronize()``; CuPy's default stream does not wait for it. ``policy``
    (lenet.engines.Policy) says which engines compete and how; ``fused``, when given, overrides its fusion.
    """

    def __init__(self, max_batch: int = 64, *, policy: Policy | None = None, seed=0,
                 momentum=0.0, weight_decay=0.0, nesterov=False, label_smoothing=0.0, ema_decay=None,
                 stream=None, cuda_graph: bool = False, fused: bool | None = None, plan_cache=False,
                 input_grad: bool = False, models: int = 1, keep_average: bool = False):
        if not isinstance(max_batch, (int, np.integer)) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if isinstance(models, bool) or not isinstance(models, (int, np.integer)) or models < 1:
            raise ValueError(f"models must be an integer >= 1, got {models!r}")
        K = self.models = int(models)   # a pack of K > 1: Note [packs] in lenet/ops.py; each setting one or K values
        self.keep_average = bool(keep_average)
        self.settings = {k: per_model(v, K, k) for k, v in (
            ("seed", seed), ("momentum", momentum), ("weight_decay", weight_decay), ("nesterov", nesterov),
            ("label_smoothing", label_smoothing), ("ema_decay", ema_decay))}
        for m in range(K):
            P.check_seed(self.settings["seed"][m])
            check_hyperparameters(*(self.settings[k][m] for k in ("momentum", "weight_decay", "nesterov",
                                                                   "label_smoothing", "ema_decay")))
        if K > 1 and input_grad:
            raise ValueError("the images' gradient is for one model (lenet.torch); a pack has models > 1")
        from descriptors import require_gpu

        from .kernels import require_arch

        require_arch(require_gpu())   # one line (NoGpuError) where there is none or it is too old
        import cupy

        self.max_batch, self.policy, self.cuda_graph = int(max_batch), _policy(policy, fused), bool(cuda_graph)
        # With ``input_grad``, conv1 also computes the images' gradient (buf["dx"]: lenet.torch asks for it).
        self.input_grad = bool(input_grad)
        self.specs = (dataclasses.replace(STAGES[0], dx=True, dx_mask=False), *STAGES[1:]) if input_grad else STAGES
        check_memory(self.max_batch, *cupy.cuda.runtime.memGetInfo(), self.policy, K)   # before any allocation
        self.handle = Handle(stream)
        self.stream = self.handle.stream
        self.plan_cache = self._plan_cache(plan_cache)
        self.planner = Planner(self.handle, self.policy, max_batch=self.max_batch, store=self.plan_cache,
                               captured=self.cuda_graph)
        st = self.settings
        ema_decays = st["ema_decay"]
        with self.stream:
            self._allocate(st["seed"], ema_decays)
        if K == 1:   # the constants in the update's launch, as ever
            self._operations(st["momentum"][0], st["weight_decay"][0], bool(st["nesterov"][0]),
                             float(st["label_smoothing"][0]), ema_decays[0])
        else:        # a pack's on the device (self.hyper, self.label_smoothing_dev)
            self._operations(0.0, 0.0, False, self.label_smoothing_dev, 0.0 if self.ema is not None else None)
        self.runner = Runner(self.stream, self.planner.ctx.workspace, self._save_state, self._restore_state)
        self._steps: dict[int, Step] = {}
        self._lr_host: float | None = None
        self._eval_inputs: dict = {}   # a pack's evaluation orders and flags, per split size
        self.n = self.max_batch   # rows of the buffers holding the current batch

    def _plan_cache(self, plan_cache):
        """The on-disk store of choices (lenet/plancache.py): True for the default file, or a path."""
        if not plan_cache:
            return None
        from . import plancache

        return plancache.open_cache(self.handle, path=None if plan_cache is True else plan_cache)

    def _allocate(self, seeds: list, ema_decays: list) -> None:
        """Parameters, gradients, momentum (one flat buffer each, same layout; a pack's (K, TOTAL)), the
        weights' moving average and where the live weights wait while an evaluation runs on it, the
        device scalars (one per model), and BUFFERS (K N rows)."""
        import cupy

        N, K = self.max_batch, self.models
        # A pack whose slots may later take configurations with an average keeps the buffer (``keep_average``).
        keeps = any(d is not None for d in ema_decays) or (self.keep_average and K > 1)
        self.params = cupy.asarray(np.concatenate([P.pack(P.init_host(s)) for s in seeds]))   # (K TOTAL,)
        self.grads = cupy.zeros(K * P.TOTAL, dtype=cupy.float32)      # (K TOTAL,)
        self.velocity = cupy.zeros(K * P.TOTAL, dtype=cupy.float32)   # (K TOTAL,)
        self.ema = copy_of(self.params) if keeps else None   # (K TOTAL,) or None
        self.params_aside = cupy.zeros(K * P.TOTAL, dtype=cupy.float32) if keeps else None
        self.p, self.g = P.views(self.params), P.views(self.grads)   # model 0's views
        self.lr_dev = cupy.zeros(K, dtype=cupy.float32)           # (K,) read by the SGD kernel
        self.loss_dev = cupy.zeros(K, dtype=cupy.float32)         # (K,) mean loss of the last forward
        self.correct_dev = cupy.zeros(K, dtype=cupy.int32)        # (K,) right answers in it
        self.running_loss = cupy.zeros(K, dtype=cupy.float32)     # (K,) sum of step losses since reset
        st = self.settings
        # A pack's constants (sgd.cu): momentum, weight decay, nesterov, ema weight (1: no average kept).
        self.hyper = cupy.asarray(np.stack([
            _constants(st["momentum"][m], st["weight_decay"][m], st["nesterov"][m], ema_decays[m]) for m in range(K)
        ])) if K > 1 else None
        self.label_smoothing_dev = cupy.asarray(np.array(st["label_smoothing"], np.float32)) if K > 1 else None
        # Every buffer written (zeros) before any plan reads it: planning times candidates on them.
        self.buf = {k: cupy.zeros((K * N, *shape), dtype) for k, (shape, dtype) in BUFFERS.items() if k != "x"}
        self.buf["x"] = cupy.random.default_rng(seeds[0]).standard_normal((K * N, *IMAGE), dtype=cupy.float32)
        if self.input_grad:
            self.buf["dx"] = cupy.zeros((N, *IMAGE), cupy.float32)   # the images' gradient

    def _operations(self, momentum, weight_decay, nesterov, label_smoothing, ema_decay) -> None:
        """The network, in order: two stages, the head, the loss, the update. conv1's input gradient is
        never computed: nothing needs it."""
        b, p, g, N, K = self.buf, self.p, self.g, self.max_batch, self.models
        ins = ("x", "p1")
        self.stages = tuple(
            Stage(spec, StageTensors(x=b[x], y=b[y], dy=b["d" + y], dx=b["d" + x] if spec.dx else None,
                                     w=p[f"{spec.name}.weight"], b=p[f"{spec.name}.bias"], dw=g[f"{spec.name}.weight"],
                                     db=g[f"{spec.name}.bias"]), N, K)
            for spec, x, y in zip(self.specs, ins, ("p1", "p2")))
        self.loss_tensors = LossTensors(logits=b["logits"], dlogits=b["dlogits"], labels=b["labels"],
                                        loss=self.loss_dev, correct=self.correct_dev, running=self.running_loss,
                                        label_smoothing=label_smoothing)
        fc = [k for k in P.NAMES if k.startswith("fc")]
        head = HeadTensors(x=b["p2"].reshape(K * N, 256), dx=b["dp2"].reshape(K * N, 256), h1=b["h1"], dh1=b["dh1"],
                           logits=b["logits"], dlogits=b["dlogits"], w={k: p[k] for k in fc}, g={k: g[k] for k in fc},
                           grads=self.grads[P.OFFSETS["fc1.weight"]: P.OFFSETS["fc2.bias"] + CLASSES])
        self.head = Head(head, self.loss_tensors, N, K)
        self.head_unmasked = dataclasses.replace(self.head, dx_mask=False)   # above a stage that masks dy itself
        self.loss_op = Loss(self.loss_tensors, N, K)
        self.update_op = Update(UpdateTensors(self.params, self.grads, self.velocity, self.lr_dev, self.ema, momentum,
                                              weight_decay, nesterov, ema_decay, K, self.hyper))
        self.sgd = self.planner.plan(self.update_op, 0)

    # ------------------------------------------------------------------ plans

    @property
    def workspace(self):
        return self.planner.ctx.workspace

    @property
    def blas(self):
        return self.planner.ctx.blas

    @property
    def fused(self) -> bool:
        return self.policy.fused

    def plan(self, n: int) -> Step:
        """Every operation planned for batch size n (made once, then cached)."""
        step = self._steps.get(n)
        if step is not None:
            return step
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"batch size {n} is outside 1..{self.max_batch} (this model's max_batch)")
        plan = self.planner.plan
        stages = [plan(s, n) for s in self.stages]
        head = plan(self.head_unmasked if stages[-1].masks_dy else self.head, n)
        step = Step(n, stages, head, plan(self.loss_op, n), self.planner.ctx.side)
        self.workspace.reserve(step.workspace_bytes)   # may re-allocate: see Note [re-capture]
        self._steps[n] = step
        if self.plan_cache is not None:
            self.plan_cache.flush()
        return step

    def _replan(self) -> None:
        sizes = list(self._steps)
        self._steps.clear()
        self.runner.clear()
        for n in sizes:
            self.plan(n)

    def set_policy(self, policy: Policy, fused: bool | None = None) -> None:
        """Choose every operation again under ``policy`` (and ``fused``, when given) for every
        planned batch size."""
        self.policy = self.planner.policy = _policy(policy, fused)
        self._replan()

    def set_fused(self, fused: bool) -> None:
        """Let (or stop letting) the operations fuse: our fused kernels, conv+bias+ReLU, cuBLASLt epilogues."""
        self.set_policy(self.policy, fused)

    def describe(self, n: int | None = None) -> list[dict]:
        """One row per planned operation at batch n: engine, plan or algorithm, chunk, time, workspace."""
        return self.plan(self.max_batch if n is None else n).describe() + self.sgd.describe()

    def close(self) -> None:
        """Free what the engines made for this model (cuDNN's descriptors and graphs) now, not at exit."""
        self._steps.clear()
        self.runner.clear()
        self.planner.close()
        self.handle.close()

    # ------------------------------------------------------------------ data

    def load_batch(self, x, y) -> int:
        """Validate a batch (NumPy or CuPy) and copy it into the input buffers; return n."""
        import cupy

        K = self.models
        if K > 1:   # (K, n, ...) images and (K, n) labels, model m's batch x[m]
            if tuple(getattr(x, "shape", ()))[:1] != (K,) or tuple(getattr(y, "shape", ()))[:1] != (K,):
                raise ValueError(f"a pack of {K} models takes images (K, n, 1, 28, 28) and labels (K, n), got "
                                 f"{getattr(x, 'shape', type(x))} and {getattr(y, 'shape', type(y))}")
            x, y = x.reshape(-1, *x.shape[2:]), y.reshape(-1)
        rows = check_batch(x, y, K * self.max_batch)
        with self.stream:
            xs = cupy.asarray(x, dtype=cupy.float32).reshape(rows, 1, 28, 28)
            ys = cupy.asarray(y).astype(cupy.int32, copy=False)
            self.buf["x"][:rows] = xs
            self.buf["labels"][:rows] = ys
        self.n = rows // K
        return self.n

    def load_from(self, dataset, order, start: int, n: int, lr: float | None = None, augment=None,
                  epoch: int = 0) -> None:
        """Gather batch order[start:start+n] of a GPU-resident dataset into the input buffers
        (one launch, no host wait), augmented by ``augment`` (lenet.kernels.Augment) with the
        draws of ``epoch``; also sets the learning rate when lr is given."""
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"batch size {n} is outside 1..{self.max_batch} (this model's max_batch)")
        if lr is not None and not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"learning rate must be a finite number >= 0, got {lr}")
        with self.stream:
            gather_batch(dataset.images, dataset.labels, order, start, n, dataset.mean, dataset.std,
                         self.buf["x"], self.buf["labels"], lr, self.lr_dev if lr is not None else None,
                         augment, epoch)
        if lr is not None:
            self._lr_host = lr
        self.n = n

    def reset_running_loss(self, value=0.0) -> None:
        """Set the running sum of step losses (0, or a resumed epoch's sum so far; a pack's: one value, or one
        per model, which waits for the stream)."""
        if self.models > 1 and isinstance(value, (list, tuple, np.ndarray)):
            with self.stream:
                self.running_loss.set(np.asarray(per_model(value, self.models, "running loss"), np.float32),
                                      stream=self.stream)
            self.stream.synchronize()   # the host array may go once this returns
            return
        with self.stream:
            fill(self.running_loss, value)

    def read_running_loss(self) -> float:
        """Sum of the step losses since the last reset (synchronizes)."""
        self.stream.synchronize()
        return float(self.running_loss.get()[0])

    def set_lr(self, lr) -> None:
        """The learning rate the next updates take: one number, or a pack's one per model."""
        rates = per_model(lr, self.models, "learning rate")
        for r in rates:
            if not (math.isfinite(r) and r >= 0):
                raise ValueError(f"learning rate must be a finite number >= 0, got {r}")
        if self.models > 1:
            if tuple(rates) != self._lr_host:   # a copy only when the rates change: it waits for the stream
                with self.stream:
                    self.lr_dev.set(np.asarray(rates, np.float32), stream=self.stream)
                self.stream.synchronize()   # the host array may go before an asynchronous copy reads it
                self._lr_host = tuple(rates)
        elif lr != self._lr_host:
            with self.stream:
                fill(self.lr_dev, lr)
            self._lr_host = lr

    def load_pack(self, dataset, orders, start: int, n: int, aug, epochs, lr_table, lr_at, step: int) -> None:
        """A pack's batch (lenet.kernels.gather_pack): model m's images orders[m, start:start+n] of a
        GPU-resident dataset, augmented by aug[m] with the draws of epochs[m], and its learning rate
        lr_table[lr_at[m] + step]; one launch, no host wait."""
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"batch size {n} is outside 1..{self.max_batch} (this model's max_batch)")
        with self.stream:
            gather_pack(dataset.images, dataset.labels, orders, start, n, dataset.mean, dataset.std, self.buf["x"],
                        self.buf["labels"], aug, epochs, lr_table, lr_at, step, self.lr_dev)
        self._lr_host = "device"
        self.n = n

    # ------------------------------------------------------------------ the step

    def forward(self, n: int | None = None):
        """Forward pass and loss on the loaded batch; returns the device loss (1,).

        dlogits is written too, ready for backward().
        """
        step = self.plan(self.n if n is None else n)
        step.forward_loss()
        step.side.join()   # the loss's total may be added beside the step (lenet.plan.SideStream)
        return self.loss_dev

    def backward(self, n: int | None = None) -> None:
        """Gradients of the mean loss into ``grads`` (needs the forward of the same batch)."""
        self.plan(self.n if n is None else n).backward()

    def update(self, lr: float | None = None) -> None:
        """One SGD update of every parameter from ``grads`` (momentum, weight decay as built)."""
        if lr is not None:
            self.set_lr(lr)
        elif self._lr_host is None:
            raise ValueError("no learning rate set: pass lr")
        self.sgd()

    def _train(self, step: Step) -> None:
        step.forward_loss()
        step.backward()
        self.sgd()

    def step(self, n: int | None = None, lr: float | None = None):
        """forward + backward + SGD on the batch already in the input buffers; returns the
        device loss of the forward. With cuda_graph, replays the step captured for n."""
        n = self.n if n is None else n
        if lr is not None:
            self.set_lr(lr)
        elif self._lr_host is None:
            raise ValueError("no learning rate set: pass lr")
        step = self.plan(n)
        self.runner.run(("train", n), lambda: self._train(step), self.cuda_graph)
        return self.loss_dev

    def _state(self) -> list:
        return [a for a in (self.params, self.velocity, self.running_loss, self.ema) if a is not None]

    def _save_state(self):
        # On the model's stream: a copy on another stream could still be pending when the
        # warm-up run changes the state or the restore reads the copy (a race seen on an H100).
        with self.stream:
            return [copy_of(a) for a in self._state()]

    def _restore_state(self, saved) -> None:
        with self.stream:
            for a, s in zip(self._state(), saved):
                device_copy(a, s)

    def train_step(self, x, y, lr: float):
        """Load a batch (validated), run one SGD step; returns the device loss before the update."""
        n = self.load_batch(x, y)
        return self.step(n, lr)

    # ------------------------------------------------------------------ evaluation

    def evaluate_begin(self) -> None:
        with self.stream:
            fill(self.loss_dev, 0)
            fill(self.correct_dev, 0)

    def evaluate_batch(self, n: int | None = None) -> None:
        """Forward only; adds the batch's summed loss and right answers to the device totals."""
        step = self.plan(self.n if n is None else n)
        step.forward()
        step.loss.evaluate()

    def evaluate_end(self):
        """(summed loss, right answers) since evaluate_begin; synchronizes. A pack's: two arrays (K,)."""
        self.stream.synchronize()
        if self.models > 1:
            return self.loss_dev.get().astype(np.float64), self.correct_dev.get().astype(np.int64)
        return float(self.loss_dev.get()[0]), int(self.correct_dev.get()[0])

    def _gather_eval(self, dataset, start: int, n: int, mirror: bool) -> None:
        """Test images [start, start + n) for every model (mirrored for test-time augmentation)."""
        if self.models == 1:
            self.load_from(dataset, dataset.identity, start, n, augment=MIRROR if mirror else None)
            return
        import cupy

        key = ("eval", dataset.size, mirror)
        if key not in self._eval_inputs:
            with self.stream:
                K = self.models
                self._eval_inputs[key] = (cupy.tile(dataset.identity[None, :], (K, 1)),
                                          cupy.asarray(np.tile([0, 2 if mirror else 0, 0], (K, 1)).astype(np.int32)),
                                          cupy.zeros(K, cupy.int32))
        orders, aug, epochs = self._eval_inputs[key]
        with self.stream:
            gather_pack(dataset.images, dataset.labels, orders, start, n, dataset.mean, dataset.std, self.buf["x"],
                        self.buf["labels"], aug, epochs, None, None, 0, None)
        self.n = n

    def evaluate(self, dataset, batch: int = 1000, tta: bool = False) -> tuple[float, float]:
        """(mean loss, accuracy) over a whole GPU-resident split, forward only, with the moving
        average of the weights when the model keeps one. With ``tta`` (test-time augmentation),
        each image is scored on the mean of its logits and its left-right mirror's. Every batch,
        its gather and the totals run as one CUDA graph (with cuda_graph), and the host waits
        once, for the totals."""
        if not 1 <= batch:
            raise ValueError(f"evaluation batch size must be >= 1, got {batch}")
        batch = min(batch, self.max_batch, dataset.size)
        sizes = [min(batch, dataset.size - s) for s in range(0, dataset.size, batch)]
        for n in set(sizes):   # planned first: planning must not be captured
            self.plan(n)

        def run():
            self.evaluate_begin()
            if self.ema is not None:
                with self.stream:
                    device_copy(self.params_aside, self.params)
                    device_copy(self.params, self.ema)
            for start, n in zip(range(0, dataset.size, batch), sizes):
                step, rows = self.plan(n), self.models * n
                self._gather_eval(dataset, start, n, False)
                step.forward()
                if tta:
                    with self.stream:
                        device_copy(self.buf["logits_kept"][:rows], self.buf["logits"][:rows])
                    self._gather_eval(dataset, start, n, True)
                    step.forward()
                step.loss.evaluate(self.buf["logits_kept"][:rows] if tta else None)
            if self.ema is not None:
                with self.stream:
                    device_copy(self.params, self.params_aside)
        # The key holds the dataset: its graph reads the dataset's buffers, which must outlive it.
        self.runner.run(("eval", dataset, batch, bool(tta)), run, self.cuda_graph)
        loss_sum, correct = self.evaluate_end()   # a pack's: arrays (K,)
        return loss_sum / dataset.size, correct / dataset.size

    # ------------------------------------------------------------------ host views

    def loss(self):
        """The loss of the last forward, read from the device (synchronizes); a pack's, an array (K,)."""
        self.stream.synchronize()
        return self.loss_dev.get() if self.models > 1 else float(self.loss_dev.get()[0])

    def _row(self, flat, model: int | None) -> np.ndarray:
        """One model's flat row of a (K TOTAL,) device buffer, as a host array (model None: a lone model)."""
        if model is None:
            if self.models > 1:
                raise ValueError(f"a pack of {self.models} models: say which model (0..{self.models - 1})")
            model = 0
        if not 0 <= model < self.models:
            raise ValueError(f"model {model} is outside 0..{self.models - 1}")
        self.stream.synchronize()
        return flat[model * P.TOTAL: (model + 1) * P.TOTAL].get()

    def logits(self) -> np.ndarray:
        self.stream.synchronize()
        return self.buf["logits"][: self.n].get()

    def state_dict(self, model: int | None = None) -> dict[str, np.ndarray]:
        """Parameters as host arrays under PyTorch's names and shapes (a pack's: of one model)."""
        return P.unpack(self._row(self.params, model))

    def grad_dict(self, model: int | None = None) -> dict[str, np.ndarray]:
        return P.unpack(self._row(self.grads, model))

    def flat_state(self, model: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(parameters, momentum buffer, moving average or None) as flat host arrays: what a
        checkpoint holds; of every model of a pack, (K TOTAL,) each, or of ``model`` alone."""
        if model is not None:
            return (self._row(self.params, model), self._row(self.velocity, model),
                    self._row(self.ema, model) if self.ema is not None else None)
        self.stream.synchronize()
        return self.params.get(), self.velocity.get(), (self.ema.get() if self.ema is not None else None)

    def set_model(self, model: int, *, seed: int, momentum: float, weight_decay: float, nesterov: bool,
                  label_smoothing: float, ema_decay: float | None) -> None:
        """Model ``model`` of a pack starts again (lenet.pack's slots): the initialization of ``seed``, a
        zero momentum buffer, its average at the weights, and its own constants. Waits for the stream."""
        if self.hyper is None:
            raise ValueError("a lone model trains the configuration it was made with; a pack (models >= 2) "
                             "lets a model take another")
        if not 0 <= model < self.models:
            raise ValueError(f"model {model} is outside 0..{self.models - 1}")
        if ema_decay is not None and self.ema is None:
            raise ValueError(f"model {model}: a moving average in a pack made without one (keep_average=True)")
        P.check_seed(seed)
        check_hyperparameters(momentum, weight_decay, nesterov, label_smoothing, ema_decay)
        row = slice(model * P.TOTAL, (model + 1) * P.TOTAL)
        init = P.pack(P.init_host(seed))
        with self.stream:
            self.params[row].set(init, stream=self.stream)
            fill(self.velocity[row], 0)
            if self.ema is not None:
                self.ema[row].set(init, stream=self.stream)
            self.hyper[model].set(_constants(momentum, weight_decay, nesterov, ema_decay), stream=self.stream)
            self.label_smoothing_dev[model:model + 1].set(np.array([label_smoothing], np.float32), stream=self.stream)
        self.stream.synchronize()   # the host arrays above may go once this returns

    def load_flat(self, params_flat: np.ndarray, velocity_flat: np.ndarray, ema_flat: np.ndarray | None = None) -> None:
        """Load a checkpoint's flat buffers. Without ``ema_flat`` a model that keeps a moving
        average starts it at the parameters."""
        size = self.models * P.TOTAL
        if params_flat.shape != (size,) or velocity_flat.shape != (size,):
            raise ValueError(f"flat buffers must be ({size},), got {params_flat.shape}, {velocity_flat.shape}")
        with self.stream:
            self.params.set(np.asarray(params_flat, np.float32))
            self.velocity.set(np.asarray(velocity_flat, np.float32))
            if self.ema is not None:
                self.ema.set(np.asarray(ema_flat if ema_flat is not None else params_flat, np.float32))
        self.stream.synchronize()

    def eval_state_dict(self, model: int | None = None) -> dict[str, np.ndarray]:
        """The weights evaluation and export use: the moving average when kept, else the parameters."""
        return P.unpack(self._row(self.ema if self.ema is not None else self.params, model))

    def load_state_dict(self, state: dict) -> None:
        """Load parameters (PyTorch names and shapes; NumPy or torch CPU tensors)."""
        host = {k: np.asarray(getattr(v, "detach", lambda: v)()) if not isinstance(v, np.ndarray) else v
                for k, v in state.items()}
        flat = P.pack(host)
        with self.stream:
            self.params.set(np.asarray(flat, np.float32))
            if self.ema is not None:   # new weights: the average starts again from them
                device_copy(self.ema, self.params)
        self.stream.synchronize()
