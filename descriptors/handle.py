"""The cuDNN handle, bound to a CuPy stream, and the plain-words GPU check."""

from __future__ import annotations

import ctypes
import functools

from . import _lib
from ._base import CudnnObject
from .errors import CudnnError, NoGpuError


@functools.lru_cache(maxsize=1)
def gpu_status() -> tuple[bool, str]:
    """(True, GPU name) when a usable NVIDIA GPU is there, else (False, why not)."""
    try:
        import cupy
        from cupy_backends.cuda.api import runtime
    except ImportError as e:
        return False, f"CuPy is not installed ({e}); install the GPU stack with pip install '.[cu13]'"
    try:
        n = runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver, driver too old, ...
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            return False, "no NVIDIA driver is installed (libcuda.so.1 cannot be loaded)"
        return False, f"the CUDA runtime could not count GPUs (cudaGetDeviceCount: {e})"
    if n == 0:
        return False, "the CUDA driver reports no GPU (cudaGetDeviceCount returned 0)"
    try:
        props = runtime.getDeviceProperties(cupy.cuda.Device().id)
    except Exception as e:
        return False, f"the CUDA runtime could not read the GPU's properties ({e})"
    return True, props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])


def require_gpu() -> str:
    """The GPU's name, or NoGpuError saying what was checked and what failed."""
    ok, why = gpu_status()
    if not ok:
        raise NoGpuError(f"no usable NVIDIA GPU: {why}")
    return why


class Handle(CudnnObject):
    """A cuDNN handle on the current CUDA device, its stream set explicitly.

    ``stream`` is a ``cupy.cuda.Stream``; None means a new non-blocking stream
    owned by the handle (never the legacy default stream, which cannot be captured).
    """

    _kind = "Handle"
    _create_fn = "cudnnCreate"
    _destroy_fn = "cudnnDestroy"

    def __init__(self, stream=None):
        self.gpu_name = require_gpu()
        import cupy

        self.device_id = cupy.cuda.Device().id
        try:
            super().__init__()
        except CudnnError as e:
            raise NoGpuError(
                f"no usable NVIDIA GPU: cudaGetDeviceCount found one ({self.gpu_name}) but "
                f"cudnnCreate failed with {e.status_name}: {e.explanation or 'no explanation'}") from e
        self.stream = None
        self.set_stream(stream if stream is not None else cupy.cuda.Stream(non_blocking=True))

    def set_stream(self, stream) -> None:
        """Bind the handle to ``stream``: every cuDNN call through it runs there."""
        _lib.call("cudnnSetStream", self.ptr, ctypes.c_void_p(stream.ptr), stream=hex(stream.ptr))
        self.stream = stream

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"stream={self.stream.ptr:#x}"
        return f"Handle(device={self.device_id} '{self.gpu_name}', {state})"
