"""ActivationDescriptor: relu, sigmoid, tanh, clipped relu, elu."""

from __future__ import annotations

import math
from ctypes import byref, c_double, c_int

from . import _lib
from ._base import CudnnObject
from ._lib import ActivationMode, NanPropagation
from .convolution import _enum
from .pooling import _NAN

_MODES = {"relu": ActivationMode.RELU, "sigmoid": ActivationMode.SIGMOID, "tanh": ActivationMode.TANH,
          "clipped_relu": ActivationMode.CLIPPED_RELU, "elu": ActivationMode.ELU,
          "identity": ActivationMode.IDENTITY}


class ActivationDescriptor(CudnnObject):
    """``ActivationDescriptor("relu")``; ``coef`` is the clipping ceiling (clipped_relu) or
    alpha (elu)."""

    _kind = "Activation"

    def __init__(self, mode="relu", coef: float = 0.0, nan="not_propagate"):
        super().__init__()
        self.mode = ActivationMode(_enum(_MODES, mode, "activation mode"))
        if not math.isfinite(coef):
            raise ValueError(f"activation coef must be finite, got {coef}")
        self.coef = float(coef)
        self.nan = NanPropagation(_enum(_NAN, nan, "NaN propagation"))
        _lib.call("cudnnSetActivationDescriptor", self.ptr, self.mode, self.nan, c_double(self.coef),
                  mode=self.mode.name, coef=self.coef)

    def read(self) -> dict:
        m, n, c = c_int(), c_int(), c_double()
        _lib.call("cudnnGetActivationDescriptor", self.ptr, byref(m), byref(n), byref(c))
        return {"mode": ActivationMode(m.value).name.lower(), "nan": NanPropagation(n.value).name.lower(),
                "coef": c.value}

    def __repr__(self) -> str:
        if self.closed:
            return "ActivationDescriptor(closed)"
        return "ActivationDescriptor(" + ", ".join(f"{k}={v}" for k, v in self.read().items()) + ")"

    def forward(self, handle, x_desc, x, y_desc, y, alpha: float = 1.0, beta: float = 0.0) -> None:
        """y = act(x); x and y may be the same array."""
        dev = handle.device_id
        px, py = x_desc.check(x, "x", dev), y_desc.check(y, "y", dev)
        _lib.call("cudnnActivationForward", handle.ptr, self.ptr, _lib.scalar(alpha, y_desc.dtype), x_desc.ptr,
                  px, _lib.scalar(beta, y_desc.dtype), y_desc.ptr, py, x=x_desc.shape, mode=self.mode.name)

    def backward(self, handle, y_desc, y, dy_desc, dy, x_desc, x, dx_desc, dx,
                 alpha: float = 1.0, beta: float = 0.0) -> None:
        """dx = act'(x) * dy; for relu, x may be y (ReLU's output has the input's sign)."""
        dev = handle.device_id
        py, pdy = y_desc.check(y, "y", dev), dy_desc.check(dy, "dy", dev)
        px, pdx = x_desc.check(x, "x", dev), dx_desc.check(dx, "dx", dev)
        _lib.call("cudnnActivationBackward", handle.ptr, self.ptr, _lib.scalar(alpha, dx_desc.dtype),
                  y_desc.ptr, py, dy_desc.ptr, pdy, x_desc.ptr, px, _lib.scalar(beta, dx_desc.dtype),
                  dx_desc.ptr, pdx, y=y_desc.shape, mode=self.mode.name)
