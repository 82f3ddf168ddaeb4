"""The programs' start-up threads (lenet/startup.py): each runs its whole sequence on a GPU, and
without one nothing fails before the program's own one-line error. Each case runs in a fresh
process: the threads start once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Starts the threads as python -m lenet.train does, lets them finish, prints what they marked.
_SEQUENCE = """
import json, sys
from lenet import startup
startup.start_gpu()
policy = None
if len(sys.argv) > 2:   # the flags' policy, as python -m lenet.train hands it once parsed
    from lenet.engines import Policy
    policy = Policy.parse(sys.argv[2])
with startup.starting(sys.argv[1], policy=policy):
    pass
print(json.dumps([label for label, _ in startup.MARKS]))
"""


def _run(code: str, *args: str, hide_gpu: bool = False, **extra) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.stack
def test_warm_cudnn_without_a_gpu_says_false():
    out = _run("from descriptors import _lib\nfrom lenet.startup import warm_cudnn\n"
               "print(warm_cudnn(_lib.library_path()))", hide_gpu=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.stack
def test_threads_without_a_gpu_end_quietly():
    out = _run(_SEQUENCE, "auto", hide_gpu=True)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    marks = json.loads(out.stdout)
    assert "preload thread: CuPy, cuBLAS bindings imported" in marks
    assert not any("context" in m or "cuDNN" in m for m in marks), marks


@pytest.mark.gpu
def test_warm_cudnn_runs_its_query():
    out = _run("from descriptors import _lib\nfrom lenet.startup import start_context, warm_cudnn\n"
               "print(start_context(), warm_cudnn(_lib.library_path()))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


def _plans(tmp_path, *engines) -> str:
    """A plan cache file whose entries name these engines (none: no file)."""
    from lenet.plancache import FORMAT

    path = tmp_path / "plans.json"
    if engines:
        path.write_text(json.dumps({"format": FORMAT, "entries": {f"k{i}": {"engine": e} for i, e in enumerate(engines)}}))
    return str(path)


def test_the_plan_caches_engines_are_read_without_a_handle(tmp_path):
    """What the preload asks before its first graph (Note [a first graph only where one runs] in
    lenet/startup.py): the engines stored choices name; None where the file is absent, unreadable,
    another version's, or empty."""
    from lenet.plancache import stored_engines

    assert stored_engines(_plans(tmp_path)) is None
    assert stored_engines(_plans(tmp_path, "ours", "ours", "cublaslt")) == {"ours", "cublaslt"}
    bad = tmp_path / "bad.json"
    for text in ("{not json", json.dumps({"format": -1, "entries": {"k": {"engine": "ours"}}}),
                 json.dumps({"format": 2, "entries": {}}), "\xff\xfe"):
        bad.write_text(text)
        assert stored_engines(bad) is None, text


@pytest.mark.parametrize("stored,spec,arch,graph", [
    (None, "heuristic", 90, False), (None, "exhaustive", 90, True), (None, None, 90, True), (None, "heuristic", 80, True),
    (None, "heuristic", None, True), ({"ours", "cublaslt"}, "exhaustive", 90, False), ({"ours", "cudnn"}, "heuristic", 90, True),
])
def test_the_first_graph_is_built_where_a_search_may_run_cudnn(monkeypatch, stored, spec, arch, graph):
    """Note [a first graph only where one runs] in lenet/startup.py, without a GPU: the stored choices decide where
    there are some; with none, the flags' policy on the GPU's generation (none known: built)."""
    from lenet import plancache, startup
    from lenet.engines import Policy

    monkeypatch.setattr(plancache, "stored_engines", lambda: stored)
    monkeypatch.setattr(startup, "_gpu0", None if arch is None else (arch, 132))
    monkeypatch.delenv("LENET_KERNEL_ARCH", raising=False)
    assert startup._cudnn_stored(None if spec is None else Policy.parse(spec)) == graph


@pytest.mark.gpu
@pytest.mark.parametrize("engine,stored,spec,graph", [
    ("auto", (), None, True), ("auto", ("ours", "cudnn"), None, True), ("auto", ("ours", "cublaslt"), None, False),
    ("legacy", (), None, False), ("auto", (), "exhaustive", True), ("auto", ("ours", "cudnn"), "heuristic", True),
    ("auto", (), "heuristic", "the rule")])
def test_threads_run_every_phase_on_a_gpu(tmp_path, engine, stored, spec, graph):
    """Every phase of the two threads; the first cuDNN graph under an engine that may build graphs, unless
    the plan cache's choices name no cuDNN stage, or with none stored, unless the flags' policy lets the
    heuristic take our stages untimed on this GPU (Note [a first graph only where one runs]; on an H100 or
    H200, no graph: Note [the heuristic's engine])."""
    if graph == "the rule":
        from lenet.engines import Policy, registry
        from lenet.kernels import arch

        graph = registry.heuristic_runs_cudnn_stage(engine, Policy.parse(spec), arch())
    out = _run(_SEQUENCE, engine, *([spec] if spec else []), LENET_PLAN_CACHE=_plans(tmp_path, *stored))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    marks = json.loads(out.stdout)
    for m in ("driver thread: cuInit + primary context done", "driver thread: cuDNN's one-time set-up done",
              "preload thread: CUDA runtime started", "preload thread: descriptors, lenet.model imported"):
        assert m in marks, (m, marks)
    assert ("preload thread: first cuDNN graph built" in marks) == graph, marks
    assert ("preload thread: no first cuDNN graph (no choice stored or searched runs cuDNN)" in marks) == (
        engine == "auto" and not graph), marks
    assert ("preload thread: frontend imported" in marks) == (engine == "auto" and graph), marks   # legacy: none


# Imports a module of its own after keep_bytecode(); prints the folder and the cached files.
_BYTECODE = """
import json, os, sys
asked, sys.dont_write_bytecode = sys.dont_write_bytecode, True   # lenet's own modules: none written in the checkout
from lenet.startup import keep_bytecode
sys.dont_write_bytecode = asked
folder = keep_bytecode()
sys.path.insert(0, sys.argv[1])
import probe_module
found = [os.path.join(d, f) for d, _, fs in os.walk(folder or os.devnull) for f in fs] if folder else []
print(json.dumps({"folder": folder, "found": found, "write": not sys.dont_write_bytecode}))
"""


def _bytecode_run(tmp_path, **env):
    src = tmp_path / "src"
    src.mkdir()
    (src / "probe_module.py").write_text("X = 1\n")
    full = dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    for k in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX", "LENET_BYTECODE_CACHE"):
        full.pop(k, None)
    full.update(env)
    out = subprocess.run([sys.executable, "-c", _BYTECODE, str(src)], env=full, capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), src


def test_bytecode_kept_in_our_folder_when_python_writes_none(tmp_path):
    got, src = _bytecode_run(tmp_path, PYTHONDONTWRITEBYTECODE="1")
    assert got["folder"] == str(tmp_path / "xdg" / "lenet" / "bytecode") and got["write"]
    assert any(f.endswith(".pyc") and "probe_module" in f for f in got["found"]), got
    assert not (src / "__pycache__").exists()   # never beside the sources


def test_bytecode_folder_from_the_environment(tmp_path):
    got, _ = _bytecode_run(tmp_path, PYTHONDONTWRITEBYTECODE="1", LENET_BYTECODE_CACHE=str(tmp_path / "bc"))
    assert got["folder"] == str(tmp_path / "bc")
    assert any("probe_module" in f for f in got["found"]), got


def test_a_programs_own_module_read_as_bytecode_from_its_first_line(tmp_path, dataset):
    """Note [bytecode from the first line] in lenet/_early.py: once a run made the bytecode folder, the
    next python -m lenet.train finds it from lenet/__init__ on, so runpy reads lenet/train.py's bytecode
    there. Note [nothing written before the checks] in lenet/files.py: a run whose flags are refused makes no
    folder; the first run whose checks pass makes it, with the bytecode of the modules imported before then
    (lenet/train.py, lenet/interrupt.py ...)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "LENET_BYTECODE_CACHE")}
    env.update(PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path / "xdg"), PYTHONDONTWRITEBYTECODE="1")
    folder = tmp_path / "xdg" / "lenet" / "bytecode"

    def cached(stem):
        return sorted(p.name for p in folder.rglob(f"{stem}.*.pyc") if p.parent.name == "lenet")

    for args, made in ((["--lr", "bogus"], False), (["--quiet", "--data-dir", str(dataset), "--epochs", "1"], True)):
        out = subprocess.run([sys.executable, "-m", "lenet.train", *args], env=env, capture_output=True,
                             text=True, timeout=120, cwd=tmp_path)
        assert "Traceback" not in out.stderr, out.stderr
        assert folder.is_dir() == made and bool(cached("train")) == made and bool(cached("interrupt")) == made, (
            args, sorted(str(p.relative_to(folder)) for p in folder.rglob("*.pyc"))[:20])


_LIBRARIES = """
import json, sys
from lenet import files, startup
record = startup.open_recorded_libraries()
mapped = [line.split()[-1] for line in open("/proc/self/maps") if "libcublasLt" in line]
if sys.argv[1] == "record":
    import cupy
    from lenet import blas
    blas.binding("cublasLt")
    startup.record_libraries(record)
    files.wait_for_writes()
print(json.dumps({"record": bool(record), "opened": sorted(set(mapped)), "marks": [m for m, _ in startup.MARKS]}))
"""


def test_cublaslt_opened_from_an_earlier_runs_record(tmp_path):
    """Note [opening cuBLASLt without the GIL] in lenet/startup.py: a run records where cuda.pathfinder found
    libcublasLt; the next, in the same environment, opens that file before CuPy's import; a record from
    another environment, or of a file that changed since, opens nothing."""
    pytest.importorskip("cupy")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
               XDG_CACHE_HOME=str(tmp_path / "xdg"), CUDA_HOME="")

    def run(mode, **more):
        out = subprocess.run([sys.executable, "-c", _LIBRARIES, mode], env={**env, **more}, capture_output=True,
                             text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[-1])

    first = run("record")
    assert not first["record"] and first["opened"] == [], first   # nothing recorded yet, nothing opened early
    saved = json.loads((tmp_path / "xdg" / "lenet" / "libraries.json").read_text())
    assert "libcublasLt.so." in saved["cublasLt"][0], saved
    second = run("look")
    assert second["record"] and second["opened"] == [os.path.realpath(saved["cublasLt"][0])], (second, saved)
    assert "preload thread: libcublasLt opened" in second["marks"]
    other = run("look", CUDA_HOME="/elsewhere")   # another environment: the record does not apply
    assert not other["record"] and other["opened"] == [], other
    saved["cublasLt"][1] += 1   # the file is not the one recorded
    (tmp_path / "xdg" / "lenet" / "libraries.json").write_text(json.dumps(saved))
    changed = run("look")
    assert changed["record"] and changed["opened"] == [], changed


@pytest.mark.parametrize("env", [
    {"PYTHONDONTWRITEBYTECODE": "1", "LENET_BYTECODE_CACHE": "off"},   # switched off
    {},                                                                # Python writes beside the sources
    {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "PLACEHOLDER"},   # Python's own folder
])
def test_bytecode_left_to_python(tmp_path, env):
    env = {k: (str(tmp_path / "theirs") if v == "PLACEHOLDER" else v) for k, v in env.items()}
    got, _ = _bytecode_run(tmp_path, **env)
    assert got["folder"] is None
    assert not (tmp_path / "xdg").exists()


# What the flag parse may import while the start-up thread imports CuPy and its stack (Note
# [overlapped start-up]): descriptors and our light modules (the engines' registry and the operations, which
# that thread imports only once the parse is done), never a module that thread imports before it.
_PARSE = """
import sys
before = set(sys.modules)   # what the interpreter's own start-up imported (site hooks of installed packages)
import lenet.train, lenet.train_step
lenet.train.parser(); lenet.train_step.parser()
print(" ".join(sorted(m for m in set(sys.modules) - before
                      if m.split(".")[0] in ("cupy", "nvmath", "cuda", "importlib")
                      or m.startswith(("lenet.blas", "lenet.model", "lenet.plan")))))
"""


def test_the_flag_parse_imports_nothing_the_start_up_thread_imports():
    out = _run(_PARSE, hide_gpu=True)
    assert out.returncode == 0, out.stderr
    shared = set(out.stdout.split()) - {"importlib", "importlib._abc", "importlib._bootstrap",
                                         "importlib._bootstrap_external", "importlib.machinery", "importlib.util"}
    assert not shared, f"the parse imports {sorted(shared)}, which the start-up thread may be importing"


def test_a_program_started_many_times_never_meets_the_import_lock():
    # The race showed as "_DeadlockError: deadlock detected by _ModuleLock('importlib.resources.abc')"
    # in one start of a few dozen when the parse imported importlib.resources.
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for _ in range(12):
        out = subprocess.run([sys.executable, "-m", "lenet.train_step", "--steps", "0"], env=env,
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Deadlock" not in out.stderr, out.stderr


def _cache_kernels(folder: Path) -> dict:
    """{file in a kernel cache: the kernel names its binary holds (its ELF's .text.NAME sections)}."""
    import re

    return {f.name: set(n.decode() for n in re.findall(rb"\.text\.([\w$.]+?)\0", f.read_bytes()))
            for f in folder.rglob("*") if f.is_file()}


@pytest.mark.gpu
def test_a_first_run_fills_the_caches_and_a_later_run_compiles_nothing(tmp_path):
    """python -m lenet.train_step with every cache empty (a fresh machine: Note [first run] in
    lenet/kernels/nvrtc.py) completes and leaves our kernel cache holding one binary per module it
    launches and CuPy's kernel cache empty (no generic CuPy kernel on the way to the step), and our
    plans and bytecode under $XDG_CACHE_HOME/lenet; a second run finds everything and compiles nothing."""
    from lenet.kernels import nvrtc, step
    from lenet.kernels import stages as ours_stage

    cupy_cache, xdg = tmp_path / "cupy", tmp_path / "xdg"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LENET_") and k != "PYTHONPYCACHEPREFIX"}
    env.update(CUPY_CACHE_DIR=str(cupy_cache), XDG_CACHE_HOME=str(xdg), PYTHONDONTWRITEBYTECODE="1",
               CUDA_CACHE_PATH=str(tmp_path / "nv"),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ours_cache = xdg / "lenet" / "kernels"

    def train_step():
        out = subprocess.run([sys.executable, "-m", "lenet.train_step", "--batch-size", "64"], env=env,
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        return _cache_kernels(ours_cache), {f: f.stat().st_mtime_ns for f in ours_cache.iterdir()}

    first, written = train_step()
    assert not _cache_kernels(cupy_cache), f"CuPy compiled kernels on the way to the step: {_cache_kernels(cupy_cache)}"
    # The heuristic's stage kernels (the split backward versions compile when a search times them),
    # every module the programs may launch, the search's distance among them, and on sm_90 and newer the
    # whole step's forms offered at 64 images (Ours.warm starts them; the planner times them), by the GPU's own
    # compute capability (the child has no LENET_ variable).
    ours = {"head": "head_forward_kernel", "head_split": "head_split_out_kernel",
            "head_weights": "head_weights_kernel", "softmax_ce": "softmax_ce_kernel",
            "sgd": "sgd_kernel", "data": "gather_batch_kernel", "distance": "distance_kernel",
            **{m: f"{m}_kernel" for m in ours_stage.heuristic_modules([64])},
            **{f.module: "step_cluster_kernel" for f in step.forms(64) if nvrtc.device_arch() >= step.ARCH}}
    for module, kernel in ours.items():   # files named <package>.<module>.<arch>.<digest>.cubin
        files = [f for f in first if f.split(".")[1] == module]
        assert len(files) == 1 and kernel in first[files[0]], (module, sorted(first))
    assert len(first) == len(ours), sorted(first)
    assert (xdg / "lenet" / "plans.json").is_file() and any((xdg / "lenet" / "bytecode").rglob("*.pyc"))
    assert train_step() == (first, written), "a later run compiled again"


# A program's start (startup.begin, as python -m lenet.train runs it; --help returns before the GPU's
# threads), then NumPy's import: what OpenBLAS was told and how many threads the import started.
_BLAS = """
import json, os, sys
sys.argv = ["lenet-train", "--help"]
from lenet import startup
startup.begin()
before = len(os.listdir("/proc/self/task"))
import numpy
print(json.dumps([os.environ.get("OPENBLAS_NUM_THREADS"), len(os.listdir("/proc/self/task")) - before]))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
@pytest.mark.parametrize("user", [None, ("OPENBLAS_NUM_THREADS", "2"), ("OMP_NUM_THREADS", "2")])
def test_a_program_asks_openblas_for_one_thread_unless_the_user_chose(user):
    # Note [one BLAS thread] in lenet/startup.py: NumPy's OpenBLAS starts a thread a CPU at import.
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                                                             "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    if user:
        env[user[0]] = user[1]
    out = subprocess.run([sys.executable, "-c", _BLAS], env=env, capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    told, started = json.loads(out.stdout.strip().splitlines()[-1])
    if user is None:
        assert (told, started) == ("1", 0)
    else:   # left as the user set it
        assert told == (user[1] if user[0] == "OPENBLAS_NUM_THREADS" else None)
    if user and user[0] == "OMP_NUM_THREADS":   # what the count sees where OpenBLAS may take two CPUs
        assert started == (1 if len(os.sched_getaffinity(0)) >= 2 else 0)   # OpenBLAS counts the CPUs it may use


# A module built (its file in the kernel cache), then its file replaced by another version's before a kernel
# of it loads: what a run of another checkout does beside this one (Note [a version removed under us]).
_REPLACED = """
import sys
from pathlib import Path
import cupy, numpy as np
from lenet import kernels
kernels._module("distance")   # built: compiled, the file written; not yet loaded onto the GPU
cache = Path(sys.argv[1])
(built,) = cache.glob("lenet.distance.*")
built.unlink()   # another version's store removed this one's file
a = cupy.arange(1, 6, dtype=cupy.float32)
print(kernels.distance(a, a), kernels.distance(a * 2, a), len(list(cache.glob("lenet.distance.*"))))
"""


@pytest.mark.gpu
def test_a_module_whose_cached_file_went_is_built_again(tmp_path):
    out = _run(_REPLACED, str(tmp_path), LENET_KERNEL_CACHE=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    same, double, files = out.stdout.split()
    assert float(same) == 0.0 and float(double) == pytest.approx(1.0) and int(files) == 1


def test_a_first_runs_bytecode_is_compiled_in_a_child_and_no_lazy_module_is_imported(tmp_path, monkeypatch):
    """Note [bytecode in a child]: the list of modules without bytecode skips a lazy module unread (reading
    one's __spec__ imports it: CuPy's cupy.testing pulled pytest, Optuna and SciPy into a first run), and a
    child interpreter writes the listed modules' bytecode, atomically, into the cache folder."""
    import importlib.util

    from lenet import startup

    src, folder = tmp_path / "src", tmp_path / "bytecode"
    src.mkdir()
    (src / "plain_probe.py").write_text("X = 1\n")
    (src / "lazy_probe.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", str(folder))
    import plain_probe  # noqa: F401

    spec = importlib.util.find_spec("lazy_probe")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    lazy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lazy)   # a proxy: its code runs at its first attribute
    monkeypatch.setitem(sys.modules, "lazy_probe", lazy)
    try:
        jobs = startup._missing_bytecode(str(folder))
        assert not (tmp_path / "imported").exists(), "listing the modules imported a lazy one"
        plain = importlib.util.cache_from_source(str(src / "plain_probe.py"))
        assert f"{src / 'plain_probe.py'}\0{plain}" in jobs and not any("lazy_probe" in j for j in jobs)
        monkeypatch.setattr(startup, "_missing_bytecode", lambda f: [j for j in jobs if "plain_probe" in j])
        startup._bytecode_of_imported(str(folder))
        with open(plain, "rb") as f:
            assert f.read(4) == importlib.util.MAGIC_NUMBER
        assert [p.name for p in Path(plain).parent.iterdir()] == [Path(plain).name]   # no temporary file left
        assert not (tmp_path / "imported").exists()
    finally:
        sys.modules.pop("plain_probe", None)



def test_the_bytecode_child_copies_valid_bytecode_beside_a_source_and_compiles_a_stale_one(tmp_path, monkeypatch):
    """Note [bytecode beside the source]: a module whose bytecode lies valid beside its source (as pip leaves a
    package) has that file copied into the cache folder, not compiled again; one whose file there is stale (its
    source changed since) is compiled from the source. A checked hash-based file is copied where it holds its
    source's hash; an unchecked one is compiled (in our folder the import would take it however its source
    changed, then or later)."""
    import importlib.util
    import marshal
    import py_compile

    from lenet import startup

    src, folder = tmp_path / "src", tmp_path / "bytecode"
    src.mkdir()
    jobs = []
    for name in ("kept_probe", "stale_probe"):
        path = src / f"{name}.py"
        path.write_text("X = 2\n")
        beside = src / "__pycache__" / f"{name}.{sys.implementation.cache_tag}.pyc"
        py_compile.compile(str(path), cfile=str(beside), doraise=True)
        st = path.stat()
        path.write_text("X = 1\n")   # the same size
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + (0 if name == "kept_probe" else 10**9)))
        jobs.append(f"{path}\0{folder / name}.pyc")
    monkeypatch.setattr(startup, "_missing_bytecode", lambda f: jobs)
    startup._bytecode_of_imported(str(folder))
    got = {}
    for name in ("kept_probe", "stale_probe"):
        data = (folder / f"{name}.pyc").read_bytes()
        assert data[:4] == importlib.util.MAGIC_NUMBER
        ns = {}
        exec(marshal.loads(data[16:]), ns)
        got[name] = ns["X"]
    assert got == {"kept_probe": 2, "stale_probe": 1}, got   # 2: the file beside, copied; 1: compiled from the source
    hashed = []
    for name, mode in (("unchecked_hash", "UNCHECKED_HASH"), ("stale_hash", "CHECKED_HASH"), ("checked_hash", "CHECKED_HASH")):
        path = src / f"{name}.py"
        path.write_text("X = 2\n")
        beside = src / "__pycache__" / f"{name}.{sys.implementation.cache_tag}.pyc"
        py_compile.compile(str(path), cfile=str(beside), doraise=True,
                           invalidation_mode=getattr(py_compile.PycInvalidationMode, mode))
        if name == "stale_hash":
            path.write_text("X = 3\n")
        hashed.append(f"{path}\0{folder / name}.pyc")
    monkeypatch.setattr(startup, "_missing_bytecode", lambda f: hashed)
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)   # py_compile's own default: timestamps
    startup._bytecode_of_imported(str(folder))
    flags = {name: int.from_bytes((folder / f"{name}.pyc").read_bytes()[4:8], "little")
             for name in ("unchecked_hash", "stale_hash", "checked_hash")}
    assert flags == {"unchecked_hash": 0, "stale_hash": 0, "checked_hash": 3}, flags   # 0: compiled from the source
    assert sorted(p.name for p in folder.iterdir()) == ["checked_hash.pyc", "kept_probe.pyc", "stale_hash.pyc",
                                                        "stale_probe.pyc", "unchecked_hash.pyc"]   # no partial file left


def test_the_bytecode_child_compiles_at_the_programs_optimization_level(tmp_path):
    """Under python -O the cache holds .opt-1.pyc files: the child writes them optimized (asserts gone), as
    the program's own import would have."""
    src, folder = tmp_path / "src", tmp_path / "bytecode"
    src.mkdir()
    (src / "asserting_probe.py").write_text("def f():\n    assert False\n    return 1\n")
    code = ("import importlib.util, marshal, sys\n"
            "sys.dont_write_bytecode, sys.pycache_prefix = True, sys.argv[2]\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "from lenet import startup\n"
            "import asserting_probe\n"
            "real = startup._missing_bytecode\n"
            "startup._missing_bytecode = lambda folder: [j for j in real(folder) if 'asserting_probe' in j]\n"
            "startup._bytecode_of_imported(sys.argv[2])\n"
            "cached = importlib.util.cache_from_source(asserting_probe.__file__)\n"
            "ns = {}\n"
            "exec(marshal.loads(open(cached, 'rb').read()[16:]), ns)\n"
            "print(cached.endswith('.opt-1.pyc'), ns['f']())\n")
    out = subprocess.run([sys.executable, "-O", "-c", code, str(src), str(folder)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0 and out.stdout.split() == ["True", "1"], (out.stdout, out.stderr[-2000:])


def test_the_bytecode_switch_waits_for_the_preloads_imports(monkeypatch, tmp_path):
    """Note [no import in flight at the switch]: a first run turns Python's bytecode writing on (into its cache
    folder) only while the preload thread is not importing. Asked for while it imports, the switch returns at
    once and the preload thread makes it as it lets go of the lock; it lets go while it waits for the engine.
    The bytecode of what was imported before then is compiled at once (a first run's child no longer waits for
    a model planned on the preload thread), and what was imported in between at the switch."""
    import threading

    from lenet import files, startup

    compiled = []
    monkeypatch.setattr(startup, "_bytecode_of_imported", compiled.append)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    folder = str(tmp_path / "bytecode")
    pre, got = startup._Preload(), []
    importing, waiting = threading.Event(), threading.Event()

    def preload(engine, driver=None, policy=None):   # the preload's shape: imports, the engine's wait, imports
        importing.set()
        assert waiting.wait(10)
        got.append(engine())

    monkeypatch.setattr(startup, "preload", preload)
    monkeypatch.setattr(startup, "start_gpu_driver", lambda: None)
    pre.thread.start()
    try:
        assert importing.wait(10)
        switch = threading.Thread(target=startup._write_bytecode, args=(folder,))
        switch.start()
        switch.join(10)
        assert not switch.is_alive(), "the switch waited for the preload's imports"
        assert sys.pycache_prefix is None and sys.dont_write_bytecode, "switched while the preload imported"
        files.wait_for_writes()
        assert compiled == [folder], "the modules imported so far waited for the switch"
        waiting.set()   # the preload now waits for the engine: it let go, and made the switch
        for _ in range(1000):
            if sys.pycache_prefix == folder:
                break
            threading.Event().wait(0.01)
        assert sys.pycache_prefix == folder and not sys.dont_write_bytecode
        files.wait_for_writes()
        assert compiled == [folder, folder]
    finally:
        waiting.set()
        pre.engine = "ours"
        pre.engine_known.set()
        pre.thread.join(10)
    assert got == ["ours"] and not startup._importing.locked() and not startup._pending_switch


# Note [the model beside the data] (lenet/train.py): a build handed to the preload thread inside the block;
# prints the threads it ran on, and what built() returns for another key, for its own, and a second time.
_BESIDE = """
import json, sys, threading
from lenet import startup
startup.start_gpu()
ran = []


def build():
    ran.append(threading.current_thread().name)
    if sys.argv[1] == "raise":
        raise RuntimeError("no GPU")
    return "the model"


with startup.starting("legacy"):
    if sys.argv[1] != "none":
        startup.build_beside(("key", 1), build)
        startup.build_beside(("key", 2), build)   # once a process: the first one stands
other = startup.built(("key", 2)) if sys.argv[1] == "other" else None   # another key's: dropped
print(json.dumps({"ran": ran, "other": other, "built": startup.built(("key", 1)),
                  "again": startup.built(("key", 1))}))
"""


@pytest.mark.stack
@pytest.mark.parametrize("case", ["build", "raise", "none", "other"])
def test_a_build_handed_to_the_preload_thread_runs_there_once(case):
    out = _run(_BESIDE, case, hide_gpu=True)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    got = json.loads(out.stdout)
    assert got["ran"] == ([] if case == "none" else ["lenet-imports"]), got
    assert got["other"] is None and got["again"] is None, got   # another key's, and a second take: none
    assert got["built"] == ("the model" if case == "build" else None), got   # asked for another key first: dropped
