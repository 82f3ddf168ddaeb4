"""lenet sweep --gpus: one sweep worker per GPU over one Optuna study, and one merged result.

    lenet sweep --gpus all --search optuna --trials 512 --sampler grid --lr 0.02 0.05 0.1 0.2 --out runs/sweep

The workers are `lenet sweep` itself (lenet/study.py's StudySweep), each started here with its GPU alone
visible (CUDA_VISIBLE_DEVICES), the same flags, the study's storage (--storage, else a journal file
study.log under --out) and its own folder under --out (gpuN/, its log gpuN.log). Optuna's storage shares
the trials among them (Note [trial budget] in lenet/study.py); this process starts no CUDA context of its
own, waits, and then writes the sweep's files under --out from the workers' rows: results.jsonl and
results.csv (every worker's trials), summary.json, curves.png, and best/ (the winner's checkpoint and
export, from the worker that trained it).

Note [stopping the workers]: the workers run in sessions of their own, so a Ctrl-C at the terminal reaches
this process alone; it passes the signal on to every worker once (each stops after the step in flight,
marks its running trials failed and enqueues them again: Note [stopping a sweep] in lenet/sweep.py), waits
for them, and says so in one line; `--resume` continues the study with the same workers' folders. A
worker that dies is named with the last line of its log, and the others finish; the merged result holds
what the workers finished.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import files
from .gpus import gpu_count  # noqa: F401 (what --gpus counts; the tests stand in for it here)

WORKERS_FILE = "workers.json"   # the folder's workers: the storage, the GPUs, the flags (what --resume checks)
MERGED = ("results.csv", "results.jsonl", "curves.png", "summary.json", "best", WORKERS_FILE)


def parse_gpus(text: str) -> str:
    """--gpus: ``all`` or GPU indices as this process sees them (0,2); checked against the GPUs once they
    are counted (``choose``)."""
    t = text.strip().lower()
    if t == "all":
        return t
    parts = [p.strip() for p in t.split(",")]
    if not parts or not all(p.isdigit() and len(p) <= 4 for p in parts):
        raise ValueError(f"invalid value {text!r}: give all, or GPU indices separated by commas (0,2)")
    if len(set(parts)) != len(parts):
        raise ValueError(f"invalid value {text!r}: a GPU is named twice")
    return ",".join(str(int(p)) for p in parts)


def choose(spec: str, count: int, visible: str | None) -> list[str]:
    """The CUDA_VISIBLE_DEVICES value of each worker: --gpus ``spec`` among the ``count`` GPUs this process
    sees (``visible``: its own CUDA_VISIBLE_DEVICES, whose entries the indices then name)."""
    from descriptors.errors import NoGpuError

    if count == 0:
        raise NoGpuError("no usable NVIDIA GPU: the CUDA driver reports none (--gpus runs a worker on each)")
    ids = [v.strip() for v in visible.split(",")][:count] if visible else [str(i) for i in range(count)]
    if spec == "all":
        return ids
    picks = [int(p) for p in spec.split(",")]
    bad = [p for p in picks if p >= count]
    if bad:
        raise ValueError(f"--gpus {spec}: GPU {bad[0]} does not exist; this machine has {count} "
                         f"(0-{count - 1}{', as CUDA_VISIBLE_DEVICES lists them' if visible else ''})")
    return [ids[p] for p in picks]


def worker_argv(argv: list[str], storage: str, out: Path) -> list[str]:
    """A worker's flags: the sweep's, without --gpus, --out, --storage, --overwrite and --quiet, with the
    study's storage, the worker's folder and plain log lines."""
    drop_value = {"--gpus", "--out", "--storage"}
    out_args, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in drop_value:
            skip = "=" not in a
            continue
        if a in ("--overwrite", "--quiet", "--resume"):
            continue
        out_args.append(a)
    return [*out_args, "--storage", storage, "--out", str(out), "--quiet"]


class Workers:
    """The workers of one `lenet sweep --gpus` (module docstring)."""

    command = (sys.executable, "-m", "lenet.sweep")   # a worker: `lenet sweep` with the flags worker_argv makes

    def __init__(self, args, argv: list[str]):
        self.args, self.argv = args, list(argv)
        self.out = Path(args.out) if args.out else None
        self.storage = args.storage or (str(self.out / "study.log") if self.out else None)
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self.signum: int | None = None

    # -- before any worker starts: every check that needs no GPU

    def check(self) -> None:
        args = self.args
        require_study(args)
        if args.out is None:
            raise ValueError("--gpus needs --out DIR: each worker writes its folder there, and the merged result")
        files.check_output_dir(self.out, "--out")
        earlier = [n for n in (*MERGED, "study.log") if (self.out / n).exists()] + sorted(
            p.name for p in self.out.glob("gpu*") if p.is_dir()) if self.out.is_dir() else []
        if args.resume:
            made = self.out / WORKERS_FILE
            if not made.is_file():
                raise ValueError(f"--resume: {files.show(self.out)} holds no sweep over GPUs (no {WORKERS_FILE}); "
                                 f"start one without --resume")
            try:
                before = json.loads(made.read_text())
                if not isinstance(before, dict):
                    raise ValueError
            except (OSError, ValueError):
                raise ValueError(f"--resume: {files.show(made)} is not a sweep's workers file") from None
            if before.get("storage") != self.storage:
                raise ValueError(f"--resume: the sweep in {files.show(self.out)} used the storage "
                                 f"{before.get('storage')!r}, this one {self.storage!r}; resume with the same --storage")
        elif earlier and not args.overwrite:
            raise files.OutputError(f"--out {files.show(self.out)} holds an earlier sweep ({', '.join(earlier[:4])}); "
                                    f"continue it with --resume, write to a new folder, or replace it with --overwrite")

    # -- running

    def _pass_on(self, signum, frame) -> None:
        """Note [stopping the workers]: the first SIGINT or SIGTERM goes to every worker, once."""
        if self.signum is None:
            self.signum = signum
            for _, p, _ in self.procs:
                self._signal(p, signum)

    def _signal(self, p, signum: int, again: bool = False) -> None:
        if p.poll() is None and (again or p.pid not in self._signalled):
            self._signalled.add(p.pid)
            try:
                p.send_signal(signum)
            except ProcessLookupError:
                pass

    def _stop_now(self) -> None:
        """A second signal (lenet/interrupt.py leaves at once): the workers get it too and stop at once."""
        for _, p, _ in self.procs:
            self._signal(p, self.signum or signal.SIGTERM, again=True)

    def start(self, gpus: list[str]) -> None:
        """Start a worker on each GPU (its CUDA_VISIBLE_DEVICES value), the signal handling first: a signal
        while they start reaches those already started, and each started after it (Note [stopping the
        workers]); where a start fails, those started are stopped."""
        from . import interrupt

        self._signalled: set = set()
        interrupt.hand_over(True)   # the first signal is ours to pass on; a second ends this process at once
        interrupt.before_exit(self._stop_now)
        self._handlers = {s: signal.signal(s, self._pass_on) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._start(gpus)
        except BaseException:
            for _, p, _ in self.procs:
                self._signal(p, signal.SIGTERM, again=True)
            raise

    def _start(self, gpus: list[str]) -> None:
        out = self.out
        out.mkdir(parents=True, exist_ok=True)
        if self.args.overwrite:
            for p in [out / n for n in (*MERGED, "study.log")] + sorted(out.glob("gpu*")):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                elif p.exists() or p.is_symlink():
                    p.unlink()
        files.write_atomic(out / WORKERS_FILE, (json.dumps(
            {"storage": self.storage, "gpus": gpus, "argv": self.argv}, indent=1) + "\n").encode())
        env = files.children_environ()
        for i, gpu in enumerate(gpus):
            folder = out / f"gpu{i}"
            argv = worker_argv(self.argv, self.storage, folder)
            if self.args.resume and (folder / "sweep.json").exists():
                argv.append("--resume")
            elif folder.exists():
                argv.append("--overwrite")   # a folder of an earlier start that never began its sweep
            log = open(out / f"gpu{i}.log", "ab")
            proc = subprocess.Popen([*self.command, *argv], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**env, "CUDA_VISIBLE_DEVICES": gpu})
            log.close()
            self.procs.append((gpu, proc, out / f"gpu{i}.log"))
            if self.signum is not None:
                self._signal(proc, self.signum)
            print(f"worker {i} on GPU {gpu}: pid {proc.pid}, log {files.show(out / f'gpu{i}.log')}", flush=True)

    def wait(self) -> list[tuple[str, int, str]]:
        """Wait for every worker, passing a SIGINT or SIGTERM on to all of them once (Note [stopping the
        workers]); the (GPU, exit status, last log line) of each that failed."""
        try:
            while any(p.poll() is None for _, p, _ in self.procs):
                time.sleep(0.2)
        finally:
            from . import interrupt

            for s, h in getattr(self, "_handlers", {}).items():
                signal.signal(s, h)
            interrupt.hand_over(False)
        failed = []
        for gpu, p, log in self.procs:
            if p.returncode not in (0, 130, 143) or (p.returncode != 0 and self.signum is None):
                failed.append((gpu, p.returncode, last_line(log)))
        return failed

    # -- the merged result

    def merge(self, plotter=None) -> dict | None:
        """results.jsonl, results.csv, summary.json, curves.png and best/ under --out from the workers' folders;
        the summary, or None when no worker finished a model."""
        from .sweep_results import best_of, label_of, write_csv

        rows, summaries = [], {}
        for i in range(len(self.procs)):
            folder = self.out / f"gpu{i}"
            for line in _lines(folder / "results.jsonl"):
                try:
                    row = json.loads(line)
                except ValueError:
                    continue   # a line cut by a kill
                if isinstance(row, dict) and "trial" in row and "status" in row:
                    rows.append({**row, "worker": i})
            try:
                summaries[i] = json.loads((folder / "summary.json").read_text())
            except (OSError, ValueError):
                pass
        rows.sort(key=lambda r: (r["trial"] if isinstance(r["trial"], int) else 1 << 30))
        if not rows:
            return None
        best = best_of(rows)
        out = self.out
        files.write_atomic(out / "results.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
        write_csv(out / "results.csv", rows)
        summary = {"models": len(rows), "workers": len(self.procs), "gpus": [g for g, _, _ in self.procs],
                   "split": rows[0].get("split"), "best": best}
        if best is not None:
            src = self.out / f"gpu{best['worker']}" / "best"
            own = summaries.get(best["worker"], {})
            theirs = (own.get("best") or {}).get("trial") == best["trial"]   # that worker's winner is the winner
            if theirs:
                for k in ("test_accuracy", "test_loss", "train_command"):
                    if k in own:
                        summary[k] = own[k]
            if theirs and src.is_dir():
                tmp = out / ".best.incoming"
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.copytree(src, tmp)
                shutil.rmtree(out / "best", ignore_errors=True)
                os.replace(tmp, out / "best")
        files.write_atomic(out / "summary.json", (json.dumps(summary, indent=1, default=float) + "\n").encode())
        if plotter is not None:
            curves = [{"label": label_of(r["config"]), "accuracy": r["accuracy"], "best": r is best} for r in rows]
            plotter.path = out / "curves.png"
            plotter.draw_sweep(curves, summary["split"] or "test")
            err = plotter.close()
            if err:
                print(f"curves.png not drawn: {err}", flush=True)
        return summary


def test_winner(checkpoint: Path, root, gpu: str) -> tuple[float, int] | None:
    """(accuracy, images) of the merged winner on the test split, read once, by it alone (Note [the ranked
    split] in lenet/sweep.py): `lenet predict` on GPU ``gpu``, where no worker did it (the winner's worker
    reads the test split only if no trial was running elsewhere when it ended). None where it fails."""
    import re

    from . import data

    images, labels = (data._file(Path(root), stem) for stem in data.SPLITS["test"])
    r = subprocess.run([sys.executable, "-m", "lenet.predict", "--checkpoint", str(checkpoint), str(images),
                        "--labels", str(labels), "--device", "gpu"], stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, env=files.children_environ(CUDA_VISIBLE_DEVICES=gpu))
    m = re.search(r"^accuracy ([0-9.]+)% on (\d+) images$", r.stdout, re.M)
    return (float(m.group(1)) / 100, int(m.group(2))) if r.returncode == 0 and m else None


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def last_line(log: Path) -> str:
    lines = [x for x in _lines(log) if x.strip()]
    return files.show(lines[-1]) if lines else "(its log is empty)"


def require_study(args) -> None:
    """--gpus runs an Optuna study: a grid given without one is told so before its values are judged as a study's."""
    if args.search != "optuna":
        raise ValueError("--gpus spreads one Optuna study over the GPUs: add --search optuna --trials N "
                         "(--sampler grid takes every combination of the values given once)")


def run(args, argv: list[str], plotter=None, root=None) -> int:
    """lenet sweep --gpus: check, start the workers, wait, merge, report (module docstring)."""
    from .sweep_results import label_of

    w = Workers(args, argv)
    w.check()
    gpus = choose(args.gpus, gpu_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    t0 = time.perf_counter()
    w.start(gpus)
    failed = w.wait()
    seconds = time.perf_counter() - t0
    for gpu, code, line in failed:
        print(f"the worker on GPU {gpu} ended with status {code}: {line}", flush=True)
    if w.signum is not None:
        name = "SIGINT" if w.signum == signal.SIGINT else "SIGTERM"
        print(f"stopped by {name}: {len(gpus)} workers stopped after their steps in flight; continue with --resume",
              file=sys.stderr, flush=True)
        return 130 if w.signum == signal.SIGINT else 143
    summary = w.merge(plotter)
    if summary is None:
        print(f"no model finished on {len(gpus)} GPUs ({seconds:.1f} s)", flush=True)
        return 2 if failed else 0
    best = summary["best"]
    winner = w.out / "best" / "checkpoint.npz"
    if (best is not None and summary["split"] == "validation" and "test_accuracy" not in summary and root is not None
            and winner.is_file()):
        tested = test_winner(winner, root, gpus[0])
        if tested is not None:
            summary["test_accuracy"], summary["test_images"] = tested
            files.write_atomic(w.out / "summary.json", (json.dumps(summary, indent=1, default=float) + "\n").encode())
    line = (f"{summary['models']} models on {len(gpus)} GPUs in {seconds:.1f} s, ranked on the {summary['split']} "
            f"split")
    if best is not None:
        line += f"; best {100 * best['final']:.2f}% ({label_of(best['config'])}, trial {best['trial']})"
        if "test_accuracy" in summary:
            line += f"; on the test split {100 * summary['test_accuracy']:.2f}%"
    print(line, flush=True)
    print(f"merged into {files.show(w.out)}: results.csv, results.jsonl, summary.json, curves.png, best/", flush=True)
    return 1 if failed else 0
