"""Row-major GEMM (and column sums) on cuBLAS through nvmath-python's low-level binding.

Note [row-major GEMM]: cuBLAS is column-major. A row-major (r, c) array is, to
cuBLAS, the column-major (c, r) matrix holding its transpose, with leading
dimension c. So the row-major product C = op(A) @ op(B), with C (M, N), is
computed as the column-major product C^T = op(B)^T @ op(A)^T: call sgemm with
the operands swapped (B first), m = N, n = M, and each operand's transpose flag
as given (a row-major array that must be transposed is, to cuBLAS, one that
must not be, and vice versa, and the swap applies the outer transpose).

We use our own cuBLAS handle, bound to our stream, with its own workspace, so
calls are legal during CUDA-graph capture (CuPy's cuBLAS binding refuses them).

Note [binding import]: ``import nvmath.bindings.cublas`` first runs nvmath's package
__init__, which imports its fft, linalg, sparse and tensor APIs and every other binding
(cuFFT, cuSOLVER, cuSPARSE, cuDSS, ...): 0.5 to 0.7 s of a program's start on the GPU
machine, for two modules. ``binding(name)`` loads just nvmath.bindings.<name>, under
stand-in parent packages that are removed again afterwards, so a later ``import nvmath``
still runs the real __init__ (which then reuses the loaded binding). If that fails for any
reason, it falls back to the plain import.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import weakref

import numpy as np


CUDA_R_32F = 0   # cudaDataType_t's float32 (library_types.h; nvmath.CudaDataType.CUDA_R_32F)


def binding(name: str):
    """nvmath.bindings.<name> (cublas, cublasLt), without nvmath's package __init__ when it has
    not run yet (see Note [binding import])."""
    full = f"nvmath.bindings.{name}"
    if full in sys.modules or "nvmath" in sys.modules:
        return importlib.import_module(full)
    spec = importlib.util.find_spec("nvmath")
    if spec is None or not spec.submodule_search_locations:
        return importlib.import_module(full)   # raises the usual ImportError
    roots = list(spec.submodule_search_locations)
    stand_ins = {}
    for pkg, path in (("nvmath", roots), ("nvmath.bindings", [f"{r}/bindings" for r in roots])):
        m = types.ModuleType(pkg)
        m.__path__, m.__package__ = path, pkg
        stand_ins[pkg] = sys.modules[pkg] = m
    try:
        return importlib.import_module(full)
    except Exception:  # noqa: BLE001 - any failure: forget what was loaded, then the plain import
        for k in [k for k in sys.modules if k == "nvmath" or k.startswith("nvmath.")]:
            del sys.modules[k]
        stand_ins.clear()
        return importlib.import_module(full)
    finally:
        for pkg, m in stand_ins.items():
            if sys.modules.get(pkg) is m:
                del sys.modules[pkg]


class Blas:
    def __init__(self, stream, workspace_bytes: int = 4 << 20):
        import cupy
        cublas = binding("cublas")

        self._cb = cublas
        self.handle = cublas.create()
        self._finalizer = weakref.finalize(self, cublas.destroy, self.handle)
        cublas.set_stream(self.handle, stream.ptr)
        self.stream = stream
        # Our own workspace: cuBLAS must not allocate during capture.
        self._workspace = cupy.empty(workspace_bytes, dtype=cupy.uint8)
        self.workspace_bytes = workspace_bytes
        cublas.set_workspace(self.handle, self._workspace.data.ptr, workspace_bytes)
        # Plain float32 arithmetic (no TF32): parity with PyTorch to 1e-4.
        cublas.set_math_mode(self.handle, cublas.Math.DEFAULT_MATH)
        cublas.set_pointer_mode(self.handle, cublas.PointerMode.HOST)
        self._scalars: dict[float, np.ndarray] = {}

    def version(self) -> int:
        return int(self._cb.get_version(self.handle))

    def _s(self, v: float) -> int:
        a = self._scalars.get(v)
        if a is None:
            a = self._scalars[v] = np.array([v], dtype=np.float32)
        return a.ctypes.data

    def gemm(self, a, b, c, *, trans_a: bool = False, trans_b: bool = False,
             alpha: float = 1.0, beta: float = 0.0) -> None:
        """c = alpha * op(a) @ op(b) + beta * c, all row-major float32 2-D CuPy arrays.

        See Note [row-major GEMM].
        """
        m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
        kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
        if k != kb or c.shape != (m, n):
            raise ValueError(f"gemm shapes do not agree: op(a) {(m, k)} @ op(b) {(kb, n)} -> c {c.shape}")
        for name, x in (("a", a), ("b", b), ("c", c)):
            if x.dtype != np.float32 or not x.flags.c_contiguous:
                raise ValueError(f"gemm operand {name} must be C-contiguous float32, "
                                 f"got {x.dtype} with strides {x.strides}")
        op = self._cb.Operation
        self._cb.sgemm(self.handle, op.T if trans_b else op.N, op.T if trans_a else op.N, n, m, k,
                       self._s(alpha), b.data.ptr, b.shape[1], a.data.ptr, a.shape[1],
                       self._s(beta), c.data.ptr, n)

    def column_sums(self, a, ones, out, *, alpha: float = 1.0, beta: float = 0.0) -> None:
        """out = alpha * a.sum(axis=0) + beta * out for row-major a (r, c), whose rows may be
        padded (a view of a wider matrix); ``ones`` holds >= r ones."""
        r, c = a.shape
        ld = a.strides[0] // a.itemsize if r > 1 else c
        if out.shape != (c,) or ones.shape[0] < r or a.strides[1] != a.itemsize or ld < c:
            raise ValueError(f"column_sums: a {a.shape} (strides {a.strides}), out {out.shape}, ones {ones.shape}")
        # Row-major a (r, c) is column-major (c, r) with leading dimension ld: out = A_cm @ ones.
        self._cb.sgemv(self.handle, self._cb.Operation.N, c, r, self._s(alpha), a.data.ptr, ld,
                       ones.data.ptr, 1, self._s(beta), out.data.ptr, 1)

    def row_sums(self, a, ones, out, *, alpha: float = 1.0, beta: float = 0.0) -> None:
        """out = alpha * a.sum(axis=1) + beta * out for row-major a (r, c); ``ones`` holds >= c ones."""
        r, c = a.shape
        if out.shape != (r,) or ones.shape[0] < c:
            raise ValueError(f"row_sums: a {a.shape}, out {out.shape}, ones {ones.shape}")
        # Row-major a (r, c) is column-major (c, r) = A_cm; out = A_cm^T @ ones.
        self._cb.sgemv(self.handle, self._cb.Operation.T, c, r, self._s(alpha), a.data.ptr, c,
                       ones.data.ptr, 1, self._s(beta), out.data.ptr, 1)

    def close(self) -> None:
        self._finalizer()


class LtUnavailable(RuntimeError):
    """cuBLASLt has no algorithm for a matmul as configured (e.g. an epilogue it lacks)."""


_EPILOGUES = ("default", "bias", "relu_bias", "relu_aux_bias", "drelu", "bgradb")


class LazyLt:
    """A model's one cuBLASLt handle, made on first use: a step whose head runs on cuBLAS or on our
    kernels never loads cuBLASLt's binding."""

    def __init__(self, stream):
        self.stream, self.made = stream, None

    def get(self) -> "Lt":
        if self.made is None:
            self.made = Lt(self.stream)
        return self.made


class Lt:
    """A cuBLASLt handle with its own workspace, on our stream."""

    def __init__(self, stream, workspace_bytes: int = 4 << 20):
        import cupy
        cublasLt = binding("cublasLt")

        self._lt = cublasLt
        self.handle = cublasLt.create()
        self._finalizer = weakref.finalize(self, cublasLt.destroy, self.handle)
        self.stream = stream
        self.workspace = cupy.empty(workspace_bytes, dtype=cupy.uint8)
        self.workspace_bytes = workspace_bytes
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)


class LtMatmul:
    """c = epilogue(op(a) @ op(b)), row-major float32 CuPy arrays, configured once (see Note
    [row-major GEMM]: to cuBLASLt, which is column-major, b is the first operand).

    Epilogues, in row-major terms (c is (M, N)):
      bias            c += bias[None, :]                           bias (N,)
      relu_bias       c = relu(c + bias)
      relu_aux_bias   c = relu(c + bias), the ReLU mask bits into aux
      drelu           c = c * (mask from aux > 0)                  the backward of relu_aux_bias
      bgradb          also bias[:] = op(a).sum(axis=0)             a bias gradient for free
    The pointers (operands, bias, aux) are fixed here: a matmul belongs to one set of buffers.

    ``batch`` > 1: that many matmuls in one call (a pack of models, lenet sweep), a, b and c each the
    first of ``batch`` matrices ``strides`` = (a's, b's, c's) elements apart, the bias vectors
    ``bias_stride`` elements apart, the ReLU masks one (M, AUX_LD bits) mask apart.

    ``algos``: how many of cuBLASLt's heuristic's algorithms to keep (``algos`` lists them, best-ranked
    first); the first runs unless the planner, timing each (``tune``), chose another (Note [tuned matmuls]).
    """

    AUX_LD = 128  # the ReLU mask's leading dimension, in bits: a multiple of 128, >= N

    def __init__(self, lt: Lt, a, b, c, *, trans_a=False, trans_b=False, epilogue="default", bias=None, aux=None,
                 batch: int = 1, strides=(0, 0, 0), bias_stride: int = 0, algos: int = 1):
        cublas = binding("cublas")

        L = lt._lt
        self.lt, self._L = lt, L
        if epilogue not in _EPILOGUES:
            raise ValueError(f"unknown epilogue {epilogue!r}")
        m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
        kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
        if k != kb or c.shape != (m, n):
            raise ValueError(f"matmul shapes do not agree: op(a) {(m, k)} @ op(b) {(kb, n)} -> c {c.shape}")
        self.a, self.b, self.c = a, b, c   # keep the buffers alive as long as the matmul
        f32 = CUDA_R_32F
        self._objs = []
        self.desc = L.matmul_desc_create(cublas.ComputeType.COMPUTE_32F, f32)
        self._fin = weakref.finalize(self, LtMatmul._destroy, L, self.desc, self._objs)
        A = L.MatmulDescAttribute
        op = cublas.Operation

        def setattr_(attr, value):
            v = np.array([value], dtype=L.get_matmul_desc_attribute_dtype(attr))
            L.matmul_desc_set_attribute(self.desc, attr, v.ctypes.data, v.nbytes)

        setattr_(A.TRANSA, op.T if trans_b else op.N)
        setattr_(A.TRANSB, op.T if trans_a else op.N)
        setattr_(A.EPILOGUE, {"default": L.Epilogue.DEFAULT, "bias": L.Epilogue.BIAS, "relu_bias": L.Epilogue.RELU_BIAS,
                              "relu_aux_bias": L.Epilogue.RELU_AUX_BIAS,
                              "drelu": L.Epilogue.DRELU, "bgradb": L.Epilogue.BGRADB}[epilogue])
        if bias is not None:
            setattr_(A.BIAS_POINTER, bias.data.ptr)
            self.bias = bias
        if aux is not None:
            if n > self.AUX_LD or aux.nbytes < self.AUX_LD // 8 * m * batch:
                raise ValueError(f"aux buffer of {aux.nbytes} B is too small for a ({m}, {n}) ReLU mask")
            setattr_(A.EPILOGUE_AUX_POINTER, aux.data.ptr)
            setattr_(A.EPILOGUE_AUX_LD, self.AUX_LD)
            self.aux = aux
        self._layouts(a, b, m, n, batch, strides, bias, bias_stride, aux)
        self._algorithms(lt, algos, f"{epilogue} matmul {(m, k)} x {(k, n)}")

    def _layouts(self, a, b, m: int, n: int, batch: int, strides, bias, bias_stride: int, aux) -> None:
        """cuBLASLt's matrix layouts of the three operands (and, for a batch, their strides)."""
        L, A, f32 = self._L, self._L.MatmulDescAttribute, CUDA_R_32F

        def setattr_(attr, value):
            v = np.array([value], dtype=L.get_matmul_desc_attribute_dtype(attr))
            L.matmul_desc_set_attribute(self.desc, attr, v.ctypes.data, v.nbytes)
        # Column-major layouts of the row-major buffers: (cols, rows), ld = cols.
        self.la = L.matrix_layout_create(f32, b.shape[1], b.shape[0], b.shape[1])    # cuBLASLt's A is b
        self._objs.append(("layout", self.la))
        self.lb = L.matrix_layout_create(f32, a.shape[1], a.shape[0], a.shape[1])    # cuBLASLt's B is a
        self._objs.append(("layout", self.lb))
        self.lc = L.matrix_layout_create(f32, n, m, n)
        self._objs.append(("layout", self.lc))
        if batch > 1:
            LA = L.MatrixLayoutAttribute

            def layout_attr(layout, attr, value):
                v = np.array([value], dtype=L.get_matrix_layout_attribute_dtype(attr))
                L.matrix_layout_set_attribute(layout, attr, v.ctypes.data, v.nbytes)
            for layout, stride in ((self.la, strides[1]), (self.lb, strides[0]), (self.lc, strides[2])):
                layout_attr(layout, LA.BATCH_COUNT, int(batch))
                layout_attr(layout, LA.STRIDED_BATCH_OFFSET, int(stride))
            if bias is not None:
                setattr_(A.BIAS_BATCH_STRIDE, int(bias_stride))
            if aux is not None:
                setattr_(A.EPILOGUE_AUX_BATCH_STRIDE, self.AUX_LD * m)

    def _algorithms(self, lt, algos: int, what: str) -> None:
        """The first ``algos`` of cuBLASLt's heuristic's ranking (``self.algos``); the first runs."""
        L = self._L
        pref = L.matmul_preference_create()
        self._objs.append(("pref", pref))
        ws = np.array([lt.workspace_bytes], dtype=np.uint64)
        L.matmul_preference_set_attribute(pref, L.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, ws.ctypes.data, 8)
        self._heur = np.zeros(max(1, algos), dtype=L.matmul_heuristic_result_dtype)
        count = np.zeros(1, dtype=np.int32)
        try:
            L.matmul_algo_get_heuristic(lt.handle, self.desc, self.la, self.lb, self.lc, self.lc, pref,
                                        len(self._heur), self._heur.ctypes.data, count.ctypes.data)
        except L.cuBLASLtError as e:
            raise LtUnavailable(f"cuBLASLt: {what}: {e}") from None
        if count[0] < 1 or self._heur["state"][0] != 0:
            raise LtUnavailable(f"cuBLASLt has no algorithm for a {what}")
        # 'algo' is the first field of a result; the heuristic's ranking, its first the default
        self.algos = [self._heur.ctypes.data + i * self._heur.itemsize for i in range(int(count[0]))
                      if self._heur["state"][i] == 0]
        self._algo, self.pick = self.algos[0], 0

    def tune(self, time, pick: int) -> float:
        """ms per call of ``algos[pick]`` by ``time(fn)``, which it then runs: one candidate of the planner's
        loop (``OurHead._matmul_pick`` in lenet/engines/ours_head.py).

        Note [tuned matmuls]: cuBLASLt's heuristic ranks algorithms by a model of the GPU, not by running
        them, and for the head's weight gradient (120 x 256 summed over the batch) its first can split the
        sum over too few blocks of a large GPU (docs/engines.md, "Tuned matmuls"). Timing its next few
        (other tiles and splits) is a few milliseconds at plan time, and the choice is the planner's to
        store: a later run recalls it (``use``). Each algorithm is deterministic; the choice by timing is
        not reproducible, so a reproducible policy keeps the first."""
        self.use(pick)
        return time(self)

    def use(self, pick: int) -> None:
        """Run ``algos[pick]`` (the planner's choice, timed or recalled)."""
        self.pick, self._algo = pick, self.algos[pick]

    @staticmethod
    def _destroy(L, desc, objs):
        for kind, h in objs:
            (L.matrix_layout_destroy if kind == "layout" else L.matmul_preference_destroy)(h)
        L.matmul_desc_destroy(desc)

    def __call__(self) -> None:
        lt = self.lt
        self._L.matmul(lt.handle, self.desc, lt._one.ctypes.data, self.b.data.ptr, self.la, self.a.data.ptr,
                       self.lb, lt._zero.ctypes.data, self.c.data.ptr, self.lc, self.c.data.ptr, self.lc,
                       self._algo, lt.workspace.data.ptr, lt.workspace_bytes, lt.stream.ptr)
