"""What the NVIDIA driver says about this machine's GPUs, through ctypes alone: no CUDA context, no CuPy, nothing
but the standard library (the build backend, build_support/lenet_build.py, asks too, before NumPy is there).
CUDA_VISIBLE_DEVICES applies. Where there is no driver or no GPU: none."""

from __future__ import annotations

import ctypes

CAPABILITY_MAJOR, CAPABILITY_MINOR = 75, 76   # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _MINOR


def _driver():
    """libcuda, initialized, and the number of GPUs it sees; (None, 0) where there is no driver or no GPU."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int()
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(n)) != 0:
            return None, 0
        return cuda, n.value
    except (OSError, AttributeError):
        return None, 0


def gpu_count() -> int:
    """The GPUs this process sees; 0 where there is no driver or no GPU."""
    return _driver()[1]


def gpu_archs(driver_at_least: int = 0) -> list[int]:
    """The compute capabilities (75, 90, ...) of the GPUs this process sees, each once, in order; [] where there
    is no driver, no GPU, or a driver older than ``driver_at_least`` (13000: CUDA 13)."""
    cuda, n = _driver()
    version = ctypes.c_int()
    if cuda is None or cuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < driver_at_least:
        return []
    archs = set()
    for ordinal in range(n):
        dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if (cuda.cuDeviceGet(ctypes.byref(dev), ordinal) == 0
                and cuda.cuDeviceGetAttribute(ctypes.byref(major), CAPABILITY_MAJOR, dev) == 0
                and cuda.cuDeviceGetAttribute(ctypes.byref(minor), CAPABILITY_MINOR, dev) == 0):
            archs.add(10 * major.value + minor.value)
    return sorted(archs)
