"""The package's build backend: setuptools', and our kernels compiled into the wheel for the GPU of the machine
that builds it (Note [kernels built with the package] in lenet/kernels/nvrtc.py).

Where that machine has an NVIDIA GPU whose driver runs CUDA 13, the build also asks for what lenet.kernels
compiles with (NumPy, cuda-pathfinder, NVRTC 13), and setup.py's build step compiles every module for the
GPU's architecture into lenet/kernels/built/, as `pip install` compiles the package's bytecode. Elsewhere (no
GPU, an older driver, an editable install) the wheel is setuptools' alone, and a first run compiles what it
launches, as it always did. A compile that fails never fails the install: it says so in one line."""

from __future__ import annotations

import ctypes
import os
import sys
import time

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 (the rest of the backend is setuptools')

KERNEL_BUILD_REQUIRES = ["numpy>=1.24", "cuda-pathfinder>=1.3", "nvidia-cuda-nvrtc>=13,<14"]
LOWEST_ARCH = 75   # lenet.kernels.nvrtc.LOWEST_ARCH: nothing of ours runs below it


def gpu_archs() -> list[int]:
    """The compute capabilities (75, 90, ...) of this machine's GPUs from the driver (libcuda through ctypes,
    CUDA_VISIBLE_DEVICES heeded); [] where there is no driver, no GPU, or a driver older than CUDA 13."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        count, version = ctypes.c_int(), ctypes.c_int()
        if (cuda.cuInit(0) != 0 or cuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < 13000
                or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0):
            return []
        archs = set()
        for ordinal in range(count.value):
            dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
            if (cuda.cuDeviceGet(ctypes.byref(dev), ordinal) == 0   # 75, 76: CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_*
                    and cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) == 0
                    and cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) == 0):
                archs.add(10 * major.value + minor.value)
        return sorted(a for a in archs if a >= LOWEST_ARCH)
    except (OSError, AttributeError):
        return []


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + (KERNEL_BUILD_REQUIRES if gpu_archs() else [])


def build_kernels(folder: str, archs: list[int] | None = None) -> int:
    """Every module compiled for each of ``archs`` (this machine's GPUs') into ``folder``; the files written.
    One line on stderr for what was done, or why not."""
    archs = gpu_archs() if archs is None else archs
    if not archs:
        return 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    written = 0
    try:
        from lenet import kernels

        for arch in archs:
            t0 = time.perf_counter()
            written += len(kernels.build_into(folder, arch))
            print(f"lenet: our kernels compiled for compute capability {arch // 10}.{arch % 10} "
                  f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    except Exception as e:   # noqa: BLE001 (the install goes on: a first run compiles them)
        print(f"lenet: our kernels were not compiled at install ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
              f"a first run compiles them", file=sys.stderr)
    finally:
        sys.path.remove(root)
    return written
