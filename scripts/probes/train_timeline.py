"""Where the wall clock of one `python -m lenet.train` (or `lenet.train_step`) run goes, phase by
phase, exit included.

Runs the program in a child process, started as python -m lenet.train starts (the driver's
thread first, then the imports), with its main phases wrapped by timers (the driver's thread,
the dataset's reading, the statistics, the wait for the start-up threads, the model, the
uploads, each plan, the first steps, each evaluation, the writer's close), reports the gaps
between them (imports, mostly), and the exit: the child's last timestamp against the parent's
clock when the child is gone.

    python3 scripts/probes/train_timeline.py [--json PATH] [--profile plan#1 step#1] -- --data-dir data/fashion-mnist --epochs 30 ...
    python3 scripts/probes/train_timeline.py --program train_step -- --data-dir data/fashion-mnist
    python3 scripts/probes/train_timeline.py --cold --program train_step

With --cold the child runs as a first run on a fresh machine does: every cache it would read
pointed at empty folders (CuPy's kernel cache, $XDG_CACHE_HOME and with it our kernels, plans,
datasets and bytecode, and CUDA's own cache, $CUDA_CACHE_PATH: NVRTC 13 keeps what it compiled there
too, so a second compile of one source took 0.06-0.29 s where the first took 1.0-1.25 s on an H100
machine), removed afterwards (--keep keeps them). The timeline then shows each of our
modules' compile beside the rest, and both kernel caches are listed afterwards (ours, and CuPy's,
where NVRTC's builds of CuPy's own functions would go), with the time each file was written (Note
[first run] in lenet/kernels/nvrtc.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# What --sum times by default: a first run's plans, by part (Note [a plan's parts]).
PLAN_PARTS = ("lenet.plan:Planner.plan", "lenet.plan:Planner.plan_whole", "lenet.plan:Planner.time_step",
              "lenet.plan:time_launcher", "lenet.engines.ours:Ours.candidates", "lenet.engines.ours:Ours.bind",
              "lenet.engines.ours_check:OurChecks.check_stage", "lenet.engines.ours_check:OurChecks._reference",
              "lenet.engines.cublaslt:Cublaslt.bind", "lenet.engines.cudnn:Cudnn.bind",
              "lenet.engines.cudnn:ConvSearch.offered", "lenet.engines.cudnn:ConvSearch._try",
              "lenet.engines.cudnn:reference", "lenet.engines.cudnn:distance",
              "descriptors.graph:ConvGraph._build_graph", "descriptors.graph:ConvGraph._make_plans",
              "descriptors.candidates:LegacyConvs.candidates", "descriptors.candidates:GraphConvs.bind",
              "descriptors.candidates:LegacyConvs.bind")


# Note [a plan's parts]: --sum wraps each named function with a timer and reports, per function, its calls and
# the seconds spent inside them (inclusive: a function's callees are in its time; a call inside a call of the same
# function is not counted twice), on whichever thread ran them. Unlike --profile's cProfile it adds about a
# microsecond a call and is not skewed by the other threads' holding the GIL, so the plans' parts can be read on
# the preload thread while the main thread reads the data. The wrapped modules are imported on the main thread
# just after the program's start-up begins (startup.begin: its environment set first, as the program does), an
# import the run makes anyway, moved earlier: the imports' own times shift, the plans' do not. A name imported into
# a module (``from x import f``) is wrapped where it is called: name that module. (The table in
# docs/performance.md was measured with these imports before startup.begin, NumPy's among them.)
def sum_wraps(specs: list[str], totals: dict) -> None:
    import functools
    import importlib
    import inspect
    import threading

    inside, lock = threading.local(), threading.Lock()
    for spec in specs:
        mod_name, _, attr = spec.partition(":")
        owner = importlib.import_module(mod_name)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        raw = inspect.getattr_static(owner, name)   # a class's staticmethod or classmethod as such, inherited too
        kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
        fn = raw.__func__ if kind else raw
        totals[spec] = [0, 0.0]

        @functools.wraps(fn)
        def timed(*a, __fn=fn, __spec=spec, **k):
            depth = getattr(inside, __spec, 0)
            setattr(inside, __spec, depth + 1)
            t0 = time.perf_counter()
            try:
                return __fn(*a, **k)
            finally:
                setattr(inside, __spec, depth)
                if depth == 0:
                    with lock:
                        row = totals[__spec]
                        row[0] += 1
                        row[1] += time.perf_counter() - t0

        setattr(owner, name, kind(timed) if kind else timed)


def child(program: str, train_args: list[str], events_path: str, profile: list[str], sums: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    from lenet import startup   # nothing more before begin(), as python -m lenet.train does

    t_start = time.perf_counter() - startup.process_seconds()   # the process's start on perf_counter's scale
    events, profiles, totals = [], {}, {}

    def at() -> float:
        return time.perf_counter() - t_start

    def wrap(owner, name, label, limit=None):
        fn = getattr(owner, name)
        calls = [0]

        def timed(*a, **k):
            calls[0] += 1
            if limit is not None and calls[0] > limit:
                return fn(*a, **k)
            tag = f"{label}" + (f" #{calls[0]}" if limit != 1 else "")
            prof = None
            if f"{name}#{calls[0]}" in profile:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            t0 = at()
            try:
                return fn(*a, **k)
            finally:
                events.append((tag, t0, at()))
                if prof is not None:
                    import io
                    import pstats

                    prof.disable()
                    buf = io.StringIO()
                    st = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
                    st.print_stats(28)
                    st.print_callers("sleep|_lib.py:.*call")
                    profiles[tag] = buf.getvalue()

        setattr(owner, name, timed)

    events.append(("interpreter + probe imports", 0.0, at()))
    # As python -m lenet.train does: the start-up threads first, before the imports (timed here).
    start_context = startup.start_context

    def timed_context():
        t0 = at()
        try:
            return start_context()
        finally:
            events.append(("driver thread: cuInit + primary context", t0, at()))

    startup.start_context = timed_context
    from lenet import plot

    # The plotting child runs this file's plot_child (its phases timed, on this process's clock).
    popen = subprocess.Popen

    def traced_popen(argv, **kw):
        if list(argv) == [sys.executable, "-m", "lenet.plot"]:
            argv = [sys.executable, __file__, "--plot-child", events_path + ".plot"]
            kw["env"] = dict(kw.get("env") or os.environ, PROBE_EPOCH=repr(time.time() - at()))
        return popen(argv, **kw)

    plot.subprocess = type(sys)("subprocess_traced")
    plot.subprocess.__dict__.update({k: v for k, v in vars(subprocess).items() if not k.startswith("__")},
                                    Popen=traced_popen)

    try:   # Note [the images read from the first line] in lenet/sources.py (a tree before them has none)
        from lenet import sources

        wrap(sources, "_read", "images read from the first line (a thread)")
    except ImportError:
        pass
    startup.begin(then=plot.start_early if program == "train" else None)
    if sums:
        sum_wraps(sums, totals)
    from lenet import cli

    starting = startup.starting

    @contextlib.contextmanager
    def timed_starting(engine, batches=(), **kw):
        t0 = at()
        with starting(engine, batches, **kw):
            yield
            events.append(("main thread: prepare (data, checks)", t0, at()))
            t1 = at()
        events.append(("main thread waits for driver + preload", t1, at()))
        # The preload thread has imported descriptors and lenet.model by now: time their parts.
        import descriptors
        from lenet import model as lenet_model

        wrap(descriptors, "require_gpu", "require_gpu (driver, device)", 1)
        wrap(lenet_model.LeNet, "__init__", "LeNet(...) (context, handles, buffers)", 1)
        wrap(data.GpuDataset, "__init__", "GpuDataset upload")
        wrap(lenet_model.LeNet, "plan", "plan", 4)
        wrap(lenet_model.LeNet, "step", "step (host time)", 3)
        wrap(lenet_model.LeNet, "evaluate", "evaluate", 2)
        wrap(lenet_model.LeNet, "describe", "describe", 1)

    startup.starting = timed_starting
    import importlib

    from lenet import background, data, plot

    prog = importlib.import_module(f"lenet.{program}")
    wrap(cli, "device_facts", "device_facts", 1)
    if hasattr(prog, "build_model"):   # the model and its plans, on the preload thread (Note [the model beside the data])
        wrap(prog, "build_model", "build_model (model + plans)", 1)

    wrap(data, "load_split", "read dataset split")
    wrap(data, "commit", "dataset cache written (a thread)")
    wrap(data, "pixel_stats", "pixel statistics", 1)
    wrap(background.Background, "close", "writer close", 1)
    wrap(plot.Plotter, "__init__", "Plotter (spawns the child)", 1)
    wrap(plot.Plotter, "close", "Plotter close (waits for the last drawing)", 1)
    events.append((f"import lenet.{program}, data", events[0][2], at()))
    t0 = at()
    try:
        code = prog.main(train_args)
    finally:
        events.append((f"{program}.main total", t0, at()))
        events += [(label, t - t_start, t - t_start) for label, t in startup.MARKS]
        from lenet.kernels import nvrtc as modules   # each of our modules' compile (or cache read), on its thread
        events += [(f"module {key} ({how})", t0 - t_start, t1 - t_start) for key, t0, t1, how in modules.BUILT]
        Path(events_path).write_text(json.dumps({"events": events, "end": at(), "profiles": profiles,
                                                 "epoch_start": time.time() - at(), "sums": totals}))
    sys.exit(code) if os.environ.get("PROBE_SLOW_EXIT") else cli.leave(code)   # cli.leave: as the programs


def compiled(folder: Path, epoch_start: float) -> list:
    """(seconds from the child's start when written, bytes, its kernels' names) of each module in a
    kernel cache folder: the kernel names are the ELF's .text.NAME sections of its binary."""
    rows = []
    for f in folder.rglob("*") if folder.is_dir() else ():
        if f.is_file():
            data = f.read_bytes()
            names = sorted({n.decode(errors="replace")[:48] for n in re.findall(rb"\.text\.([\w$.]+?)\0", data)})
            rows.append((f.stat().st_mtime - epoch_start, len(data), ", ".join(names)[:160]))
    return sorted(rows)


def plot_child(events_path: str) -> None:
    """python -m lenet.plot, its phases timed: each batch of asks read, each figure drawn (and, on an older
    tree, matplotlib's import, the font list kept, the figure made); written to ``events_path`` on the
    trainer's clock (PROBE_EPOCH)."""
    t_base = float(os.environ.pop("PROBE_EPOCH"))
    events = [("plot child: interpreter start to probe", 0.0, 0.0)]
    first = time.time() - t_base
    events[0] = ("plot child: up (interpreter + probe)", first, first)
    sys.path.insert(0, str(ROOT))
    from lenet import plot

    def at() -> float:
        return time.time() - t_base

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def timed(*a, **k):
            t0 = at()
            try:
                return fn(*a, **k)
            finally:
                events.append((f"plot child: {label}", t0, at()))
        setattr(owner, name, timed)

    for owner, name, label in ((plot, "_import_matplotlib", "import matplotlib"), (plot, "_keep_aside", "font list kept"),
                               (plot.Curves, "png", "drawn + png"), (plot.Curves, "prepare", "drawn (not written)")):
        if name in vars(owner):   # a tree may lack one (the matplotlib ones are an older tree's)
            wrap(owner, name, label)
    asks = plot._asks

    def timed_asks(fd):
        for got in asks(fd):
            events.append((f"plot child: {len(got)} asks read", at(), at()))
            yield got
    plot._asks = timed_asks
    plot.child_start()   # as python -m lenet.plot does
    if (ROOT / "lenet" / "chart.py").exists():   # what main imports first (Note [charts on Pillow])
        t0 = at()
        import importlib

        importlib.import_module("lenet.chart")
        events.append(("plot child: import lenet.chart (Pillow)", t0, at()))
    try:
        code = plot.main([])
    finally:
        events.append(("plot child: done", at(), at()))
        Path(events_path).write_text(json.dumps(events))
    from lenet.cli import leave

    leave(code)   # as python -m lenet.plot leaves: no interpreter teardown (the trainer waits for it)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--profile", nargs="*", default=[], metavar="FN#CALL",
                    help="cProfile these calls, e.g. plan#1 step#1 __init__#1")
    ap.add_argument("--log", help="write the trainer's whole output here")
    ap.add_argument("--program", choices=("train", "train_step"), default="train")
    ap.add_argument("--cold", action="store_true",
                    help="every cache the program reads pointed at empty folders: a first run on a fresh machine")
    ap.add_argument("--keep", action="store_true", help="with --cold, keep the cache folders (their path is printed)")
    ap.add_argument("--kernels-from", metavar="DIR",
                    help="with --cold, our kernel cache starts as a copy of DIR (a kernel folder of an earlier run): "
                         "what a first run would find if the package brought its kernels compiled")
    ap.add_argument("--sum", nargs="*", metavar="MODULE:NAME",
                    help="the calls and inclusive seconds of these functions (Note [a plan's parts]); "
                         "no names: a plan's parts")
    ap.add_argument("--child-events")
    ap.add_argument("--plot-child")
    ap.add_argument("train_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    if args.plot_child:
        plot_child(args.plot_child)
        return
    if args.child_events:
        child(args.program, train_args, args.child_events, args.profile, args.sum or [])
        return
    events_path = f"/tmp/train_timeline_{os.getpid()}.json"
    env, caches = dict(os.environ), None
    if args.cold:
        caches = Path(tempfile.mkdtemp(prefix="lenet-cold-"))
        env = {k: v for k, v in env.items() if not k.startswith("LENET_") or k == "LENET_REQUIRE_GPU"}
        env.update(CUPY_CACHE_DIR=str(caches / "cupy"), XDG_CACHE_HOME=str(caches / "xdg"),
                   CUDA_CACHE_PATH=str(caches / "nv"))
        if args.kernels_from:
            shutil.copytree(args.kernels_from, caches / "xdg" / "lenet" / "kernels")
    try:
        t0 = time.perf_counter()
        sums = [] if args.sum is None else (args.sum or list(PLAN_PARTS))
        p = subprocess.run([sys.executable, __file__, "--program", args.program, "--child-events", events_path,
                            "--profile", *args.profile, "--sum", *sums, "--", *train_args],
                           capture_output=True, text=True, env=env)
        total = time.perf_counter() - t0
        if args.log:
            Path(args.log).write_text(p.stdout + p.stderr)
        print(p.stdout[-600:], p.stderr[-1500:], sep="\n")
        if p.returncode != 0:
            sys.exit(f"the program failed (exit status {p.returncode}): no timeline")
        got = json.loads(Path(events_path).read_text())
        plotted = Path(events_path + ".plot")
        if plotted.exists():
            got["events"] += json.loads(plotted.read_text())
        for tag, text in got["profiles"].items():
            print(f"--- cProfile of {tag}\n{text}")
        rows = sorted(got["events"], key=lambda e: e[1])
        print(f"{'phase':<46s} {'begin s':>8s} {'took s':>8s}")
        for name, b, e in rows:
            print(f"{name:<46s} {b:8.3f} {e - b:8.3f}")
        if got.get("sums"):
            print("\n" + f"{'function (inclusive seconds: --sum)':<64s} {'calls':>6s} {'s':>8s}")
            for spec, (calls, secs) in got["sums"].items():
                print(f"{spec:<64s} {calls:6d} {secs:8.3f}")
            print()
        exit_s = total - got["end"]   # the child's process start precedes the parent's t0 by a little
        print(f"{'exit (last timestamp to process gone)':<46s} {got['end']:8.3f} {exit_s:8.3f}  (upper bound)")
        print(f"{'whole process (parent clock)':<46s} {0:8.3f} {total:8.3f}")
        if caches is not None:
            for title, folder in (("Our kernel cache", caches / "xdg" / "lenet" / "kernels"),
                                  ("CuPy's kernel cache", caches / "cupy")):
                built = compiled(folder, got["epoch_start"])
                print(f"\n{title} after the run: {len(built)} modules (written at s, size, kernels)")
                for at_s, size, names in built:
                    print(f"{at_s:8.3f} {size:9d} B  {names}")
            if args.keep:
                print(f"caches kept in {caches}")
        if args.json:
            Path(args.json).write_text(json.dumps({"events": rows, "end": got["end"], "total": total,
                                                   "returncode": p.returncode}, indent=1))

    finally:   # the events files and the cold caches go, the run failed or not
        for leftover in (Path(events_path), Path(events_path + ".plot")):
            leftover.unlink(missing_ok=True)
        if caches is not None and not args.keep:
            shutil.rmtree(caches, ignore_errors=True)


if __name__ == "__main__":
    main()
