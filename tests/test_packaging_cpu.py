"""What `pip install .` installs: every package of the source tree and the CUDA kernels."""

from __future__ import annotations

import tomllib

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_installed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("lenet", "descriptors")
             for p in (ROOT / top).rglob("__init__.py")}
    assert found == listed, f"packages on disk {sorted(found)} vs listed in pyproject.toml {sorted(listed)}"
    assert "*.cu" in cfg["package-data"]["lenet.kernels"]
    assert {p.name for p in (ROOT / "lenet" / "kernels").glob("*.cu")} >= {"stage_common.cu", "stage2_backward.cu", "head.cu", "softmax_ce.cu"}


def test_the_wheel_builds_without_warnings_and_holds_the_kernels(tmp_path):
    # A data folder that is not a declared package made setuptools print ~40 lines of warnings at
    # every install; the kernels' folder is now the package lenet.kernels.
    import shutil
    import subprocess
    import sys
    import zipfile

    src = tmp_path / "src"   # a copy: setuptools builds in the source tree (build/, *.egg-info)
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "data", "build", "dist", "*.egg-info",
                                                             "__pycache__", ".whl", "out", "runs", ".venv"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                          "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "absent from the `packages` configuration" not in out.stderr + out.stdout, out.stderr
    names = zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist()
    assert {"lenet/kernels/stage2_backward.cu", "lenet/kernels/head.cu", "lenet/engines/ours.py"} <= set(names), names


def test_gpu_extras_pin_the_graph_frontend():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("cu13", "cu12"):
        assert "nvidia-cudnn-frontend>=1.28,<1.29" in extras[name], name


def test_every_command_names_a_function_and_the_trainers_start_early():
    import importlib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for command, target in scripts.items():
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), command
    # the two programs with a start-up to keep short begin as python -m does (lenet/startup.py)
    assert scripts["lenet-train"] == "lenet.__main__:train"
    assert scripts["lenet-train-step"] == "lenet.__main__:train_step"


_NO_STACK = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cupy", "cupy_backends", "cuda", "nvmath", "cudnn", "nvidia"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Block())
"""


def test_without_the_gpu_stack_its_tests_skip_with_the_reason(tmp_path):
    # pip install '.[test]' alone (no GPU extra): tests that load libcudnn skip, saying why; CI, which
    # installs the stack, sets LENET_REQUIRE_STACK=1 so that the same tests fail instead of skipping.
    import os
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(_NO_STACK)   # the stack's packages, made unimportable
    env = {k: v for k, v in os.environ.items() if k not in ("LENET_REQUIRE_STACK", "LENET_REQUIRE_GPU")}
    env["PYTHONPATH"] = str(tmp_path)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_graph_cpu.py",
           f"--basetemp={tmp_path / 'pt'}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and " skipped" in out.stdout and "failed" not in out.stdout, out.stdout[-2000:]
    assert "needs the GPU stack installed" in out.stdout, out.stdout[-2000:]
    out = subprocess.run(cmd, env={**env, "LENET_REQUIRE_STACK": "1"}, capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode != 0 and "LENET_REQUIRE_STACK=1 but the GPU stack does not load" in out.stdout


def test_the_libraries_of_cuda_12_are_found_by_name_where_their_wheels_put_them():
    """Every library we open goes through cuda.pathfinder by name (cuDNN, NVRTC, cuBLASLt); with the cu12 extra
    those names resolve to CUDA 12's wheels: libnvrtc.so.12 in nvidia/cuda_nvrtc/lib, libcublasLt.so.12 in
    nvidia/cublas/lib, libcudnn.so.9 in nvidia/cudnn/lib (nvidia-cudnn-cu12), as with CUDA 13's."""
    pytest.importorskip("cuda.pathfinder")
    from cuda.pathfinder._dynamic_libs.descriptor_catalog import DESCRIPTOR_CATALOG

    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    names = set()
    for f in [*root.glob("lenet/**/*.py"), *root.glob("descriptors/*.py")]:
        names |= set(re.findall(r'load_nvidia_dynamic_lib\("(\w+)"\)', f.read_text()))
    from lenet.startup import LIBRARIES

    names |= set(LIBRARIES)
    assert names == {"cudnn", "nvrtc", "cublasLt"}, names
    by = {d.name: d for d in DESCRIPTOR_CATALOG}
    for name, soname, folder in (("nvrtc", "libnvrtc.so.12", "nvidia/cuda_nvrtc/lib"),
                                 ("cublasLt", "libcublasLt.so.12", "nvidia/cublas/lib"),
                                 ("cudnn", "libcudnn.so.9", "nvidia/cudnn/lib")):
        assert soname in by[name].linux_sonames and folder in by[name].site_packages_linux, name
