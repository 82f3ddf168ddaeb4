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
"""

from __future__ import annotations

import weakref

import numpy as np


class Blas:
    def __init__(self, stream, workspace_bytes: int = 4 << 20):
        import cupy
        from nvmath.bindings import cublas

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
        """out = alpha * a.sum(axis=0) + beta * out for row-major a (r, c); ``ones`` holds >= r ones."""
        r, c = a.shape
        if out.shape != (c,) or ones.shape[0] < r:
            raise ValueError(f"column_sums: a {a.shape}, out {out.shape}, ones {ones.shape}")
        # Row-major a (r, c) is column-major (c, r): out = A_cm @ ones.
        self._cb.sgemv(self.handle, self._cb.Operation.N, c, r, self._s(alpha), a.data.ptr, c,
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
