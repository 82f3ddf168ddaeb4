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


def test_the_readmes_two_commands_and_ci_runs_its_test_command():
    """The install + main job command and the install + tests command, as the README gives them; CI runs the
    README's test command as written."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    section = text[text.index("## The two commands"):text.index("\n## ", text.index("## The two commands") + 1)]
    main_job = 'pip install ".[cu13]" && python -m lenet.train_step'
    tests = 'pip install -e ".[cu13,test]" && python -B -m pytest'
    assert f"\n    {main_job}\n" in section and f"\n    {tests}\n" in section
    ci = (root / ".ci" / "run").read_text()
    assert f"python -m {tests.replace('pip install', 'pip install -q', 1)}" in ci


def test_the_readme_is_for_users_and_its_history_lives_in_docs():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    assert len(text.splitlines()) <= 450
    for heading in ("## Install", "## The two commands", "## The programs", "## From Python", "## From PyTorch",
                    "## Sweeps", "## Speed", "## Time to accuracy", "## How it works", "## Every GPU generation",
                    "## Layout"):
        assert f"\n{heading}\n" in text, heading
    for doc in ("performance", "numerics", "design", "probes"):
        assert f"docs/{doc}.md" in text and (root / "docs" / f"{doc}.md").is_file(), doc


def test_the_readmes_recipes_are_time_to_accuracys_and_lenet_train_takes_them():
    """The fast and recommended commands the README prints are scripts/time_to_accuracy.py's RECIPES (what the
    README's numbers were measured with), flag for flag, and every recipe parses as `lenet train` flags."""
    import re
    import shlex
    import sys
    from pathlib import Path

    from lenet import train

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "scripts"))
    try:
        import time_to_accuracy as tta
    finally:
        sys.path.remove(str(root / "scripts"))
    text = (root / "README.md").read_text()
    for name in ("fast", "recommended"):
        command = re.search(rf"# {name}:[^\n]*\n((?:    #[^\n]*\n)*)    (lenet train .*?)--out", text, re.S).group(2)
        shown = train.parser().parse_args(shlex.split(command.replace("\\\n", " "))[2:])
        assert vars(shown) == vars(train.parser().parse_args(shlex.split(tta.RECIPES[name]))), name
    for name, flags in tta.RECIPES.items():
        train.parser().parse_args(shlex.split(flags))
