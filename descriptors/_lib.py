"""Load libcudnn, declare the prototype of every function descriptors/ calls,
name the enums, and hold the one status check.

Only the cuDNN 9 descriptor API is used. None of the functions cuDNN 8 removed
(the algorithm getters without ``_v7``, the ``PREFER_FASTEST`` preferences)
appear here.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from ctypes import POINTER, c_char_p, c_double, c_float, c_int, c_size_t, c_void_p

from .errors import CudnnError, CudnnLoadError

MIN_VERSION = 90000  # cuDNN 9.0.0

_p = c_void_p          # handles, descriptors, device pointers, host scalars
_i = c_int             # ints and enums
_pi = POINTER(c_int)
_psz = POINTER(c_size_t)


class AlgoPerf(ctypes.Structure):
    """cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t: the three share this layout."""

    _fields_ = [
        ("algo", c_int),
        ("status", c_int),
        ("time", c_float),
        ("memory", c_size_t),
        ("determinism", c_int),
        ("mathType", c_int),
        ("reserved", c_int * 3),
    ]


_PAlgoPerf = POINTER(AlgoPerf)

# name: (restype, argtypes). Every function descriptors/ calls is declared here.
PROTOTYPES: dict[str, tuple[object, list]] = {
    "cudnnGetVersion": (c_size_t, []),
    "cudnnGetCudartVersion": (c_size_t, []),
    "cudnnGetErrorString": (c_char_p, [_i]),
    "cudnnGetLastErrorString": (None, [c_char_p, c_size_t]),
    # handle
    "cudnnCreate": (_i, [POINTER(c_void_p)]),
    "cudnnDestroy": (_i, [_p]),
    "cudnnSetStream": (_i, [_p, _p]),
    "cudnnGetStream": (_i, [_p, POINTER(c_void_p)]),
    # tensor
    "cudnnCreateTensorDescriptor": (_i, [POINTER(c_void_p)]),
    "cudnnDestroyTensorDescriptor": (_i, [_p]),
    "cudnnSetTensor4dDescriptor": (_i, [_p, _i, _i, _i, _i, _i, _i]),
    "cudnnGetTensor4dDescriptor": (_i, [_p, _pi, _pi, _pi, _pi, _pi, _pi, _pi, _pi, _pi]),
    "cudnnAddTensor": (_i, [_p, _p, _p, _p, _p, _p, _p]),
    # filter
    "cudnnCreateFilterDescriptor": (_i, [POINTER(c_void_p)]),
    "cudnnDestroyFilterDescriptor": (_i, [_p]),
    "cudnnSetFilter4dDescriptor": (_i, [_p, _i, _i, _i, _i, _i, _i]),
    "cudnnGetFilter4dDescriptor": (_i, [_p, _pi, _pi, _pi, _pi, _pi, _pi]),
    # convolution
    "cudnnCreateConvolutionDescriptor": (_i, [POINTER(c_void_p)]),
    "cudnnDestroyConvolutionDescriptor": (_i, [_p]),
    "cudnnSetConvolution2dDescriptor": (_i, [_p, _i, _i, _i, _i, _i, _i, _i, _i]),
    "cudnnGetConvolution2dDescriptor": (_i, [_p, _pi, _pi, _pi, _pi, _pi, _pi, _pi, _pi]),
    "cudnnSetConvolutionMathType": (_i, [_p, _i]),
    "cudnnGetConvolutionMathType": (_i, [_p, _pi]),
    "cudnnGetConvolution2dForwardOutputDim": (_i, [_p, _p, _p, _pi, _pi, _pi, _pi]),
    "cudnnGetConvolutionForwardAlgorithmMaxCount": (_i, [_p, _pi]),
    "cudnnGetConvolutionBackwardDataAlgorithmMaxCount": (_i, [_p, _pi]),
    "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount": (_i, [_p, _pi]),
    # (handle, descA, descB, conv, descOut, requested, *returned, perf)
    "cudnnGetConvolutionForwardAlgorithm_v7": (_i, [_p, _p, _p, _p, _p, _i, _pi, _PAlgoPerf]),
    "cudnnGetConvolutionBackwardDataAlgorithm_v7": (_i, [_p, _p, _p, _p, _p, _i, _pi, _PAlgoPerf]),
    "cudnnGetConvolutionBackwardFilterAlgorithm_v7": (_i, [_p, _p, _p, _p, _p, _i, _pi, _PAlgoPerf]),
    # (handle, descA, descB, conv, descOut, algo, *bytes)
    "cudnnGetConvolutionForwardWorkspaceSize": (_i, [_p, _p, _p, _p, _p, _i, _psz]),
    "cudnnGetConvolutionBackwardDataWorkspaceSize": (_i, [_p, _p, _p, _p, _p, _i, _psz]),
    "cudnnGetConvolutionBackwardFilterWorkspaceSize": (_i, [_p, _p, _p, _p, _p, _i, _psz]),
    # (handle, alpha, descA, a, descB, b, conv, algo, ws, wsBytes, beta, descOut, out)
    "cudnnConvolutionForward": (_i, [_p, _p, _p, _p, _p, _p, _p, _i, _p, c_size_t, _p, _p, _p]),
    "cudnnConvolutionBackwardData": (_i, [_p, _p, _p, _p, _p, _p, _p, _i, _p, c_size_t, _p, _p, _p]),
    "cudnnConvolutionBackwardFilter": (_i, [_p, _p, _p, _p, _p, _p, _p, _i, _p, c_size_t, _p, _p, _p]),
    "cudnnConvolutionBiasActivationForward":
        (_i, [_p, _p, _p, _p, _p, _p, _p, _i, _p, c_size_t, _p, _p, _p, _p, _p, _p, _p, _p]),
    # pooling
    "cudnnCreatePoolingDescriptor": (_i, [POINTER(c_void_p)]),
    "cudnnDestroyPoolingDescriptor": (_i, [_p]),
    "cudnnSetPooling2dDescriptor": (_i, [_p, _i, _i, _i, _i, _i, _i, _i, _i]),
    "cudnnGetPooling2dDescriptor": (_i, [_p, _pi, _pi, _pi, _pi, _pi, _pi, _pi, _pi]),
    "cudnnGetPooling2dForwardOutputDim": (_i, [_p, _p, _pi, _pi, _pi, _pi]),
    "cudnnPoolingForward": (_i, [_p, _p, _p, _p, _p, _p, _p, _p]),
    "cudnnPoolingBackward": (_i, [_p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p]),
    # activation
    "cudnnCreateActivationDescriptor": (_i, [POINTER(c_void_p)]),
    "cudnnDestroyActivationDescriptor": (_i, [_p]),
    "cudnnSetActivationDescriptor": (_i, [_p, _i, _i, c_double]),
    "cudnnGetActivationDescriptor": (_i, [_p, _pi, _pi, POINTER(c_double)]),
    "cudnnActivationForward": (_i, [_p, _p, _p, _p, _p, _p, _p, _p]),
    "cudnnActivationBackward": (_i, [_p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p]),
}


# ---------------------------------------------------------------- enums

class DataType(enum.IntEnum):
    FLOAT = 0
    DOUBLE = 1
    HALF = 2
    BFLOAT16 = 9


class TensorFormat(enum.IntEnum):
    NCHW = 0
    NHWC = 1


class MathType(enum.IntEnum):
    DEFAULT_MATH = 0
    TENSOR_OP_MATH = 1
    TENSOR_OP_MATH_ALLOW_CONVERSION = 2
    FMA_MATH = 3


class ConvolutionMode(enum.IntEnum):
    CONVOLUTION = 0
    CROSS_CORRELATION = 1


class NanPropagation(enum.IntEnum):
    NOT_PROPAGATE_NAN = 0
    PROPAGATE_NAN = 1


class Determinism(enum.IntEnum):
    NON_DETERMINISTIC = 0
    DETERMINISTIC = 1


class PoolingMode(enum.IntEnum):
    MAX = 0
    AVERAGE_COUNT_INCLUDE_PADDING = 1
    AVERAGE_COUNT_EXCLUDE_PADDING = 2
    MAX_DETERMINISTIC = 3


class ActivationMode(enum.IntEnum):
    SIGMOID = 0
    RELU = 1
    TANH = 2
    CLIPPED_RELU = 3
    ELU = 4
    IDENTITY = 5
    SWISH = 6


class ConvolutionFwdAlgo(enum.IntEnum):
    IMPLICIT_GEMM = 0
    IMPLICIT_PRECOMP_GEMM = 1
    GEMM = 2
    DIRECT = 3
    FFT = 4
    FFT_TILING = 5
    WINOGRAD = 6
    WINOGRAD_NONFUSED = 7


class ConvolutionBwdDataAlgo(enum.IntEnum):
    ALGO_0 = 0
    ALGO_1 = 1
    FFT = 2
    FFT_TILING = 3
    WINOGRAD = 4
    WINOGRAD_NONFUSED = 5


class ConvolutionBwdFilterAlgo(enum.IntEnum):
    ALGO_0 = 0
    ALGO_1 = 1
    FFT = 2
    ALGO_3 = 3
    WINOGRAD = 4
    WINOGRAD_NONFUSED = 5
    FFT_TILING = 6


# ---------------------------------------------------------------- loading

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_path: str | None = None


def _load() -> ctypes.CDLL:
    global _lib, _path
    with _lock:
        if _lib is not None:
            return _lib
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib
        except ImportError as e:  # pragma: no cover - depends on the install
            raise CudnnLoadError(
                "cuda-pathfinder is not installed, so libcudnn cannot be located; "
                "install the GPU stack: pip install '.[cu13]'") from e
        try:
            loaded = load_nvidia_dynamic_lib("cudnn")
        except Exception as e:  # pathfinder raises its own DynamicLibNotFoundError
            raise CudnnLoadError(
                f"libcudnn was not found ({e}); install it with "
                "pip install nvidia-cudnn-cu13 (or the project's '[cu13]' extra)") from e
        lib = ctypes.CDLL(loaded.abs_path)
        for name, (restype, argtypes) in PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        ver = int(lib.cudnnGetVersion())
        if ver < MIN_VERSION:
            raise CudnnLoadError(
                f"cuDNN {format_version(ver)} at {loaded.abs_path} is too old: "
                f"this project needs cuDNN 9 or newer (pip install nvidia-cudnn-cu13)")
        _lib, _path = lib, loaded.abs_path
        return lib


def lib() -> ctypes.CDLL:
    """The loaded libcudnn (loaded on first use)."""
    return _lib if _lib is not None else _load()


def library_path() -> str:
    lib()
    assert _path is not None
    return _path


def format_version(v: int) -> str:
    return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"


def version() -> int:
    """cuDNN's version as MAJOR*10000 + MINOR*100 + PATCH, e.g. 91900."""
    return int(lib().cudnnGetVersion())


def version_string() -> str:
    return format_version(version())


# ---------------------------------------------------------------- the one check

def status_name(status: int) -> str:
    return lib().cudnnGetErrorString(int(status)).decode()


def last_error_string() -> str:
    buf = ctypes.create_string_buffer(2048)
    lib().cudnnGetLastErrorString(buf, len(buf))
    return buf.value.decode(errors="replace")


def check(status: int, function: str, **info) -> None:
    """Raise CudnnError unless status is CUDNN_STATUS_SUCCESS."""
    if status != 0:
        raise CudnnError(status, status_name(status), function, info, last_error_string())


def call(function: str, *args, **info) -> None:
    """Call a cuDNN function and check its status; ``info`` goes into the error."""
    check(getattr(lib(), function)(*args), function, **info)


# ---------------------------------------------------------------- scalars

# alpha/beta: float for FLOAT/HALF/BFLOAT16 tensors, double for DOUBLE ones.
# Kept alive here, keyed by value: a step uses only a handful of them.
_scalars: dict[tuple[float, bool], ctypes._SimpleCData] = {}


def scalar(value: float, dtype: DataType) -> int:
    """The host address of alpha/beta ``value`` in the type cuDNN reads for ``dtype``."""
    key = (float(value), dtype == DataType.DOUBLE)
    obj = _scalars.get(key)
    if obj is None:
        obj = _scalars[key] = (c_double if key[1] else c_float)(key[0])
    return ctypes.addressof(obj)
