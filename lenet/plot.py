"""curves.png, the training curves, drawn by a child process: ``Plotter`` in the trainer,
``python -m lenet.plot`` in the child; the figures themselves are lenet/chart.py's (Pillow).

Note [plotting in a child]: a drawing is Python work that holds the GIL. Done on the trainer's writer
thread with matplotlib, its import and each drawing stalled the training loop: each time the loop released
the GIL for a CUDA call, the plotting thread took it for up to the switch interval, and the first epoch,
during matplotlib's import, took twice what its capture and GPU work explain (docs/performance.md, "Notes'
numbers: writing"). The child draws on another core while the GPU trains, when asked, and the loop only
writes one line to a pipe. Protocol: the child reads one JSON line per epoch (the file's path, the history
so far, the run's epochs, and whether to write the file now: the trainer asks for it at the end and at most
every PLOT_SECONDS; other lines only bring the records) and writes the file atomically (lenet/files.py). It
exits when its stdin closes, so it also exits when the trainer is killed. It runs in its own session, so a
Ctrl-C at the terminal reaches only the trainer, which then decides (Note [stopping] in lenet/train.py).

Note [the plotting child's first run]: with no bytecode cached (a first run on a fresh machine) the child's
start took three times as long as later (with matplotlib: its import and first figure); started once the
flags were parsed, it was not ready when a fast run's last epoch ended, and one run in three waited for it
at its end (docs/performance.md, "Notes' numbers: writing"). So python -m lenet.train starts it before its
own imports (``start_early`` from lenet.startup.begin, when --out is on the command line) and hands it the
path with each drawing; a run that writes no plot ends it unused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import files

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


PILLOW = (10, 1)   # ImageFont.load_default(size=...): Pillow's scalable font (lenet/chart.py)


def can_plot() -> bool:
    """Whether Pillow PILLOW or later is installed, told by its dist-info folder's name beside PIL (a listing:
    the program's first lines call this, where importlib.metadata's import took 24 ms), else its metadata."""
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("PIL")
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    version = None
    for folder in {os.path.dirname(p) for p in (spec.submodule_search_locations or ())}:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        version = next((n[7:] for n in names if n.lower().startswith("pillow-") and n.endswith(".dist-info")), version)
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version("pillow")
        except metadata.PackageNotFoundError:
            return False
    m = re.match(r"(\d+)\.(\d+)", version)
    return m is not None and (int(m[1]), int(m[2])) >= PILLOW


# Note [the plotting child's bytecode]: where Python writes no bytecode (PYTHONDONTWRITEBYTECODE), our programs
# keep theirs in a cache folder (Note [bytecode cache] in lenet/startup.py), and Python then reads bytecode from
# that folder alone, not from the __pycache__ folders an installer wrote. The plotting child's import is mostly
# its drawing library's, which its installer compiled: with matplotlib a first run's child compiled it after the
# checks (into our folder) and the trainer's end waited for that, and the second run's child imported it from
# source (docs/performance.md, "Time to accuracy"). So where the library (Pillow now) has its own bytecode the
# child keeps none of ours (LENET_BYTECODE_CACHE=off in its environment): its import reads the installer's.
def _site_bytecode(package: str) -> bool:
    """Whether ``package`` is installed with its own bytecode (its __init__'s, for this interpreter, in
    __pycache__ beside it), read without importing it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None)
    if not (isinstance(origin, str) and origin.endswith(".py")) or sys.implementation.cache_tag is None:
        return False
    folder, name = os.path.split(origin)
    return os.path.isfile(os.path.join(folder, "__pycache__",
                                       f"{name[:-3]}.{sys.implementation.cache_tag}.pyc"))


class Curves:
    """Loss and test accuracy per epoch (lenet/chart.py): ``png(history, epochs)`` draws the whole figure,
    its x axis the run's epochs where they are known."""

    SIZE = (1000, 400)

    def png(self, history: list[dict], epochs: int | None = None) -> bytes:
        from . import chart

        ep = [h["epoch"] for h in history]
        last = max(max(ep, default=1), epochs or 0)
        x = (0.5, last + 0.5)
        train, test = [h["train_loss"] for h in history], [h["test_loss"] for h in history]
        accuracy = [100 * h["test_accuracy"] for h in history]
        fig = chart.Figure(self.SIZE, "LeNet-5 on cuDNN + cuBLAS")
        a = fig.axes((0.07, 0.12, 0.48, 0.88), x, chart.data_range(train + test), "epoch", "cross-entropy",
                     x_integer=True, margin=0.05, bounds=(0.0, None))
        a.line(ep, train, chart.COLORS["C0"], marker=3)
        a.line(ep, test, chart.COLORS["C1"], marker=3)
        fig.legend(a, [("train", chart.COLORS["C0"]), ("test", chart.COLORS["C1"])])
        b = fig.axes((0.57, 0.12, 0.98, 0.88), x, chart.data_range(accuracy), "epoch", "test accuracy (%)",
                     x_integer=True, margin=0.05, bounds=(0.0, 100.0))
        b.line(ep, accuracy, chart.COLORS["C2"], marker=3)
        return fig.png()


def sweep_png(curves: list[dict], split: str) -> bytes:
    """A sweep's figure (lenet sweep): every model's accuracy per epoch on ``split``, the best drawn out;
    each curve {"label", "accuracy": [fractions], "best": bool}."""
    from . import chart

    finals = [100 * c["accuracy"][-1] for c in curves if c["accuracy"]]
    longest = max([1] + [len(c["accuracy"]) for c in curves])
    if finals:   # the interesting band: from a little under the median final accuracy to the top
        y = (max(0.0, float(sorted(finals)[len(finals) // 2]) - 4.0), min(100.0, max(finals) + 0.5))
    else:
        y = (0.0, 100.0)
    fig = chart.Figure((800, 500), f"lenet sweep: {len(curves)} models")
    ax = fig.axes((0.1, 0.1, 0.97, 0.9), (0.5, longest + 0.5), y, "epoch", f"{split} accuracy (%)", x_integer=True)
    best = [c for c in curves if c.get("best")]
    for c in sorted(curves, key=lambda c: c.get("best", False)):   # the best last: on top
        ep = list(range(1, len(c["accuracy"]) + 1))
        acc = [100 * a for a in c["accuracy"]]
        if c.get("best"):
            ax.line(ep, acc, chart.COLORS["C3"], width=2.2, marker=3)
        else:
            ax.line(ep, acc, chart.COLORS["gray"], width=0.8)
    if best:
        fig.legend(ax, [(f"best: {best[-1]['label']}", chart.COLORS["C3"])], where="inside")
    return fig.png()


def _error_file():
    """A file for the child's stderr with no name anywhere (memfd_create): tempfile's would be made in TMPDIR,
    where a signal's os._exit between its making and its unlinking left it (Note [nothing written before the
    checks] in lenet/files.py); elsewhere than Linux, tempfile's."""
    if hasattr(os, "memfd_create"):
        try:
            return open(os.memfd_create("lenet-plot-stderr", getattr(os, "MFD_CLOEXEC", 0)), "w+")
        except OSError:
            pass
    return tempfile.TemporaryFile(mode="w+")


class Plotter:
    """The trainer's side: ``draw(history)`` asks the child for a drawing of ``path`` (None: the path
    is told later, ``path = ...``, before the first drawing) and returns at once; ``close()`` waits
    for the drawings asked for and returns None, or the child's last error line."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path is not None else None
        self._err = _error_file()   # a file, not a pipe: the child never blocks on it
        env = files.children_environ(PYTHONPATH=os.pathsep.join(p for p in (str(PACKAGE_ROOT),
                                                                             os.environ.get("PYTHONPATH")) if p))
        if _site_bytecode("PIL"):   # Note [the plotting child's bytecode]
            env["LENET_BYTECODE_CACHE"] = "off"
        self._proc = None
        with files.starting_child():   # Note [a child started as a signal came] in lenet/files.py
            self._proc = subprocess.Popen([sys.executable, "-m", "lenet.plot"], stdin=subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, stderr=self._err, text=True, env=env,
                                          start_new_session=True)
        self._broken = False
        self._sent = 0   # the history's records the child has (draw)

    def draw(self, history: list[dict], epochs: int | None = None, write: bool = True) -> None:
        """Ask for a drawing of ``history`` (``epochs``: the run's length, which fixes the x axis);
        ``write`` False: the records only, for the next drawing that writes.
        Sends the records the child has not had: a line stays short in a long run, and the pipe's
        64 KB hold hundreds of them while the child draws."""
        if self._broken:
            return
        start = self._sent if self._sent <= len(history) else 0
        try:
            self._proc.stdin.write(json.dumps({"path": str(self.path), "from": start, "records": history[start:],
                                               "epochs": epochs, "write": write}) + "\n")
            self._proc.stdin.flush()
            self._sent = len(history)
        except OSError:   # the child is gone; close() says why
            self._broken = True

    def draw_sweep(self, curves: list[dict], split: str) -> None:
        """A sweep's figure (sweep_png) at ``path``."""
        if self._broken:
            return
        try:
            self._proc.stdin.write(json.dumps({"path": str(self.path), "sweep": curves, "split": split}) + "\n")
            self._proc.stdin.flush()
        except OSError:
            self._broken = True

    def discard(self) -> None:
        """End the child now, its drawings not waited for (a run that writes no plot after all)."""
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        self._end_child()
        self._err.close()

    def _end_child(self) -> None:
        """The child ended: killed, and waited for."""
        if self._proc is not None:
            self._proc.kill()
            try:
                self._proc.wait(2)
            except subprocess.TimeoutExpired:
                pass

    def close(self, timeout: float = 60.0) -> str | None:
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            code = None
        self._err.seek(0)
        lines = [ln for ln in self._err.read().splitlines() if ln.strip()]
        self._err.close()
        if code == 0:
            return None
        return lines[-1] if lines else (f"it took longer than {timeout:g} s" if code is None else f"exit status {code}")


_early: Plotter | None = None   # started by start_early, until the trainer takes it


def start_early(argv) -> None:
    """Start the plotting child now, its path not yet known, when the command line ``argv`` has --out
    and Pillow can plot (Note [the plotting child's first run]); ``take_early`` hands it over."""
    global _early
    if _early is None and any(a == "--out" or a.startswith("--out=") for a in argv) and can_plot():
        _early = Plotter()


def take_early() -> Plotter | None:
    """The child start_early started, or None; once: the caller owns it."""
    global _early
    p, _early = _early, None
    return p


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args:
        print("usage: python -m lenet.plot  (one JSON line an epoch on stdin, {\"path\": ..., \"from\": ..., "
              "\"records\": [...], \"epochs\": ..., \"write\": ...}; run by lenet.train)", file=sys.stderr)
        return 2
    import importlib

    importlib.import_module("lenet.chart")   # Pillow's import now, while the trainer starts

    curves = Curves()
    history, due = [], None   # the records so far; the curve ask to act on once what arrived is read

    def write_due():
        if due is not None and due["write"]:
            files.write_atomic(Path(due["path"]), curves.png(history, due["epochs"]))

    for asks in _asks(sys.stdin.fileno()):
        files.checks_passed()   # the trainer asks once its checks passed: our writes may begin
        for ask in asks:
            if "sweep" in ask:
                write_due()
                due = None
                files.write_atomic(Path(ask["path"]), sweep_png(ask["sweep"], ask["split"]))
            else:   # asks that arrived together: one drawing, written if any of them asked to
                history[ask["from"]:] = ask["records"]
                due = {"path": ask["path"], "epochs": ask.get("epochs"),
                       "write": ask.get("write", True) or (due is not None and due["write"])}
        write_due()
        due = None
    return 0


def _asks(fd: int):
    """The JSON lines on ``fd``, as lists: each list every ask that had arrived when the last list was
    handled. Ends when the trainer closes the pipe."""
    import select

    pending = b""
    while True:
        chunk = os.read(fd, 1 << 16)
        while chunk and select.select([fd], [], [], 0)[0]:   # everything there already, at once
            more = os.read(fd, 1 << 16)
            if not more:
                break
            chunk += more
        pending += chunk
        *lines, pending = pending.split(b"\n")
        asks = [json.loads(line) for line in lines if line.strip()]
        if asks:
            yield asks
        if not chunk:
            return


def child_start() -> None:
    """What the child does before ``main``: writes held until the trainer's first ask (Note [nothing written
    before the checks] in lenet/files.py), and the bytecode cache before Pillow's import (Note [bytecode
    cache] in lenet/startup.py; Note [the plotting child's bytecode])."""
    from .startup import keep_bytecode

    files.hold_writes()
    keep_bytecode()


if __name__ == "__main__":
    from .cli import leave

    child_start()
    leave(main())   # the trainer waits for this process: no interpreter teardown (Note [fast exit])
