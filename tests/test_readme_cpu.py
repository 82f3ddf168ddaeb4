"""The README's commands and example, where they need no GPU."""

from __future__ import annotations

import ast

from test_readme_gpu import readme_example


def test_readme_example_is_python_that_uses_the_public_api():
    tree = ast.parse(readme_example())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {"LeNet", "export"} <= imported
