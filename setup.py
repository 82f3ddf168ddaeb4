"""setuptools' build with one step more: our kernels compiled into the wheel for this machine's GPU
(build_support/lenet_build.py; Note [kernels built with the package] in lenet/kernels/nvrtc.py). The
project's metadata is in pyproject.toml."""

import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "build_support"))
import lenet_build  # noqa: E402


class BuildPy(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:   # an editable install runs the sources: the cache serves it
            lenet_build.build_kernels(os.path.join(self.build_lib, "lenet", "kernels", "built"))


setup(cmdclass={"build_py": BuildPy})
