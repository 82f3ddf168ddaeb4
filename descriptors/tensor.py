"""Tensor and filter descriptors (NCHW), dtype mapping, array checks, add_tensor."""

from __future__ import annotations

from ctypes import byref, c_int

import numpy as np

from . import _lib
from ._base import CudnnObject
from ._lib import DataType, TensorFormat

_DTYPES = {
    "float32": DataType.FLOAT,
    "float64": DataType.DOUBLE,
    "float16": DataType.HALF,
    "bfloat16": DataType.BFLOAT16,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def data_type(dtype) -> DataType:
    """cuDNN's data type for a dtype given as a name, a NumPy dtype or a DataType."""
    if isinstance(dtype, DataType):
        return dtype
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}") from None


def dtype_name(dt: DataType) -> str:
    return _NAMES[DataType(dt)]


def _shape4(shape, what: str) -> tuple[int, int, int, int]:
    shape = tuple(shape)
    if len(shape) != 4 or not all(isinstance(d, (int, np.integer)) for d in shape):
        raise ValueError(f"{what} shape must be 4 integers (N, C, H, W), got {shape!r}")
    return tuple(int(d) for d in shape)  # type: ignore[return-value]


def check_array(array, name: str, shape: tuple[int, ...], dt: DataType, device_id: int | None) -> int:
    """Check a CuPy array against a descriptor; return its device pointer.

    A mismatch raises ValueError naming the array, what it is and what the
    descriptor wants, before cuDNN ever sees the pointer.
    """
    try:
        import cupy
    except ImportError:  # pragma: no cover
        cupy = None
    if cupy is None or not isinstance(array, cupy.ndarray):
        raise ValueError(f"{name} must be a CuPy array on the GPU, got {type(array).__module__}."
                         f"{type(array).__name__}")
    if array.shape != shape:
        raise ValueError(f"{name} has shape {array.shape}, the descriptor wants {shape}")
    want = dtype_name(dt)
    if array.dtype.name != want:
        raise ValueError(f"{name} has dtype {array.dtype.name}, the descriptor wants {want}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} is not C-contiguous (strides {array.strides}); "
                         f"the descriptor describes a packed NCHW array")
    if device_id is not None and array.device.id != device_id:
        raise ValueError(f"{name} is on GPU {array.device.id}, the handle is on GPU {device_id}")
    return array.data.ptr


class TensorDescriptor(CudnnObject):
    """A packed NCHW tensor: ``TensorDescriptor((N, C, H, W), "float32")``."""

    _kind = "Tensor"

    def __init__(self, shape, dtype="float32"):
        super().__init__()
        self.shape = _shape4(shape, "tensor")
        self.dtype = data_type(dtype)
        n, c, h, w = self.shape
        _lib.call("cudnnSetTensor4dDescriptor", self.ptr, TensorFormat.NCHW, self.dtype, n, c, h, w,
                  shape=self.shape, dtype=dtype_name(self.dtype))

    def check(self, array, name: str = "array", device_id: int | None = None) -> int:
        return check_array(array, name, self.shape, self.dtype, device_id)

    def read(self) -> dict:
        """The state as cuDNN holds it."""
        v = [c_int() for _ in range(9)]
        _lib.call("cudnnGetTensor4dDescriptor", self.ptr, *(byref(x) for x in v))
        dt, n, c, h, w, ns, cs, hs, ws = (x.value for x in v)
        return {"dtype": dtype_name(DataType(dt)), "shape": (n, c, h, w), "strides": (ns, cs, hs, ws)}

    def __repr__(self) -> str:
        if self.closed:
            return f"TensorDescriptor(closed, shape={self.shape})"
        s = self.read()
        return f"TensorDescriptor(shape={s['shape']}, strides={s['strides']}, dtype={s['dtype']})"


class FilterDescriptor(CudnnObject):
    """Convolution weights (K, C, R, S) in NCHW order."""

    _kind = "Filter"

    def __init__(self, shape, dtype="float32"):
        super().__init__()
        self.shape = _shape4(shape, "filter")
        self.dtype = data_type(dtype)
        k, c, h, w = self.shape
        _lib.call("cudnnSetFilter4dDescriptor", self.ptr, self.dtype, TensorFormat.NCHW, k, c, h, w,
                  shape=self.shape, dtype=dtype_name(self.dtype))

    def check(self, array, name: str = "filter", device_id: int | None = None) -> int:
        return check_array(array, name, self.shape, self.dtype, device_id)

    def read(self) -> dict:
        v = [c_int() for _ in range(6)]
        _lib.call("cudnnGetFilter4dDescriptor", self.ptr, *(byref(x) for x in v))
        dt, fmt, k, c, h, w = (x.value for x in v)
        return {"dtype": dtype_name(DataType(dt)), "format": TensorFormat(fmt).name, "shape": (k, c, h, w)}

    def __repr__(self) -> str:
        if self.closed:
            return f"FilterDescriptor(closed, shape={self.shape})"
        s = self.read()
        return f"FilterDescriptor(shape={s['shape']}, format={s['format']}, dtype={s['dtype']})"


def add_tensor(handle, a_desc: TensorDescriptor, a, c_desc: TensorDescriptor, c,
               alpha: float = 1.0, beta: float = 1.0) -> None:
    """c = alpha * a + beta * c, broadcasting a over c's dims where a's are 1 (a bias add)."""
    dev = handle.device_id
    pa = a_desc.check(a, "a", dev)
    pc = c_desc.check(c, "c", dev)
    _lib.call("cudnnAddTensor", handle.ptr, _lib.scalar(alpha, c_desc.dtype), a_desc.ptr, pa,
              _lib.scalar(beta, c_desc.dtype), c_desc.ptr, pc, a=a_desc.shape, c=c_desc.shape)


__all__ = ["TensorDescriptor", "FilterDescriptor", "add_tensor", "data_type", "dtype_name", "check_array"]
