"""The package's build backend: setuptools', and our kernels compiled into the wheel for the GPU of the machine
that builds it (Note [kernels built with the package] in lenet/kernels/nvrtc.py).

Where that machine has an NVIDIA GPU whose driver runs CUDA 13, the build also asks for what lenet.kernels
compiles with (NumPy, cuda-pathfinder, NVRTC 13), and setup.py's build step compiles every module for the
GPU's architecture into lenet/kernels/built/, as `pip install` compiles the package's bytecode. Elsewhere (no
GPU, an older driver, an editable install) the wheel is setuptools' alone, and a first run compiles what it
launches, as it always did. A compile that fails never fails the install: it says so in one line."""

from __future__ import annotations

import contextlib
import os
import sys
import time

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 (the rest of the backend is setuptools')

KERNEL_BUILD_REQUIRES = ["numpy>=1.24", "cuda-pathfinder>=1.3", "nvidia-cuda-nvrtc>=13,<14"]
LOWEST_ARCH = 75   # lenet.kernels.nvrtc.LOWEST_ARCH (lenet.kernels imports NumPy, which this step may lack)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def _ours():
    """The package's sources importable (the build runs beside them, not installed)."""
    sys.path.insert(0, ROOT)
    try:
        yield
    finally:
        sys.path.remove(ROOT)


def gpu_archs() -> list[int]:
    """The compute capabilities of this machine's GPUs our kernels run on, where the driver runs CUDA 13; []
    elsewhere (lenet.gpus: the standard library alone)."""
    with _ours():
        from lenet.gpus import gpu_archs

        return [a for a in gpu_archs(driver_at_least=13000) if a >= LOWEST_ARCH]


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + (KERNEL_BUILD_REQUIRES if gpu_archs() else [])


def build_kernels(folder: str, archs: list[int] | None = None) -> int:
    """Every module compiled for each of ``archs`` (this machine's GPUs') into ``folder``; the files written.
    One line on stderr for what was done, or why not."""
    archs = gpu_archs() if archs is None else archs
    if not archs:
        return 0
    written = 0
    with _ours():
        try:
            from lenet import kernels

            for arch in archs:
                t0 = time.perf_counter()
                written += len(kernels.build_into(folder, arch))
                print(f"lenet: our kernels compiled for compute capability {arch // 10}.{arch % 10} "
                      f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
        except Exception as e:   # noqa: BLE001 (the install goes on: a first run compiles them)
            print(f"lenet: our kernels were not compiled at install ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200]}); a first run compiles them", file=sys.stderr)
    return written
