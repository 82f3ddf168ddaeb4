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
    assert "kernels/*.cu" in cfg["package-data"]["lenet"]
    assert list((ROOT / "lenet" / "kernels").glob("*.cu"))


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
    assert scripts["lenet-train"] == "lenet.startup:train"
    assert scripts["lenet-train-step"] == "lenet.startup:train_step"
