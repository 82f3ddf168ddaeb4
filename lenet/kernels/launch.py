"""One launch of a kernel of ours, prepared once and started by a call, with programmatic dependent
launch where the GPU has it.

Note [programmatic launch]: at small batches the step is a chain of dependent kernels of a few
microseconds each, and each link costs the next kernel's launch: its grid is scheduled only once the
kernel before it has finished. With programmatic dependent launch (sm_90 and later; cuLaunchKernelEx
with the programmatic-stream-serialization attribute), the next kernel is scheduled while the one
before it still runs, and its blocks wait at griddepcontrol.wait until that kernel has finished and
its writes are visible (lenet/kernels/griddep.cu: griddep_entry(), the first statement of every
kernel launched here, so nothing a kernel does moves before the wait). Inside a captured step the
launch becomes a programmatic edge of the CUDA graph. It saves a fraction of a microsecond a dependent
launch, and only for a grid that fits in one wave of the SMs (docs/kernels.md, "Launches and
compiles"). The rule is structural: a kernel launched here must begin with
griddep_entry() (tests/test_engines_cpu.py reads the sources for it); a kernel that did not could
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
    [programmatic launch]), or 0 where our kernels are compiled for a compute capability below 9.0 (no
    griddepcontrol: Note [kernel architecture] in lenet/kernels/nvrtc.py)."""
    import cupy

    from .nvrtc import kernel_arch

    d = cupy.cuda.Device(device_id)
    return int(d.attributes["MultiProcessorCount"]) if kernel_arch() >= 90 else 0


@functools.lru_cache(maxsize=None)
def shared_memory_limit(device_id: int) -> int:
    """The most dynamic shared memory a block of GPU ``device_id`` may opt in to (bytes)."""
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"])


# Note [launch shapes from the device]: a launch shape of ours names the blocks per SM it asks for (g8:
# eight); how many one SM holds at once depends on the GPU (threads, registers and shared memory an SM has:
# 1024 threads and 64 KB on a T4, 2048 and 228 KB on sm_90) and on the kernel's build. ``resident`` asks
# the occupancy API, and the stage launchers (lenet/kernels/stages.py) make their grids of at most that
# many blocks per SM, so a grid is one wave on any GPU. No kernel of ours waits for another block's
# progress (a ticket's last block sums the others' parts; nothing spins), so a grid of more blocks than
# fit at once still finishes, in more waves: ``squeezed`` proves it on the GPU (tests/test_stages_gpu.py),
# every launch of ours given enough extra dynamic shared memory that one block fills an SM.
_squeeze = {"on": False, "follow": True}


@functools.lru_cache(maxsize=None)
def shared_memory_per_sm(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerMultiprocessor"])


def _squeezed(shared_mem: int) -> int:
    """The dynamic shared memory a launch asks for: its own, or while ``squeezed``, enough that one block
    fills an SM's."""
    if not _squeeze["on"]:
        return int(shared_mem)
    import cupy

    dev = cupy.cuda.Device().id
    return max(int(shared_mem), min(shared_memory_limit(dev), shared_memory_per_sm(dev) // 2 + 1024))


class squeezed:
    """``with squeezed():`` every Launch made inside asks for enough extra dynamic shared memory that one
    block fills an SM (Note [launch shapes from the device]); with ``follow=False`` the stage launchers keep
    the grids they would make unsqueezed (more blocks than fit at once: several waves)."""

    def __init__(self, follow: bool = True):
        self.follow = bool(follow)

    def __enter__(self):
        self._was = dict(_squeeze)
        _squeeze.update(on=True, follow=self.follow)
        return self

    def __exit__(self, *exc):
        _squeeze.update(self._was)
        return False


def _opt_in(fn, shared_mem: int) -> None:
    """Beyond 48 KiB of dynamic shared memory a kernel opts in, up to the device's limit."""
    if shared_mem > 48 * 1024:
        import cupy

        limit = shared_memory_limit(cupy.cuda.Device().id)
        if shared_mem > limit:
            raise ValueError(f"{shared_mem} bytes of dynamic shared memory: this GPU allows at most {limit}")
        if fn.max_dynamic_shared_size_bytes < shared_mem:
            fn.max_dynamic_shared_size_bytes = int(shared_mem)


def resident(fn, threads: int, shared_mem: int = 0) -> int:
    """How many blocks of ``fn`` (a cupy.RawKernel of ours) of ``threads`` threads and ``shared_mem`` bytes of
    dynamic shared memory one SM of the current GPU holds at once: the occupancy API's answer (Note [launch
    shapes from the device]); while ``squeezed(follow=False)``, as many as unsqueezed."""
    if not (_squeeze["on"] and not _squeeze["follow"]):
        shared_mem = _squeezed(shared_mem)
    _opt_in(fn, shared_mem)
    from cupy_backends.cuda.api import driver

    return int(driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, int(threads), int(shared_mem)))


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

        shared_mem = _squeezed(shared_mem)   # Note [launch shapes from the device]
        _opt_in(fn, shared_mem)
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
