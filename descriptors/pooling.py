"""PoolingDescriptor: max, deterministic max, average; window, pad, stride."""

from __future__ import annotations

from ctypes import byref, c_int

from . import _lib
from ._base import CudnnObject
from ._lib import NanPropagation, PoolingMode
from .convolution import _enum, _pair

_MODES = {"max": PoolingMode.MAX, "max_deterministic": PoolingMode.MAX_DETERMINISTIC,
          "average": PoolingMode.AVERAGE_COUNT_INCLUDE_PADDING,
          "average_include_padding": PoolingMode.AVERAGE_COUNT_INCLUDE_PADDING,
          "average_exclude_padding": PoolingMode.AVERAGE_COUNT_EXCLUDE_PADDING}
_NAN = {"not_propagate": NanPropagation.NOT_PROPAGATE_NAN, "propagate": NanPropagation.PROPAGATE_NAN}


class PoolingDescriptor(CudnnObject):
    """``PoolingDescriptor("max", window=2, stride=2)``."""

    _kind = "Pooling"

    def __init__(self, mode="max", window=2, pad=0, stride=None, nan="not_propagate"):
        super().__init__()
        self.mode = PoolingMode(_enum(_MODES, mode, "pooling mode"))
        self.window = _pair(window, "window")
        self.pad = _pair(pad, "pad")
        self.stride = _pair(self.window if stride is None else stride, "stride")
        self.nan = NanPropagation(_enum(_NAN, nan, "NaN propagation"))
        # cuDNN accepts a negative pad, or one as wide as the window (windows made only of
        # padding), and computes garbage with it: refuse both here.
        if any(p < 0 or (w > 0 and p >= w) for p, w in zip(self.pad, self.window)):
            raise ValueError(f"pooling pad {self.pad} must be >= 0 and smaller than the window {self.window}")
        _lib.call("cudnnSetPooling2dDescriptor", self.ptr, self.mode, self.nan, *self.window, *self.pad,
                  *self.stride, mode=self.mode.name, window=self.window, pad=self.pad, stride=self.stride)

    def output_shape(self, x_desc) -> tuple[int, int, int, int]:
        n, c, h, w = c_int(), c_int(), c_int(), c_int()
        _lib.call("cudnnGetPooling2dForwardOutputDim", self.ptr, x_desc.ptr, byref(n), byref(c), byref(h),
                  byref(w), x=x_desc.shape, window=self.window, pad=self.pad, stride=self.stride)
        return (n.value, c.value, h.value, w.value)

    def read(self) -> dict:
        v = [c_int() for _ in range(8)]
        _lib.call("cudnnGetPooling2dDescriptor", self.ptr, *(byref(x) for x in v))
        mode, nan, wh, ww, ph, pw, sh, sw = (x.value for x in v)
        return {"mode": PoolingMode(mode).name.lower(), "window": (wh, ww), "pad": (ph, pw),
                "stride": (sh, sw), "nan": NanPropagation(nan).name.lower()}

    def __repr__(self) -> str:
        if self.closed:
            return "PoolingDescriptor(closed)"
        return "PoolingDescriptor(" + ", ".join(f"{k}={v}" for k, v in self.read().items()) + ")"

    def forward(self, handle, x_desc, x, y_desc, y, alpha: float = 1.0, beta: float = 0.0) -> None:
        dev = handle.device_id
        px, py = x_desc.check(x, "x", dev), y_desc.check(y, "y", dev)
        _lib.call("cudnnPoolingForward", handle.ptr, self.ptr, _lib.scalar(alpha, y_desc.dtype), x_desc.ptr,
                  px, _lib.scalar(beta, y_desc.dtype), y_desc.ptr, py, x=x_desc.shape, y=y_desc.shape,
                  window=self.window, stride=self.stride)

    def backward(self, handle, y_desc, y, dy_desc, dy, x_desc, x, dx_desc, dx,
                 alpha: float = 1.0, beta: float = 0.0) -> None:
        dev = handle.device_id
        py, pdy = y_desc.check(y, "y", dev), dy_desc.check(dy, "dy", dev)
        px, pdx = x_desc.check(x, "x", dev), dx_desc.check(dx, "dx", dev)
        _lib.call("cudnnPoolingBackward", handle.ptr, self.ptr, _lib.scalar(alpha, dx_desc.dtype),
                  y_desc.ptr, py, dy_desc.ptr, pdy, x_desc.ptr, px, _lib.scalar(beta, dx_desc.dtype),
                  dx_desc.ptr, pdx, y=y_desc.shape, x=x_desc.shape, window=self.window, stride=self.stride)
