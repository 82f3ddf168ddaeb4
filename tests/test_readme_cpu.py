"""The README's commands and example, where they need no GPU."""

from __future__ import annotations

import ast

from test_readme_gpu import readme_example


def test_readme_example_is_python_that_uses_the_public_api():
    tree = ast.parse(readme_example())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {"LeNet", "export"} <= imported


def test_readme_pytorch_example_is_ten_lines_on_lenet_torch():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("## From PyTorch"):], re.S).group(1)
    tree = ast.parse(code)
    assert len(code.strip().splitlines()) <= 10
    assert "lenet.torch" in {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
