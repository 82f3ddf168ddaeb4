"""The code's own structure: imports go one way (no module of ours imports, at any depth, one
that imports it back), checked on the source, so a circle fails here before it bites at start-up
(Note [overlapped start-up] in lenet/startup.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("lenet", "descriptors"):
        for p in (ROOT / top).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports, at module level or inside a function."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    t = sub if sub in mods else target
                    if t in mods and t != m:
                        graph[m].add(t)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names if a.name in mods and a.name != m)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state, stack, found = {}, [], []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = "done"
    for u in sorted(graph):
        if u not in state:
            visit(u)
    return found


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_checker_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    graph = import_graph()
    assert "lenet.stages.check" in graph["lenet.stages.ours"] and "lenet.kernels" in graph["lenet.stages.ours"]
    assert "lenet.startup" in graph["lenet.cli"] and not graph["lenet.startup"] & {"lenet.train", "lenet.cli"}
