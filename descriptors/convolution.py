"""ConvolutionDescriptor and the calls of its three directions, plus bias gradients."""

from __future__ import annotations

from ctypes import byref, c_int

from . import _lib
from ._base import CudnnObject
from ._lib import ConvolutionMode, DataType, MathType
from .tensor import FilterDescriptor, TensorDescriptor, data_type, dtype_name

_MODES = {"cross_correlation": ConvolutionMode.CROSS_CORRELATION,
          "convolution": ConvolutionMode.CONVOLUTION}
_MATH = {"default": MathType.DEFAULT_MATH, "tensor_op": MathType.TENSOR_OP_MATH,
         "tensor_op_allow_conversion": MathType.TENSOR_OP_MATH_ALLOW_CONVERSION,
         "fma": MathType.FMA_MATH}


def _pair(v, what: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    t = tuple(v)
    if len(t) != 2 or not all(isinstance(x, int) for x in t):
        raise ValueError(f"{what} must be an int or a pair of ints, got {v!r}")
    return t  # type: ignore[return-value]


def _enum(table: dict, value, what: str):
    if isinstance(value, str):
        try:
            return table[value.lower()]
        except KeyError:
            raise ValueError(f"unknown {what} {value!r}; use one of {sorted(table)}") from None
    return value


def math_type_name(m: int) -> str:
    return {v: k for k, v in _MATH.items()}.get(int(m), str(int(m)))


class ConvolutionDescriptor(CudnnObject):
    """2-D convolution: pad, stride, dilation, mode, compute type, math type.

    ``math_type`` defaults to "fma" for float32 (see Note [math type]); "default"
    lets cuDNN use TF32 tensor cores on Ampere and newer GPUs.

    Note [math type]: with CUDNN_DEFAULT_MATH, cuDNN may run float32 convolutions
    on TF32 tensor cores (10-bit mantissa), which moves results by ~1e-3 relative.
    CUDNN_FMA_MATH keeps them in float32, which is what makes the 1e-4 parity with
    PyTorch (run with torch.backends.cudnn.allow_tf32 = False) hold.
    """

    _kind = "Convolution"

    def __init__(self, pad=0, stride=1, dilation=1, mode="cross_correlation",
                 compute_type="float32", math_type=None):
        super().__init__()
        self.pad = _pair(pad, "pad")
        self.stride = _pair(stride, "stride")
        self.dilation = _pair(dilation, "dilation")
        self.mode = ConvolutionMode(_enum(_MODES, mode, "convolution mode"))
        self.compute_type = data_type(compute_type)
        if math_type is None:
            math_type = "fma" if self.compute_type == DataType.FLOAT else "default"
        self.math_type = MathType(_enum(_MATH, math_type, "math type"))
        info = dict(pad=self.pad, stride=self.stride, dilation=self.dilation)
        _lib.call("cudnnSetConvolution2dDescriptor", self.ptr, *self.pad, *self.stride, *self.dilation,
                  self.mode, self.compute_type, **info)
        _lib.call("cudnnSetConvolutionMathType", self.ptr, self.math_type, math_type=self.math_type.name)

    def output_shape(self, x_desc: TensorDescriptor, w_desc: FilterDescriptor) -> tuple[int, int, int, int]:
        """The output (N, K, P, Q), as cuDNN computes it."""
        n, c, h, w = c_int(), c_int(), c_int(), c_int()
        _lib.call("cudnnGetConvolution2dForwardOutputDim", self.ptr, x_desc.ptr, w_desc.ptr,
                  byref(n), byref(c), byref(h), byref(w),
                  x=x_desc.shape, w=w_desc.shape, pad=self.pad, stride=self.stride, dilation=self.dilation)
        return (n.value, c.value, h.value, w.value)

    def read(self) -> dict:
        v = [c_int() for _ in range(8)]
        _lib.call("cudnnGetConvolution2dDescriptor", self.ptr, *(byref(x) for x in v))
        ph, pw, sh, sw, dh, dw, mode, ct = (x.value for x in v)
        m = c_int()
        _lib.call("cudnnGetConvolutionMathType", self.ptr, byref(m))
        return {"pad": (ph, pw), "stride": (sh, sw), "dilation": (dh, dw),
                "mode": ConvolutionMode(mode).name.lower(), "compute_type": dtype_name(DataType(ct)),
                "math_type": math_type_name(m.value)}

    def __repr__(self) -> str:
        if self.closed:
            return "ConvolutionDescriptor(closed)"
        s = self.read()
        return ("ConvolutionDescriptor(" + ", ".join(f"{k}={v}" for k, v in s.items()) + ")")

    # ------------------------------------------------------------ op calls
    # Each takes descriptors and CuPy arrays, checks every array against its
    # descriptor, then calls cuDNN. ``algo`` is an int or an AlgoResult;
    # ``workspace`` is a Workspace (or None for algorithms that need none).

    def forward(self, handle, x_desc, x, w_desc, w, y_desc, y, algo, workspace=None,
                alpha: float = 1.0, beta: float = 0.0) -> None:
        """y = alpha * conv(x, w) + beta * y."""
        dev = handle.device_id
        px, pw, py = x_desc.check(x, "x", dev), w_desc.check(w, "w", dev), y_desc.check(y, "y", dev)
        a, ws, wsb = _algo_ws(algo, workspace)
        _lib.call("cudnnConvolutionForward", handle.ptr, _lib.scalar(alpha, y_desc.dtype), x_desc.ptr, px,
                  w_desc.ptr, pw, self.ptr, a, ws, wsb, _lib.scalar(beta, y_desc.dtype), y_desc.ptr, py,
                  x=x_desc.shape, w=w_desc.shape, y=y_desc.shape, pad=self.pad, stride=self.stride,
                  algo=a, workspace=wsb)

    def backward_data(self, handle, w_desc, w, dy_desc, dy, dx_desc, dx, algo, workspace=None,
                      alpha: float = 1.0, beta: float = 0.0) -> None:
        """dx = alpha * conv_transpose(dy, w) + beta * dx."""
        dev = handle.device_id
        pw, pdy, pdx = w_desc.check(w, "w", dev), dy_desc.check(dy, "dy", dev), dx_desc.check(dx, "dx", dev)
        a, ws, wsb = _algo_ws(algo, workspace)
        _lib.call("cudnnConvolutionBackwardData", handle.ptr, _lib.scalar(alpha, dx_desc.dtype), w_desc.ptr,
                  pw, dy_desc.ptr, pdy, self.ptr, a, ws, wsb, _lib.scalar(beta, dx_desc.dtype), dx_desc.ptr,
                  pdx, w=w_desc.shape, dy=dy_desc.shape, dx=dx_desc.shape, pad=self.pad,
                  stride=self.stride, algo=a, workspace=wsb)

    def backward_filter(self, handle, x_desc, x, dy_desc, dy, dw_desc, dw, algo, workspace=None,
                        alpha: float = 1.0, beta: float = 0.0) -> None:
        """dw = alpha * (gradient of conv w.r.t. w) + beta * dw."""
        dev = handle.device_id
        px, pdy, pdw = x_desc.check(x, "x", dev), dy_desc.check(dy, "dy", dev), dw_desc.check(dw, "dw", dev)
        a, ws, wsb = _algo_ws(algo, workspace)
        _lib.call("cudnnConvolutionBackwardFilter", handle.ptr, _lib.scalar(alpha, dw_desc.dtype),
                  x_desc.ptr, px, dy_desc.ptr, pdy, self.ptr, a, ws, wsb,
                  _lib.scalar(beta, dw_desc.dtype), dw_desc.ptr, pdw, x=x_desc.shape, dy=dy_desc.shape,
                  dw=dw_desc.shape, pad=self.pad, stride=self.stride, algo=a, workspace=wsb)

    def bias_activation_forward(self, handle, x_desc, x, w_desc, w, b_desc, b, act, y_desc, y, algo,
                                workspace=None, alpha: float = 1.0) -> None:
        """y = act(alpha * conv(x, w) + b) in one cuDNN call (z term off)."""
        dev = handle.device_id
        px, pw = x_desc.check(x, "x", dev), w_desc.check(w, "w", dev)
        pb, py = b_desc.check(b, "bias", dev), y_desc.check(y, "y", dev)
        a, ws, wsb = _algo_ws(algo, workspace)
        # alpha2 = 0: the z input is ignored; cuDNN still wants a descriptor, y's.
        _lib.call("cudnnConvolutionBiasActivationForward", handle.ptr, _lib.scalar(alpha, y_desc.dtype),
                  x_desc.ptr, px, w_desc.ptr, pw, self.ptr, a, ws, wsb, _lib.scalar(0.0, y_desc.dtype),
                  y_desc.ptr, py, b_desc.ptr, pb, act.ptr, y_desc.ptr, py, x=x_desc.shape, w=w_desc.shape,
                  y=y_desc.shape, algo=a, activation=act.mode.name)


def _algo_ws(algo, workspace) -> tuple[int, int, int]:
    need = getattr(algo, "workspace_bytes", 0)
    a = int(getattr(algo, "algo", algo))
    if workspace is None:
        if need:
            raise ValueError(f"algorithm {getattr(algo, 'name', a)} needs a workspace of {need} bytes, "
                             f"none was given")
        return a, 0, 0
    if workspace.size < need:
        raise ValueError(f"algorithm {getattr(algo, 'name', a)} needs a workspace of {need} bytes, "
                         f"the one given has {workspace.size}")
    return a, workspace.ptr, workspace.size
