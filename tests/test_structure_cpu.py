"""The code's own structure, checked on the source: imports go one way. No module of ours imports, at any
depth, one that imports it back, counting what Python runs on the way (importing ``a.b.c`` from outside
``a.b`` runs ``a/b/__init__.py`` first: an edge to the package, Note [overlapped start-up] in
lenet/startup.py says why a circle bites at start-up), and no module imports one of a higher floor
(FLOORS: cuDNN's layer, then lenet's basics, kernels, operations, engines, the planner, the model, the
programs)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first; a module's floor is its longest matching prefix's. Within a floor any direction, no circle.
FLOORS = [
    ("descriptors",),
    ("lenet", "lenet.params", "lenet.files", "lenet.timing", "lenet.blas", "lenet.background", "lenet.schedule",
     "lenet.runner", "lenet.data", "lenet.checkpoint", "lenet.plancache", "lenet.cli"),
    ("lenet.kernels",),
    ("lenet.ops",),
    ("lenet.engines",),
    ("lenet.plan", "lenet.step_check"),
    ("lenet.model", "lenet.network", "lenet.checks", "lenet.slots", "lenet.weights", "lenet.inputs", "lenet.steps",
     "lenet.evaluation"),
    ("lenet.pack",),
    ("lenet.startup", "lenet.plot", "lenet.train", "lenet.train_step", "lenet.export", "lenet.predict",
     "lenet.torch", "lenet.__main__", "lenet.sweep", "lenet.study", "lenet.sweep_results", "lenet.workers"),
]


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("lenet", "descriptors"):
        for p in (ROOT / top).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _packages_run(importer: str, target: str, mods) -> set[str]:
    """The packages whose __init__ importing ``target`` runs, seen from ``importer``: each ancestor package
    of target that does not also hold the importer (its own packages are running already)."""
    parts = target.split(".")
    out = set()
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg in mods and not (importer == pkg or importer.startswith(pkg + ".")):
            out.add(pkg)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports, at module level or inside a function, and the packages
    whose __init__ those imports run."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    targets.add(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        for t in targets:
            if t in mods and t != m:
                graph[m].add(t)
                graph[m].update(p for p in _packages_run(m, t, mods) if p != m)
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


def floor(module: str) -> int:
    best = None
    for i, prefixes in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{module} is on no floor: add it to FLOORS"
    return best[0]


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) where the imported module lives on a higher floor."""
    return sorted((m, t) for m, ts in graph.items() for t in ts if floor(t) > floor(m))


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_import_from_a_lower_floor_to_a_higher_one():
    found = upward(import_graph())
    assert not found, "imports that go up a floor: " + "; ".join(f"{a} -> {b}" for a, b in found)


def test_the_checker_sees_a_circle_a_package_edge_and_a_floor():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    graph = import_graph()
    assert "lenet.engines.reference" in graph["lenet.engines.ours_check"] and "lenet.kernels" in graph["lenet.engines.ours"]
    assert "lenet.cli" in graph["lenet.startup"] and not graph["lenet.cli"] & {"lenet.startup", "lenet.engines"}
    # Importing a submodule from outside its package runs the package's __init__: an edge to it.
    assert "lenet.engines" in graph["lenet.plan"] and "lenet.kernels" in graph["lenet.engines.ours"]
    mods = {"p": 1, "p.a": 1, "p.b": 1, "q": 1}
    assert _packages_run("q", "p.a", mods) == {"p"} and _packages_run("p.b", "p.a", mods) == set()
    # The circle the package edge exposes: p/__init__ imports p.a, which imports q, which imports p.b.
    assert cycles({"p": {"p.a"}, "p.a": {"q"}, "q": {"p.b", "p"}, "p.b": set()})
    assert upward({"descriptors.graph": {"lenet.plan"}, "lenet.plan": {"descriptors"}}) == [
        ("descriptors.graph", "lenet.plan")]


def test_engines_are_named_in_the_registry_and_their_own_files_only():
    """No module outside lenet/engines/ compares an engine's name: every answer comes from the registry."""
    import re

    pattern = re.compile(r"""(==|!=|\bin)\s*\(?\s*["'](ours|legacy|graph|cudnn|cublaslt)["']""")
    found = []
    for module, path in _modules().items():
        if module.startswith("lenet.engines") or not module.startswith("lenet"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "engine names compared outside the engines: " + "; ".join(found)


ENGINE_NAMES = ("ours", "legacy", "graph", "cudnn", "cublaslt")


def test_no_engine_names_another():
    """An engine's file names no other engine (what runs beside what is the registry's: runs_beside, runs),
    and descriptors/ names no engine: its candidates take their names from the caller."""
    import re

    from lenet.engines import ENGINES

    module = {type(e).__module__.rsplit(".", 1)[1]: e.name for e in ENGINES}   # its file, and ours_*.py its parts
    files = [(module.get(p.stem.split("_")[0]), p) for p in (ROOT / "lenet" / "engines").glob("*.py")
             if p.stem not in ("registry", "__init__")]
    found = []
    for name, path in [*files, (None, ROOT / "descriptors" / "candidates.py")]:
        others = [n for n in ENGINE_NAMES if n != name]
        pattern = re.compile(r"""["'](%s)["']""" % "|".join(others))
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "engines named outside their own file and the registry: " + "; ".join(found)


def test_an_engine_added_to_the_registry_alone_is_offered_everywhere(monkeypatch):
    """A toy engine, defined here and registered (the registry's lists patched, no other file touched): the
    programs' --engine takes its flag, a Policy names it, the planner offers its candidates (and, under its
    flag, only its), and the other engines refuse under its flag by the registry's rule."""
    import types

    from descriptors.algorithms import AlgorithmNotSupportedError
    from lenet import cli, engines
    from lenet.engines import Policy, registry
    from lenet.engines.base import Engine, Named
    from lenet.ops import Stage, StageSpec
    from lenet.plan import Planner

    class Toy(Engine):
        name, flag, runs, kinds = "toy", "toy", "the toy only", ("stage", "head")

        def candidates(self, op, n, planner):
            return [Named(self.name, "toy way")]

        def bind(self, op, n, candidate, planner):
            raise AlgorithmNotSupportedError("a toy binds nothing")

    toy = Toy()
    ENGINES = (*registry.ENGINES, toy)
    for module in (registry, engines):   # the registry, and the package's names for it
        monkeypatch.setattr(module, "ENGINES", ENGINES)
        monkeypatch.setattr(module, "BY_NAME", {e.name: e for e in ENGINES})
        monkeypatch.setattr(module, "FLAGS", (*registry.FLAGS, "toy"))

    from lenet import train_step

    args = train_step.parser().parse_args(["--engine", "toy"])   # the program's own flags take it
    assert args.engine == "toy"
    policy = cli.policy_from(args, engines.Policy)
    assert policy == Policy(engine="toy")

    stage = Stage(StageSpec("conv1", (1, 28, 28), (6, 1, 5, 5)), None, 8)
    served, why = registry.serving(stage, policy)
    assert served == [toy] and why["ours"] == "engine toy runs the toy only" and "cudnn" in why
    assert toy in registry.serving(stage, Policy())[0]   # under auto it competes

    planner = Planner.__new__(Planner)   # what the loop needs of a planner, without a GPU
    planner.policy, planner.store, planner.decisions = policy, None, {}
    planner.ctx = types.SimpleNamespace(device_id=0, captured=True)
    with pytest.raises(AlgorithmNotSupportedError, match="toy:toy way failed: a toy binds nothing"):
        planner.plan(stage, 8)


def test_a_policy_loads_no_library():
    """Constructing a Policy, even one naming the graph API's engine, loads no cuDNN: it is a value."""
    import os
    import subprocess
    import sys

    code = ("from lenet.engines import Policy\n"
            "Policy(engine='graph'); Policy.parse('exhaustive', engine='legacy')\n"
            "maps = open('/proc/self/maps').read()\n"
            "print('libcudnn' in maps, 'cudnn' in __import__('sys').modules)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"], out.stdout
