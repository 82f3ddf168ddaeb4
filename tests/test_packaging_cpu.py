"""What `pip install .` installs: every package of the source tree and the CUDA kernels."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_installed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("lenet", "descriptors")
             for p in (ROOT / top).rglob("__init__.py")}
    assert found == listed, f"packages on disk {sorted(found)} vs listed in pyproject.toml {sorted(listed)}"
    assert "*.cu" in cfg["package-data"]["lenet.kernels"]
    assert {p.name for p in (ROOT / "lenet" / "kernels").glob("*.cu")} >= {"stage.cu", "head.cu", "softmax_ce.cu"}


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
    assert {"lenet/kernels/stage.cu", "lenet/kernels/head.cu", "lenet/stages/ours.py"} <= set(names), names


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
