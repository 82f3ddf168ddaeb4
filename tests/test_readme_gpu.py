"""The README's Python example, run as written: it cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## From Python"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_example_runs(tmp_path, monkeypatch, torch_ref):
    from safetensors.torch import load_file
    from torch_lenet import TorchLeNet
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(readme_example(), "README.md", "exec"), scope)
    losses = scope["losses"]
    assert len(losses) == 20 and losses[-1] < 0.95 * losses[0], losses   # it learns the fixed batch
    assert len(set(losses)) == 20, f"a loss was read before its step finished: {losses}"
    assert 0 <= scope["correct"] <= 64 and scope["loss_sum"] > 0
    m = TorchLeNet()
    m.load_state_dict(load_file(tmp_path / "lenet.safetensors"))   # torch.nn LeNet loads the export
