"""LeNet-5 on cuDNN + cuBLAS + two custom kernels, on one stream.

    x (N,1,28,28)
    conv1 6@5x5 + bias -> ReLU -> maxpool 2x2/2     (N,6,12,12)
    conv2 16@5x5 + bias -> ReLU -> maxpool 2x2/2    (N,16,4,4)
    flatten 256 -> fc1 120 + bias -> ReLU -> fc2 10 + bias  (N,10)
    softmax cross-entropy, mean over the batch

Everything a step touches is made once, at construction, for ``max_batch``:
descriptors, algorithm choices, the workspace, every activation and gradient
buffer, the flat parameter / gradient / velocity buffers. A batch of n <= max_batch
images uses the first n rows of each buffer and a plan (tensor descriptors and
algorithms) made for n on first use. A step then allocates nothing, never waits
for the host and branches on no device value, so it can be captured in a CUDA
graph and replayed (``cuda_graph=True``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from descriptors import (ActivationDescriptor, AlgoPolicy, AlgoResult, ConvolutionDescriptor, CudnnError, Direction,
                         FilterDescriptor, Handle, PoolingDescriptor, TensorDescriptor, Workspace, add_tensor,
                         search)

from . import params as P
from .blas import Blas, Lt, LtMatmul, LtUnavailable
from .kernels import SoftmaxCE, gather_batch, sgd_update

CLASSES = 10
IMAGE = (1, 28, 28)

# Note [pooling batch limit]: cuDNN's max-pooling forward kernel puts the batch in the grid's
# z dimension, which CUDA caps at 65535: at N = 65536 cudnnPoolingForward answers
# NOT_SUPPORTED (seen on an H100, cuDNN 9.19). Pooling therefore runs in chunks of at most
# POOL_CHUNK images, each with its own pair of descriptors; below that it is one call.
POOL_CHUNK = 32768

# (layer, direction) pairs whose algorithm is chosen. conv1's input gradient is
# never computed: nothing needs it.
CONV_DIRECTIONS = (("conv1", Direction.FORWARD), ("conv1", Direction.BACKWARD_FILTER),
                   ("conv2", Direction.FORWARD), ("conv2", Direction.BACKWARD_DATA),
                   ("conv2", Direction.BACKWARD_FILTER))


@dataclass
class _Plan:
    """Tensor descriptors, buffer views and algorithm choices for one batch size."""

    n: int
    d: dict = field(default_factory=dict)       # name -> TensorDescriptor
    v: dict = field(default_factory=dict)       # name -> CuPy view of the first n rows
    algos: dict = field(default_factory=dict)   # (layer, Direction) -> AlgoResult
    fused: dict = field(default_factory=dict)   # layer -> conv+bias+ReLU in one cuDNN call
    fused_ms: dict = field(default_factory=dict)  # layer -> (fused ms, plain ms), or None where it cannot run
    pool_chunks: list = field(default_factory=list)  # (start, count, {name: TensorDescriptor}) per chunk
    lt: dict | None = None                      # cuBLASLt matmuls of the fully connected layers, or None
    lt_note: str = ""                           # why the fully connected layers use plain cuBLAS


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
    mod = type(x).__module__.split(".")[0]
    xp = np if mod == "numpy" else __import__("cupy")
    lo, hi = int(xp.min(y)), int(xp.max(y))
    if lo < 0 or hi >= CLASSES:
        raise ValueError(f"labels must be in [0, {CLASSES}), got values from {lo} to {hi}")
    if not bool(xp.isfinite(x).all()):
        raise ValueError("images contain NaN or infinite values")
    return n


class LeNet:
    """The network, its parameters and its optimizer state, on one CUDA stream.

    >>> model = LeNet(max_batch=64, seed=0)
    >>> loss = model.train_step(x, y, lr=0.01)   # device scalar; float(loss) or model.loss()
    """

    def __init__(self, max_batch: int = 64, *, policy: AlgoPolicy | None = None, seed: int = 0,
                 momentum: float = 0.0, weight_decay: float = 0.0, stream=None, cuda_graph: bool = False,
                 fused: bool = True):
        if not isinstance(max_batch, (int, np.integer)) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not (0.0 <= momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not (weight_decay >= 0.0 and math.isfinite(weight_decay)):
            raise ValueError(f"weight decay must be >= 0, got {weight_decay}")
        import cupy

        self.max_batch = int(max_batch)
        self.policy = policy or AlgoPolicy()
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self.cuda_graph = bool(cuda_graph)
        self.fused = bool(fused)
        self.handle = Handle(stream)
        self.stream = self.handle.stream
        N = self.max_batch
        with self.stream:
            self.blas = Blas(self.stream)
            self.lt = None   # cuBLASLt, made on first use by a fused plan
            self.sce = SoftmaxCE()
            # Parameters, gradients, momentum: one flat buffer each, same layout.
            self.params = cupy.asarray(P.pack(P.init_host(seed)))     # (TOTAL,)
            self.grads = cupy.zeros(P.TOTAL, dtype=cupy.float32)      # (TOTAL,)
            self.velocity = cupy.zeros(P.TOTAL, dtype=cupy.float32)   # (TOTAL,)
            self.p, self.g = P.views(self.params), P.views(self.grads)
            self.lr_dev = cupy.zeros(1, dtype=cupy.float32)           # (1,) read by the SGD kernel
            self.loss_dev = cupy.zeros(1, dtype=cupy.float32)         # (1,) mean loss of the last forward
            self.correct_dev = cupy.zeros(1, dtype=cupy.int32)        # (1,) right answers in it
            self.running_loss = cupy.zeros(1, dtype=cupy.float32)     # (1,) sum of step losses since reset
            self.ones = cupy.ones(max(N, 576), dtype=cupy.float32)    # (max(N, 24*24),) for bias gradients
            self.bias_scratch = cupy.empty(6 * 24 * 24, dtype=cupy.float32)  # (C*H*W,) of conv1, the larger
            rng = cupy.random.default_rng(seed)
            f32 = cupy.float32
            self.buf = {
                "x": rng.standard_normal((N, 1, 28, 28), dtype=f32),  # input, random until loaded
                "labels": cupy.zeros(N, dtype=cupy.int32),             # (N,)
                "c1": cupy.empty((N, 6, 24, 24), f32),   # conv1 + bias, ReLU in place
                "p1": cupy.empty((N, 6, 12, 12), f32),
                "c2": cupy.empty((N, 16, 8, 8), f32),    # conv2 + bias, ReLU in place
                "p2": cupy.empty((N, 16, 4, 4), f32),    # = flat (N, 256)
                "h1": cupy.empty((N, 120), f32),         # fc1 + bias, ReLU in place
                "logits": cupy.empty((N, CLASSES), f32),
                "dlogits": cupy.empty((N, CLASSES), f32),
                "dh1": cupy.empty((N, 120), f32),
                "relu_mask": cupy.zeros(N * LtMatmul.AUX_LD // 8, cupy.uint8),  # fc1's ReLU bits (cuBLASLt)
                "dp2": cupy.empty((N, 16, 4, 4), f32),
                "dc2": rng.standard_normal((N, 16, 8, 8), dtype=f32),
                "dp1": cupy.empty((N, 6, 12, 12), f32),
                "dc1": rng.standard_normal((N, 6, 24, 24), dtype=f32),
            }
        # Descriptors that do not depend on the batch size.
        self.w1d = FilterDescriptor((6, 1, 5, 5))
        self.w2d = FilterDescriptor((16, 6, 5, 5))
        self.conv1 = ConvolutionDescriptor(pad=0, stride=1)
        self.conv2 = ConvolutionDescriptor(pad=0, stride=1)
        self.pool = self._pooling(self.policy)
        self.relu = ActivationDescriptor("relu")
        self.bd = {name: TensorDescriptor((1, P.SHAPES[name][0], 1, 1))
                   for name in ("conv1.bias", "conv2.bias", "fc1.bias", "fc2.bias")}
        self.pb = {k: self.p[k].reshape(1, -1, 1, 1) for k in self.bd}   # bias views (1, C, 1, 1)
        self.workspace = Workspace()
        self._plans: dict[int, _Plan] = {}
        self._graphs: dict[int, object] = {}
        self._lr_host: float | None = None
        self.n = N   # rows of the buffers holding the current batch
        self.plan(N)

    # ------------------------------------------------------------------ plans

    def plan(self, n: int) -> _Plan:
        """Descriptors, views and algorithms for batch size n (made once, then cached)."""
        pl = self._plans.get(n)
        if pl is not None:
            return pl
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"batch size {n} is outside 1..{self.max_batch} (this model's max_batch)")
        pl = _Plan(n)
        b = self.buf
        for name in ("x", "c1", "p1", "c2", "p2", "dp2", "dc2", "dp1", "dc1"):
            pl.v[name] = b[name][:n]
        pl.v["labels"] = b["labels"][:n]
        for name in ("h1", "logits", "dlogits", "dh1"):
            pl.v[name] = b[name][:n]                               # (n, C) for cuBLAS
            pl.v[name + "4"] = b[name][:n].reshape(n, -1, 1, 1)    # (n, C, 1, 1) for cuDNN
        pl.v["p2flat"] = b["p2"][:n].reshape(n, 256)
        pl.v["dp2flat"] = b["dp2"][:n].reshape(n, 256)
        shapes = {"x": (n, 1, 28, 28), "c1": (n, 6, 24, 24), "p1": (n, 6, 12, 12), "c2": (n, 16, 8, 8),
                  "p2": (n, 16, 4, 4), "h1": (n, 120, 1, 1), "logits": (n, CLASSES, 1, 1)}
        pl.d = {k: TensorDescriptor(s) for k, s in shapes.items()}
        for start in range(0, n, POOL_CHUNK):   # see Note [pooling batch limit]
            k = min(POOL_CHUNK, n - start)
            pl.pool_chunks.append((start, k, {name: pl.d[name] if k == n else TensorDescriptor((k, *shapes[name][1:]))
                                              for name in ("c1", "p1", "c2", "p2")}))
        # cuDNN's output shapes must agree with the buffers (they do for 28x28 input).
        assert self.conv1.output_shape(pl.d["x"], self.w1d) == shapes["c1"]
        assert self.pool.output_shape(pl.d["c1"]) == shapes["p1"]
        assert self.conv2.output_shape(pl.d["p1"], self.w2d) == shapes["c2"]
        assert self.pool.output_shape(pl.d["c2"]) == shapes["p2"]
        self._choose(pl)
        self._plans[n] = pl
        return pl

    def _operands(self, pl: _Plan, layer: str, direction: Direction):
        """(descA, descB, descOut), (A, B, Out) for ``search``; see descriptors.algorithms._Calls."""
        d, v, p, g = pl.d, pl.v, self.p, self.g
        if layer == "conv1":
            x, xd, w, wd, y, yd, dy, dw = v["x"], d["x"], p["conv1.weight"], self.w1d, v["c1"], d["c1"], \
                v["dc1"], g["conv1.weight"]
        else:
            x, xd, w, wd, y, yd, dy, dw = v["p1"], d["p1"], p["conv2.weight"], self.w2d, v["c2"], d["c2"], \
                v["dc2"], g["conv2.weight"]
        if direction == Direction.FORWARD:
            return (xd, wd, yd), (x, w, y)
        if direction == Direction.BACKWARD_DATA:
            return (wd, yd, xd), (w, dy, v["dp1"])
        return (xd, yd, wd), (x, dy, dw)

    def _choose(self, pl: _Plan) -> None:
        for layer, direction in CONV_DIRECTIONS:
            descs, arrays = self._operands(pl, layer, direction)
            conv = self.conv1 if layer == "conv1" else self.conv2
            pl.algos[(layer, direction)] = search(self.handle, direction, conv, *descs, self.policy,
                                                  buffers=arrays)
        self.workspace.reserve(max(r.workspace_bytes for r in pl.algos.values()))
        self._plan_fusion(pl)

    def _plan_fusion(self, pl: _Plan) -> None:
        pl.fused, pl.fused_ms = {}, {}
        for layer in ("conv1", "conv2"):
            pl.fused_ms[layer] = self._time_fused(pl, layer) if self.fused else None
            pl.fused[layer] = pl.fused_ms[layer] is not None and pl.fused_ms[layer][0] <= pl.fused_ms[layer][1]
        self._plan_lt(pl)

    def _plan_lt(self, pl: _Plan) -> None:
        """The fully connected layers as six cuBLASLt matmuls with epilogues (fused mode).

        Note [cuBLASLt epilogues]: forward fc1 = GEMM+bias+ReLU (ReLU mask bits kept), fc2 =
        GEMM+bias; backward dW2 with db2 (BGRADB), dh1 with the ReLU gradient from the mask
        (DRELU), dW1 with db1 (BGRADB), dp2. Twelve launches become six. Where cuBLASLt has no
        algorithm for one of them, the whole plan keeps the cuBLAS path (gemm, cuDNN bias and
        ReLU, gemv bias gradients), and lt_note says why.
        """
        pl.lt, pl.lt_note = None, "fusion off"
        if not self.fused:
            return
        try:
            if self.lt is None:
                self.lt = Lt(self.stream)
            v, p, g, lt, n = pl.v, self.p, self.g, self.lt, pl.n
            aux = self.buf["relu_mask"][: n * LtMatmul.AUX_LD // 8]
            pl.lt = {
                "fc1": LtMatmul(lt, v["p2flat"], p["fc1.weight"], v["h1"], trans_b=True, epilogue="relu_aux_bias",
                                bias=p["fc1.bias"], aux=aux),
                "fc2": LtMatmul(lt, v["h1"], p["fc2.weight"], v["logits"], trans_b=True, epilogue="bias",
                                bias=p["fc2.bias"]),
                "dW2": LtMatmul(lt, v["dlogits"], v["h1"], g["fc2.weight"], trans_a=True, epilogue="bgradb",
                                bias=g["fc2.bias"]),
                "dh1": LtMatmul(lt, v["dlogits"], p["fc2.weight"], v["dh1"], epilogue="drelu", aux=aux),
                "dW1": LtMatmul(lt, v["dh1"], v["p2flat"], g["fc1.weight"], trans_a=True, epilogue="bgradb",
                                bias=g["fc1.bias"]),
                "dp2": LtMatmul(lt, v["dh1"], p["fc1.weight"], v["dp2flat"]),
            }
            pl.lt_note = ""
        except (LtUnavailable, ImportError) as e:
            pl.lt, pl.lt_note = None, str(e)

    def _conv_fwd_args(self, pl: _Plan, layer: str):
        d, v, p = pl.d, pl.v, self.p
        if layer == "conv1":
            return self.conv1, d["x"], v["x"], self.w1d, p["conv1.weight"], d["c1"], v["c1"], "conv1.bias"
        return self.conv2, d["p1"], v["p1"], self.w2d, p["conv2.weight"], d["c2"], v["c2"], "conv2.bias"

    def _time_fused(self, pl: _Plan, layer: str) -> tuple[float, float] | None:
        """(fused ms, plain ms) of conv+bias+ReLU for this layer, or None where cuDNN cannot fuse.

        Note [fused convolution]: cudnnConvolutionBiasActivationForward takes ReLU only with
        some forward algorithms (NOT_SUPPORTED for the others), and it is not always faster:
        at batch 65536 on an H100 it ran conv1 as a direct kernel taking 10.5 ms, against 1.9 ms
        for the implicit-GEMM convolution plus bias and ReLU. Both are timed here, on the real
        buffers, and the step takes the faster.
        """
        import cupy

        conv, xd, x, wd, w, yd, y, bias = self._conv_fwd_args(pl, layer)
        algo, h = pl.algos[(layer, Direction.FORWARD)], self.handle

        def fused():
            conv.bias_activation_forward(h, xd, x, wd, w, self.bd[bias], self.pb[bias], self.relu, yd, y, algo,
                                         self.workspace)

        def plain():
            conv.forward(h, xd, x, wd, w, yd, y, algo, self.workspace)
            add_tensor(h, self.bd[bias], self.pb[bias], yd, y)
            self.relu.forward(h, yd, y, yd, y)

        try:
            fused()
            self.stream.synchronize()
        except CudnnError as e:
            if e.is_not_supported:
                return None
            raise
        start, end, out = cupy.cuda.Event(), cupy.cuda.Event(), []
        for fn in (fused, plain):
            fn()   # warm-up
            start.record(self.stream)
            for _ in range(3):
                fn()
            end.record(self.stream)
            end.synchronize()
            out.append(cupy.cuda.get_elapsed_time(start, end) / 3)
        return out[0], out[1]

    @staticmethod
    def _pooling(policy: AlgoPolicy) -> PoolingDescriptor:
        # Deterministic mode also takes cuDNN's deterministic max pooling.
        return PoolingDescriptor("max_deterministic" if policy.deterministic else "max", window=2, stride=2)

    def set_policy(self, policy: AlgoPolicy) -> None:
        """Choose the algorithms again under ``policy`` for every planned batch size."""
        if policy.deterministic != self.policy.deterministic:
            self.pool = self._pooling(policy)
        self.policy = policy
        self._graphs.clear()
        for pl in self._plans.values():
            self._choose(pl)

    def set_fused(self, fused: bool) -> None:
        """Use (or stop using) cuDNN's fused conv+bias+ReLU where it runs."""
        self.fused = bool(fused)
        self._graphs.clear()
        for pl in self._plans.values():
            self._plan_fusion(pl)

    def supported_names(self, n: int) -> dict[Direction, list[str]]:
        """Per direction, the algorithm names cuDNN supports for every layer that runs that direction
        at batch n: what a fixed ``--algo`` may name."""
        from descriptors import supported_algorithms

        pl, out = self.plan(n), {}
        for d in Direction:
            sets = []
            for layer, direction in CONV_DIRECTIONS:
                if direction == d:
                    descs, _ = self._operands(pl, layer, d)
                    conv = self.conv1 if layer == "conv1" else self.conv2
                    sets.append({r.name for r in supported_algorithms(self.handle, d, conv, *descs)})
            out[d] = sorted(set.intersection(*sets))
        return out

    def algorithms(self, n: int | None = None) -> dict[tuple[str, Direction], AlgoResult]:
        return dict(self.plan(self.max_batch if n is None else n).algos)

    # ------------------------------------------------------------------ data

    def load_batch(self, x, y) -> int:
        """Validate a batch (NumPy or CuPy) and copy it into the input buffers; return n."""
        import cupy

        n = check_batch(x, y, self.max_batch)
        with self.stream:
            xs = cupy.asarray(x, dtype=cupy.float32).reshape(n, 1, 28, 28)
            ys = cupy.asarray(y).astype(cupy.int32, copy=False)
            self.buf["x"][:n] = xs
            self.buf["labels"][:n] = ys
        self.n = n
        return n

    def load_from(self, dataset, order, start: int, n: int, lr: float | None = None) -> None:
        """Gather batch order[start:start+n] of a GPU-resident dataset into the input buffers
        (one launch, no host wait); also sets the learning rate when lr is given."""
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"batch size {n} is outside 1..{self.max_batch} (this model's max_batch)")
        if lr is not None and not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"learning rate must be a finite number >= 0, got {lr}")
        with self.stream:
            gather_batch(dataset.images, dataset.labels, order, start, n, dataset.mean, dataset.std,
                         self.buf["x"], self.buf["labels"], lr, self.lr_dev if lr is not None else None)
        if lr is not None:
            self._lr_host = lr
        self.n = n

    def reset_running_loss(self) -> None:
        with self.stream:
            self.running_loss.fill(0)

    def read_running_loss(self) -> float:
        """Sum of the step losses since the last reset (synchronizes)."""
        self.stream.synchronize()
        return float(self.running_loss.get()[0])

    def set_lr(self, lr: float) -> None:
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"learning rate must be a finite number >= 0, got {lr}")
        if lr != self._lr_host:
            with self.stream:
                self.lr_dev.fill(lr)
            self._lr_host = lr

    # ------------------------------------------------------------------ the step

    def forward(self, n: int | None = None):
        """Forward pass and loss on the loaded batch; returns the device loss (1,).

        The softmax-CE kernel also writes dlogits, ready for backward().
        """
        n = self.n if n is None else n
        pl = self.plan(n)
        self._forward(pl, grad=True)
        return self.loss_dev

    def _forward(self, pl: _Plan, grad: bool, accumulate: bool = False) -> None:
        h, d, v, p = self.handle, pl.d, pl.v, self.p
        self._conv_bias_relu(pl, "conv1")
        self._pool_forward(pl, "c1", "p1")
        self._conv_bias_relu(pl, "conv2")
        self._pool_forward(pl, "c2", "p2")
        if pl.lt is not None:   # see Note [cuBLASLt epilogues]
            pl.lt["fc1"]()
            pl.lt["fc2"]()
        else:
            self.blas.gemm(v["p2flat"], p["fc1.weight"], v["h1"], trans_b=True)          # (n,256)@(256,120)
            add_tensor(h, self.bd["fc1.bias"], self.pb["fc1.bias"], d["h1"], v["h14"])
            self.relu.forward(h, d["h1"], v["h14"], d["h1"], v["h14"])
            self.blas.gemm(v["h1"], p["fc2.weight"], v["logits"], trans_b=True)          # (n,120)@(120,10)
            add_tensor(h, self.bd["fc2.bias"], self.pb["fc2.bias"], d["logits"], v["logits4"])
        n = pl.n
        with self.stream:
            self.sce.forward_backward(v["logits"], v["labels"], v["dlogits"] if grad else None, self.loss_dev,
                                      self.correct_dev, n, grad_scale=1.0 / n,
                                      loss_scale=1.0 if accumulate else 1.0 / n, accumulate=accumulate,
                                      running=self.running_loss if grad else None)

    def _pool_forward(self, pl: _Plan, x: str, y: str) -> None:
        v = pl.v
        for s, k, d in pl.pool_chunks:   # one chunk below POOL_CHUNK images
            self.pool.forward(self.handle, d[x], v[x][s:s + k], d[y], v[y][s:s + k])

    def _pool_backward(self, pl: _Plan, x: str, y: str) -> None:
        v, dx, dy = pl.v, "d" + x, "d" + y
        for s, k, d in pl.pool_chunks:
            self.pool.backward(self.handle, d[y], v[y][s:s + k], d[y], v[dy][s:s + k], d[x], v[x][s:s + k], d[x],
                               v[dx][s:s + k])

    def _conv_bias_relu(self, pl: _Plan, layer: str) -> None:
        conv, xd, x, wd, w, yd, y, bias = self._conv_fwd_args(pl, layer)
        algo, h = pl.algos[(layer, Direction.FORWARD)], self.handle
        if pl.fused[layer]:   # see Note [fused convolution]
            conv.bias_activation_forward(h, xd, x, wd, w, self.bd[bias], self.pb[bias], self.relu, yd, y, algo,
                                         self.workspace)
            return
        conv.forward(h, xd, x, wd, w, yd, y, algo, self.workspace)
        add_tensor(h, self.bd[bias], self.pb[bias], yd, y)
        self.relu.forward(h, yd, y, yd, y)

    def backward(self, n: int | None = None) -> None:
        """Gradients of the mean loss into ``grads`` (needs the forward of the same batch)."""
        pl = self.plan(self.n if n is None else n)
        self._backward(pl)

    def _backward(self, pl: _Plan) -> None:
        h, d, v, p, g, ws = self.handle, pl.d, pl.v, self.p, self.g, self.workspace
        a, blas, relu = pl.algos, self.blas, self.relu
        if pl.lt is not None:   # see Note [cuBLASLt epilogues]
            for op in ("dW2", "dh1", "dW1", "dp2"):
                pl.lt[op]()
        else:
            blas.gemm(v["dlogits"], v["h1"], g["fc2.weight"], trans_a=True)   # (10,n)@(n,120)
            blas.column_sums(v["dlogits"], self.ones, g["fc2.bias"])
            blas.gemm(v["dlogits"], p["fc2.weight"], v["dh1"])                 # (n,10)@(10,120)
            relu.backward(h, d["h1"], v["h14"], d["h1"], v["dh14"], d["h1"], v["h14"], d["h1"], v["dh14"])
            blas.gemm(v["dh1"], v["p2flat"], g["fc1.weight"], trans_a=True)    # (120,n)@(n,256)
            blas.column_sums(v["dh1"], self.ones, g["fc1.bias"])
            blas.gemm(v["dh1"], p["fc1.weight"], v["dp2flat"])                 # (n,120)@(120,256)
        self._pool_backward(pl, "c2", "p2")
        relu.backward(h, d["c2"], v["c2"], d["c2"], v["dc2"], d["c2"], v["c2"], d["c2"], v["dc2"])
        self.conv2.backward_filter(h, d["p1"], v["p1"], d["c2"], v["dc2"], self.w2d, g["conv2.weight"],
                                   a[("conv2", Direction.BACKWARD_FILTER)], ws)
        self._conv_bias_grad(v["dc2"], g["conv2.bias"])
        self.conv2.backward_data(h, self.w2d, p["conv2.weight"], d["c2"], v["dc2"], d["p1"], v["dp1"],
                                 a[("conv2", Direction.BACKWARD_DATA)], ws)
        self._pool_backward(pl, "c1", "p1")
        relu.backward(h, d["c1"], v["c1"], d["c1"], v["dc1"], d["c1"], v["c1"], d["c1"], v["dc1"])
        self.conv1.backward_filter(h, d["x"], v["x"], d["c1"], v["dc1"], self.w1d, g["conv1.weight"],
                                   a[("conv1", Direction.BACKWARD_FILTER)], ws)
        self._conv_bias_grad(v["dc1"], g["conv1.bias"])

    def _conv_bias_grad(self, dy, db) -> None:
        """db[c] = sum of dy[:, c, :, :], as two cuBLAS gemv: over the batch, then over H*W.

        Note [conv bias gradient]: cudnnConvolutionBackwardBias launches one block per
        channel; measured with ncu on an H100 (cuDNN 9.19, batch 64) it took 58 us for
        conv1 and 32 us for conv2, the largest items of the step. Two gemv take ~4 us each.
        """
        n, c, hh, ww = dy.shape
        tmp = self.bias_scratch[: c * hh * ww]
        self.blas.column_sums(dy.reshape(n, c * hh * ww), self.ones, tmp)    # (C*H*W,) sum over N
        self.blas.row_sums(tmp.reshape(c, hh * ww), self.ones, db)           # (C,) sum over H*W

    def sgd_step(self, lr: float | None = None) -> None:
        """One SGD update of every parameter from ``grads`` (momentum, weight decay as built)."""
        if lr is not None:
            self.set_lr(lr)
        elif self._lr_host is None:
            raise ValueError("no learning rate set: pass lr")
        self._sgd()

    def _sgd(self) -> None:
        with self.stream:
            sgd_update(self.params, self.grads, self.velocity, self.lr_dev, self.momentum, self.weight_decay)

    def _step(self, pl: _Plan) -> None:
        self._forward(pl, grad=True)
        self._backward(pl)
        self._sgd()

    def step(self, n: int | None = None, lr: float | None = None):
        """forward + backward + SGD on the batch already in the input buffers; returns the
        device loss of the forward. With cuda_graph, replays the captured step for n."""
        n = self.n if n is None else n
        if lr is not None:
            self.set_lr(lr)
        elif self._lr_host is None:
            raise ValueError("no learning rate set: pass lr")
        pl = self.plan(n)
        if not self.cuda_graph:
            self._step(pl)
            return self.loss_dev
        graph = self._graphs.get(n)
        if graph is None:
            graph = self._graphs[n] = self._capture(pl)
        graph.launch(stream=self.stream)
        return self.loss_dev

    def _capture(self, pl: _Plan):
        """Capture forward + backward + SGD for pl.n in a CUDA graph.

        The step runs once eagerly first (on a copy of the parameter state, restored
        afterwards) so that lazy initialization inside cuDNN/cuBLAS and kernel
        compilation happen outside the capture.
        """
        saved = [a.copy() for a in (self.params, self.velocity, self.running_loss)]
        self._step(pl)
        with self.stream:
            self.params[...] = saved[0]
            self.velocity[...] = saved[1]
            self.running_loss[...] = saved[2]
        self.stream.synchronize()
        self.stream.begin_capture()
        try:
            self._step(pl)
        finally:
            graph = self.stream.end_capture()
        return graph

    def train_step(self, x, y, lr: float):
        """Load a batch (validated), run one SGD step; returns the device loss before the update."""
        n = self.load_batch(x, y)
        return self.step(n, lr)

    # ------------------------------------------------------------------ evaluation

    def evaluate_begin(self) -> None:
        with self.stream:
            self.loss_dev.fill(0)
            self.correct_dev.fill(0)

    def evaluate_batch(self, n: int | None = None) -> None:
        """Forward only; adds the batch's summed loss and right answers to the device totals."""
        self._forward(self.plan(self.n if n is None else n), grad=False, accumulate=True)

    def evaluate_end(self) -> tuple[float, int]:
        """(summed loss, right answers) since evaluate_begin; synchronizes."""
        self.stream.synchronize()
        return float(self.loss_dev.get()[0]), int(self.correct_dev.get()[0])

    # ------------------------------------------------------------------ host views

    def loss(self) -> float:
        """The loss of the last forward, read from the device (synchronizes)."""
        self.stream.synchronize()
        return float(self.loss_dev.get()[0])

    def logits(self) -> np.ndarray:
        self.stream.synchronize()
        return self.buf["logits"][: self.n].get()

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters as host arrays under PyTorch's names and shapes."""
        self.stream.synchronize()
        return P.unpack(self.params.get())

    def grad_dict(self) -> dict[str, np.ndarray]:
        self.stream.synchronize()
        return P.unpack(self.grads.get())

    def flat_state(self) -> tuple[np.ndarray, np.ndarray]:
        """(parameters, momentum buffer) as flat host arrays: what a checkpoint holds."""
        self.stream.synchronize()
        return self.params.get(), self.velocity.get()

    def load_flat(self, params_flat: np.ndarray, velocity_flat: np.ndarray) -> None:
        import cupy

        if params_flat.shape != (P.TOTAL,) or velocity_flat.shape != (P.TOTAL,):
            raise ValueError(f"flat buffers must be ({P.TOTAL},), got {params_flat.shape}, {velocity_flat.shape}")
        with self.stream:
            self.params[...] = cupy.asarray(params_flat, dtype=cupy.float32)
            self.velocity[...] = cupy.asarray(velocity_flat, dtype=cupy.float32)
        self.stream.synchronize()

    def load_state_dict(self, state: dict) -> None:
        """Load parameters (PyTorch names and shapes; NumPy or torch CPU tensors)."""
        import cupy

        host = {k: np.asarray(getattr(v, "detach", lambda: v)()) if not isinstance(v, np.ndarray) else v
                for k, v in state.items()}
        flat = P.pack(host)
        with self.stream:
            self.params[...] = cupy.asarray(flat)
        self.stream.synchronize()
