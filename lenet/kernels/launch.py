"""One launch of a kernel of ours, prepared once and started by a call, with programmatic dependent
launch where the GPU has it.

Note [programmatic launch]: at small batches the step is a chain of dependent kernels of a few
microseconds each, and each link costs the next kernel's launch: its grid is scheduled only once the
kernel before it has finished. With programmatic dependent launch (sm_90 and later; cuLaunchKernelEx
with the programmatic-stream-serialization attribute), the next kernel is scheduled while the one
before it still runs, and its blocks wait at griddepcontrol.wait until that kernel has finished and
its writes are visible (lenet/kernels/griddep.cu: griddep_entry(), the first statement of every
kernel launched here, so nothing a kernel does moves before the wait). Inside a captured step the
launch becomes a programmatic edge of the CUDA graph. Measured on an H100 (scripts/probes/pdl.py): a
chain of one-block kernels in a CUDA graph takes 0.33-0.44 us less per dependent launch, 64-block
kernels 0.26-0.60 us. Only for a grid that fits in one wave of the SMs, though: at batch 8192, where
our stage kernels run several waves, launching every kernel programmatically took the step from
831-835 to 844-845 us, where batch 1 went from 40.1-40.4 to 38.5-38.6 (scripts/bench.py, ours auto,
the two trees in turn on one H100, both with a 32-warp stage_reduce_kernel since reverted). The rule is structural: a kernel launched here must begin with
griddep_entry() (tests/test_stages_cpu.py reads the sources for it); a kernel that did not could
run beside the one before it. Where the previous work on the stream is not a kernel (an event the
side stream joins, a copy) or not one of ours (cuBLAS, cuDNN), the launch waits for it as a plain
launch does. Written by hand over the driver's cuLaunchKernelEx, called through ctypes: CuPy's kernel
call takes no launch attributes, and cuda-python's driver module resolves every driver entry point as
it loads (34 cuGetProcAddress calls this driver answers "invalid value", each an error under
compute-sanitizer's memcheck) and would add its import to the start-up.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

# numpy scalar type -> the ctypes type cuLaunchKernelEx reads the argument as
_SCALARS = {np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32, np.int64: ctypes.c_int64,
            np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float, np.float64: ctypes.c_double}

_PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CUlaunchAttributeID (cuda.h)


class _Attribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union (an int at its start here)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("numAttrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def _driver_launch():
    """The driver's cuLaunchKernelEx (libcuda, which CuPy has loaded already)."""
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=None)
def _driver_error_name():
    """The driver's cuGetErrorName."""
    fn = ctypes.CDLL("libcuda.so.1").cuGetErrorName
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    fn.restype = ctypes.c_int
    return fn


def error_name(code: int) -> str:
    """The driver's name of error ``code`` (CUDA_ERROR_ILLEGAL_ADDRESS), or the number where it has none."""
    name = ctypes.c_char_p()
    try:
        if _driver_error_name()(int(code), ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
    except (OSError, AttributeError):
        pass
    return f"CUDA driver error {int(code)}"


class LaunchError(RuntimeError):
    """A launch of ours the driver refused: the message names the error, the kernel and its grid."""


@functools.lru_cache(maxsize=None)
def programmatic_grid_limit(device_id: int) -> int:
    """The largest grid GPU ``device_id`` launches programmatically: one wave of its SMs (Note
    [programmatic launch]), or 0 before compute capability 9.0 (no programmatic dependent launch)."""
    import cupy

    d = cupy.cuda.Device(device_id)
    return int(d.attributes["MultiProcessorCount"]) if int(d.compute_capability) >= 90 else 0


@functools.lru_cache(maxsize=None)
def shared_memory_limit(device_id: int) -> int:
    """The most dynamic shared memory a block of GPU ``device_id`` may opt in to (bytes)."""
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"])


def _packed(args) -> tuple[list, object]:
    """The arguments as ctypes values and the void* array cuLaunchKernelEx reads them through."""
    values = []
    for a in args:
        if hasattr(a, "data") and hasattr(a.data, "ptr"):     # a CuPy array: its device pointer
            values.append(ctypes.c_void_p(a.data.ptr))
        elif type(a) in _SCALARS:
            values.append(_SCALARS[type(a)](a.item()))
        else:
            raise TypeError(f"kernel argument of type {type(a).__name__}: pass a CuPy array or a numpy scalar "
                            f"({', '.join(t.__name__ for t in _SCALARS)})")
    pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
    return values, pointers


class Launch:
    """``fn`` (a cupy.RawKernel of ours, beginning with griddep_entry()) on ``grid`` blocks of ``block``
    threads with ``shared_mem`` bytes of dynamic shared memory and ``args``, on ``stream``; each call
    launches it once (Note [programmatic launch]). The arrays among ``args`` must outlive it."""

    __slots__ = ("_launch", "_config", "_fn", "_params", "_keep", "name", "grid", "block", "shared_mem")

    def __init__(self, fn, grid, block, args, stream, shared_mem: int = 0, programmatic: bool = True):
        import cupy

        if shared_mem > 48 * 1024:   # beyond 48 KiB a kernel opts in, up to the device's limit
            limit = shared_memory_limit(cupy.cuda.Device().id)
            if shared_mem > limit:
                raise ValueError(f"{shared_mem} bytes of dynamic shared memory: this GPU allows at most {limit}")
            if fn.max_dynamic_shared_size_bytes < shared_mem:
                fn.max_dynamic_shared_size_bytes = int(shared_mem)
        grid = tuple(int(v) for v in grid) + (1,) * (3 - len(grid))
        block = tuple(int(v) for v in block) + (1,) * (3 - len(block))
        attrs = (_Attribute * 1)()
        attrs[0].id, attrs[0].value = _PROGRAMMATIC_STREAM_SERIALIZATION, 1
        on = programmatic and grid[0] * grid[1] * grid[2] <= programmatic_grid_limit(cupy.cuda.Device().id)
        config = _Config(*grid, *block, int(shared_mem), stream.ptr, attrs, 1 if on else 0)
        self._config = ctypes.byref(config)   # made once: a call allocates nothing
        self._fn = ctypes.c_void_p(fn.kernel.ptr)
        values, pointers = _packed(args)
        self._params = ctypes.addressof(pointers)
        self._launch = _driver_launch()
        self._keep = (config, values, pointers, tuple(args), attrs)
        self.name, self.grid, self.block, self.shared_mem = getattr(fn, "name", "kernel"), grid, block, int(shared_mem)

    def set(self, i: int, value) -> None:
        """Argument ``i`` of the next launches: a number (of the type it was made with) or a CuPy array,
        which the caller keeps alive while launches use it."""
        self._keep[1][i].value = value.data.ptr if hasattr(value, "data") else value

    def set_grid(self, x: int) -> None:
        """The grid's first dimension for the next launches (a launch made with programmatic=False)."""
        self._keep[0].gridDimX = int(x)

    def __call__(self) -> None:
        err = self._launch(self._config, self._fn, self._params, None)
        if err:
            raise LaunchError(self.describe_failure(err))

    def describe_failure(self, err: int) -> str:
        return (f"{self.name} failed to launch on grid {self.grid}, block {self.block}, {self.shared_mem} B of "
                f"shared memory: {error_name(err)} ({err})")
