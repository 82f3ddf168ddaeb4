"""curves.png, the training curves, drawn by a child process: ``Plotter`` in the trainer,
``python -m lenet.plot PATH`` in the child.

Note [plotting in a child]: matplotlib's import and each drawing are Python work that holds the
GIL. Done on the trainer's writer thread, they stalled the training loop: each time the loop
released the GIL for a CUDA call, the plotting thread took it for up to the switch interval, and
the first epoch, during matplotlib's import, took twice what its capture and GPU work explain
(docs/performance.md, "Notes' numbers: writing"). The child imports matplotlib on another core
while the GPU trains. It draws when asked, and the loop only
writes one line to a pipe. Protocol: the child reads one JSON line per epoch (the file's path,
the history so far, the run's epochs, and whether to write the file now: Note [the last drawing]; and one
{"ready": true} line once the trainer's checks passed: Note [the child's import once the checks passed])
and writes the file atomically (lenet/files.py). It exits when its
stdin closes, so it also exits when the trainer is killed. It runs in its own session, so a
Ctrl-C at the terminal reaches only the trainer, which then decides (Note [stopping] in
lenet/train.py).

Note [the plotting child's first run]: with no bytecode cached (a first run on a fresh machine)
the child's import of matplotlib and its first figure take three times as long as later; started
once the flags were parsed, it was not ready when a fast run's last epoch ended, and one run in
three waited for it at its end (docs/performance.md, "Notes' numbers: writing"). So python -m lenet.train
starts it before its own imports (``start_early`` from lenet.startup.begin, when --out is on the
command line) and hands it the path with each drawing; a run that writes no plot ends it unused.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import files

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def can_plot() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


# Note [the plotting child's bytecode]: where Python writes no bytecode (PYTHONDONTWRITEBYTECODE), our programs
# keep theirs in a cache folder (Note [bytecode cache] in lenet/startup.py), and Python then reads bytecode from
# that folder alone, not from the __pycache__ folders an installer wrote. The plotting child's import is mostly
# matplotlib's, which its installer compiled: in a first run the child then compiled matplotlib after the checks
# (into our folder) and the trainer's end waited for that, "writing" 0.37-1.22 s (1.0 s more in a cold fast
# recipe on an H200 machine: 3.86-4.35 s against 2.84-3.00 s), and the second run's child imported matplotlib
# from source (writing 1.52 s). So where matplotlib has its own bytecode the child keeps none of ours
# (LENET_BYTECODE_CACHE=off in its environment): its import reads the installer's.
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


def _import_matplotlib() -> None:
    """What a first figure imports, its font list made (written, where none is cached): the slow part of a first
    drawing, none of a sweep's or a run's figure itself."""
    from matplotlib import font_manager  # noqa: F401
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    from matplotlib.figure import Figure  # noqa: F401


def _figure(**kw):
    """A matplotlib Figure drawn by Agg, made without pyplot: its import (the backends' registry, the
    figure manager) cost the plotting child 0.14 s more (0.71-0.81 s against 0.57-0.66 here), and a
    figure of our own needs no global registry to be closed in."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kw)
    FigureCanvasAgg(fig)
    return fig


class Curves:
    """Loss and test accuracy per epoch. The figure is made once; ``png(history, epochs)`` moves its
    lines' data and draws, ``prepare`` does the slow part of a drawing ahead of time.

    Note [the last drawing]: a fast run waited at its end for its last drawing, and most of a
    drawing is the axes' text and ticks, which depend on the axes' limits only (docs/performance.md,
    "Notes' numbers: writing"). So a drawing is split in two: the static layer (every artist but the
    lines, the spines and the legend, which are drawn over the lines) rendered once per set of
    limits and kept (``canvas.copy_from_bbox``), and the lines, spines and legend drawn over a copy
    of it (``draw_artist``, in their z-order, as a full drawing would: the same pixels, which
    tests/test_train_cpu.py checks), then the PNG encoded from the canvas. The legend stands above
    the axes, where no line reaches it, in the static layer (inside, at its best place, it moved
    with the data, and its text was redrawn every time). With the epochs known
    the x axis is fixed, and the y limits are rounded to tick values (axes.autolimit_mode
    round_numbers), so they change only when a curve crosses a tick: the trainer sends the
    history after every epoch (``write`` false but at the end and every PLOT_SECONDS), the child
    renders the static layer when the limits moved, and the last drawing finds it ready: the lines
    and the PNG alone, a few times faster than a whole drawing."""

    def __init__(self):
        self.fig = _figure(figsize=(10, 4))
        a, b = self.fig.subplots(1, 2)
        self.axes = (a, b)
        (self.train,) = a.plot([], [], "o-", label="train")
        (self.test,) = a.plot([], [], "o-", label="test")
        a.set_xlabel("epoch"), a.set_ylabel("cross-entropy"), a.grid(alpha=0.3)
        a.legend(loc="lower left", bbox_to_anchor=(0, 1), ncol=2, frameon=False, borderaxespad=0.2)   # above: static
        (self.accuracy,) = b.plot([], [], "o-", color="C2")
        b.set_xlabel("epoch"), b.set_ylabel("test accuracy (%)"), b.grid(alpha=0.3)
        self.fig.suptitle("LeNet-5 on cuDNN + cuBLAS")
        self.fig.subplots_adjust(left=0.07, right=0.98, bottom=0.12, top=0.88, wspace=0.22)   # tight_layout: +0.1 s
        # At most about five labelled ticks an axis: a drawing's time is mostly its text, and the run's last
        # drawing is waited for (docs/performance.md, "Notes' numbers: writing").
        from matplotlib.ticker import MaxNLocator

        for ax in self.axes:
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]))
        # Drawn over the static layer, in z-order (lines 2, spines 2.5): Note [the last drawing].
        self.dynamic = [self.train, self.test, self.accuracy, *a.spines.values(), *b.spines.values()]
        self.static = None   # (limits, the rendered static layer)

    def _set(self, history: list[dict], epochs: int | None) -> tuple:
        """Move the lines' data and set the axes' limits; returns the limits."""
        import matplotlib

        ep = [h["epoch"] for h in history]
        self.train.set_data(ep, [h["train_loss"] for h in history])
        self.test.set_data(ep, [h["test_loss"] for h in history])
        self.accuracy.set_data(ep, [100 * h["test_accuracy"] for h in history])
        with matplotlib.rc_context({"axes.autolimit_mode": "round_numbers"}):
            for ax in self.axes:
                ax.relim()
                if epochs:
                    ax.set_xlim(0.5, max(epochs, max(ep, default=1)) + 0.5)
                else:
                    ax.set_autoscalex_on(True)
                ax.autoscale_view(scalex=not epochs)
        return tuple((ax.get_xlim(), ax.get_ylim()) for ax in self.axes)

    def prepare(self, history: list[dict], epochs: int | None = None) -> None:
        """Render the static layer for this history's limits, unless it is ready (Note [the last drawing])."""
        limits = self._set(history, epochs)
        if self.static is None or self.static[0] != limits:
            for artist in self.dynamic:
                artist.set_visible(False)
            try:
                self.fig.canvas.draw()
            finally:
                for artist in self.dynamic:
                    artist.set_visible(True)
            self.static = (limits, self.fig.canvas.copy_from_bbox(self.fig.bbox))

    def png(self, history: list[dict], epochs: int | None = None) -> bytes:
        from PIL import Image

        self.prepare(history, epochs)
        canvas = self.fig.canvas
        canvas.restore_region(self.static[1])
        for artist in self.dynamic:
            artist.axes.draw_artist(artist)
        buf = io.BytesIO()   # RGB: the figure is opaque, and RGBA takes longer to encode
        Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba(), "raw", "RGBA", 0, 1).convert(
            "RGB").save(buf, format="png", compress_level=1)   # 6 (the default) doubles the encoding
        return buf.getvalue()


def sweep_png(curves: list[dict], split: str) -> bytes:
    """A sweep's figure (lenet sweep): every model's accuracy per epoch on ``split``, the best drawn out;
    each curve {"label", "accuracy": [fractions], "best": bool}."""
    fig = _figure(figsize=(8, 5))
    ax = fig.subplots()
    for c in sorted(curves, key=lambda c: c.get("best", False)):   # the best last: on top
        ep = list(range(1, len(c["accuracy"]) + 1))
        acc = [100 * a for a in c["accuracy"]]
        if c.get("best"):
            ax.plot(ep, acc, "o-", color="C3", lw=2.2, label=f"best: {c['label']}", zorder=3)
        else:
            ax.plot(ep, acc, "-", color="0.6", lw=0.8, alpha=0.6)
    finals = [100 * c["accuracy"][-1] for c in curves if c["accuracy"]]
    if finals:   # the interesting band: from a little under the median final accuracy to the top
        ax.set_ylim(max(0.0, float(sorted(finals)[len(finals) // 2]) - 4.0), min(100.0, max(finals) + 0.5))
    ax.set_xlabel("epoch"), ax.set_ylabel(f"{split} accuracy (%)"), ax.grid(alpha=0.3)
    ax.set_title(f"lenet sweep: {len(curves)} models")
    if any(c.get("best") for c in curves):
        ax.legend(loc="lower right", fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, pil_kwargs={"compress_level": 1})
    return buf.getvalue()


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
        if _site_bytecode("matplotlib"):   # Note [the plotting child's bytecode]
            env["LENET_BYTECODE_CACHE"] = "off"
        self._proc = None
        with files.starting_child():   # Note [a child started as a signal came] in lenet/files.py
            self._aside = _aside()   # Note [matplotlib's first import aside]
            if self._aside is not None:   # removed however the trainer ends, the child ended first
                files.leftover(self._aside[0], stop=self._end_child)
                env.update({ASIDE_VARIABLE: json.dumps(self._aside), "MPLCONFIGDIR": self._aside[0]})
            self._proc = subprocess.Popen([sys.executable, "-m", "lenet.plot"], stdin=subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, stderr=self._err, text=True, env=env,
                                          start_new_session=True)
        self._broken = False
        self._sent = 0   # the history's records the child has (draw)

    def draw(self, history: list[dict], epochs: int | None = None, write: bool = True) -> None:
        """Ask for a drawing of ``history`` (``epochs``: the run's length, which fixes the x axis);
        ``write`` False: only have it ready, for the next drawing that writes (Note [the last drawing]).
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

    def ready(self) -> None:
        """Tell the child that the trainer's checks passed: matplotlib's import and the figure may begin now,
        not at the first drawing (Note [the child's import once the checks passed]). Never raises."""
        if self._broken:
            return
        try:
            self._proc.stdin.write(json.dumps({"ready": True}) + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):   # gone, or closed (a run that plots nothing): close() says why
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
        self._end_child()   # gone before its temporary folder goes
        self._err.close()
        self._remove_aside()

    def _end_child(self) -> None:
        """The child ended (a stopper of files.leftover: before its temporary folder is removed): killed, and
        waited for, so that nothing of it is still running as the folder goes."""
        if self._proc is not None:
            self._proc.kill()
            try:
                self._proc.wait(2)
            except subprocess.TimeoutExpired:
                pass

    def _remove_aside(self) -> None:
        """The temporary folder of Note [matplotlib's first import aside], once the child is done or ended."""
        if self._aside is not None:
            import shutil

            shutil.rmtree(self._aside[0], ignore_errors=True)

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
        self._remove_aside()
        self._err.seek(0)
        lines = [ln for ln in self._err.read().splitlines() if ln.strip()]
        self._err.close()
        if code == 0:
            return None
        return lines[-1] if lines else (f"it took longer than {timeout:g} s" if code is None else f"exit status {code}")


_early: Plotter | None = None   # started by start_early, until the trainer takes it


def start_early(argv) -> None:
    """Start the plotting child now, its path not yet known, when the command line ``argv`` has --out
    and matplotlib is installed (Note [the plotting child's first run]); ``take_early`` hands it over."""
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
              "\"records\": [...], \"epochs\": ..., \"write\": ...}, and {\"ready\": true} once the trainer's "
              "checks passed; run by lenet.train)", file=sys.stderr)
        return 2
    # Now, while the trainer's GPU works, not when a drawing is due: the import and the figure. The
    # first epoch's ask then renders the static layer (fonts, ticks and the renderer set up: 0.1 s
    # more than a later one). A drawing of made-up curves here, to have that done before any ask,
    # kept the child busy past most of a fast run's epochs, so that the run's last drawing waited for
    # a static layer made late (docs/performance.md, "Notes' numbers: writing").
    aside = json.loads(os.environ.pop(ASIDE_VARIABLE, "null"))   # Note [matplotlib's first import aside]
    if aside is not None:
        _import_matplotlib()   # its folders the trainer's temporary one (MPLCONFIGDIR)
    made = {"curves": Curves() if matplotlib_writes_nothing() else None}   # else once asked, imported once ready
    history, due = [], None   # the records so far; the curve ask to act on once what arrived is read

    def act():
        if due is not None:
            curves = made["curves"] = made["curves"] or Curves()
            if due["write"]:
                files.write_atomic(Path(due["path"]), curves.png(history, due["epochs"]))
            else:
                curves.prepare(history, due["epochs"])

    for asks in _asks(sys.stdin.fileno()):
        files.checks_passed()   # the trainer asks once its checks passed: our writes may begin
        for ask in asks:
            if ask.get("ready"):   # Note [the child's import once the checks passed]
                if aside is not None:   # imported already: its font list kept now
                    _keep_aside(*aside)
                    aside = None
                else:
                    _import_matplotlib()
            elif "sweep" in ask:
                act()
                due = None
                files.write_atomic(Path(ask["path"]), sweep_png(ask["sweep"], ask["split"]))
            else:   # asks that arrived together: one drawing, written if any of them asked to
                history[ask["from"]:] = ask["records"]
                due = {"path": ask["path"], "epochs": ask.get("epochs"),
                       "write": ask.get("write", True) or (due is not None and due["write"])}
        act()
        due = None
    return 0


# Note [the child's import once the checks passed]: where matplotlib's import would write (its font list not
# made yet: a fresh machine or HOME), the child waits for the trainer's checks before it imports it (Note
# [nothing written before the checks] in lenet/files.py). It waited for the first drawing, a fast run's first
# epoch, late in a first run; its import of matplotlib from source and the font list then ended after the
# run's last epoch, which waited for it ("writing" in the run's wall-clock line; docs/performance.md, "Notes'
# numbers: writing"). The trainer sends a ready line once its checks pass (Plotter.ready, from
# files.after_checks, before its plans), and the child imports matplotlib and makes its font list then, while
# the trainer plans (not the figure: a sweep's child draws another).
def _matplotlib_folders() -> tuple[str, str]:
    """(configuration, cache) folders of matplotlib's here: $MPLCONFIGDIR for both, else XDG's or HOME's."""
    mine = os.environ.get("MPLCONFIGDIR")
    home = os.path.expanduser("~")
    config = mine or os.path.join(os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config"), "matplotlib")
    cache = mine or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), "matplotlib")
    return config, cache


def matplotlib_writes_nothing() -> bool:
    """Whether matplotlib's import and a figure would write nothing: its configuration and cache folders are
    there, with its font list (a first import makes them). The child imports it at once then, else aside
    (Note [matplotlib's first import aside]) or once the trainer says its checks passed (the ready line: Note
    [the child's import once the checks passed]; Note [nothing written before the checks] in lenet/files.py: a
    flag error in a fresh HOME made ~/.config/matplotlib)."""
    import glob

    config, cache = _matplotlib_folders()
    return os.path.isdir(config) and bool(glob.glob(os.path.join(glob.escape(cache), "fontlist-v*.json")))


# Note [matplotlib's first import aside]: a first run's child imported matplotlib once the trainer's checks
# passed (Note [the child's import once the checks passed]), and on a fresh machine that import (its font list
# made) ended after a fast run's last epoch: "writing" took 0.82-0.92 s on an H200 machine, the import alone
# 0.89-1.25 s there (docs/performance.md, "Time to accuracy"). So where matplotlib would write and its
# configuration folder holds no settings of the user's (no matplotlibrc), the trainer makes a temporary folder
# of its own and the child imports matplotlib at once with both its folders pointed there (MPLCONFIGDIR):
# nothing of the user's is written before the checks. Once they passed (the ready line) the child writes the
# font list made there into matplotlib's cache folder and makes its configuration folder, as its first import
# would have (``_keep_aside``). The folder is the trainer's leftover (lenet/files.py): however the trainer
# ends, the child is ended first (it might make the folder again) and the folder removed.
ASIDE_VARIABLE = "LENET_PLOT_ASIDE"   # the child's: JSON [the temporary folder, matplotlib's two folders]


def _aside() -> list | None:
    """[a new temporary folder, matplotlib's configuration and cache folders] where a first import aside
    applies (Note [matplotlib's first import aside]), else None."""
    config, cache = _matplotlib_folders()
    if matplotlib_writes_nothing() or os.path.exists(os.path.join(config, "matplotlibrc")):
        return None
    try:
        return [tempfile.mkdtemp(prefix="lenet-matplotlib-"), config, cache]
    except OSError:   # no usable temporary folder: the import waits for the checks
        return None


def _keep_aside(aside: str, config: str, cache: str) -> None:
    """Once the checks passed: the font list made in ``aside`` written into ``cache`` and ``config`` made, as
    matplotlib's first import there would have. A folder that cannot be written costs the next run's import."""
    import glob

    try:
        for src in glob.glob(os.path.join(glob.escape(aside), "fontlist-v*.json")):
            os.makedirs(cache, exist_ok=True)
            with open(src, "rb") as f:
                files.write_atomic(Path(cache) / os.path.basename(src), f.read())
        os.makedirs(config, exist_ok=True)
    except OSError:
        pass


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
    before the checks] in lenet/files.py), and the bytecode cache before matplotlib's import (Note [bytecode
    cache] in lenet/startup.py; Note [the plotting child's bytecode])."""
    from .startup import keep_bytecode

    files.hold_writes()
    keep_bytecode()


if __name__ == "__main__":
    from .cli import leave

    child_start()
    leave(main())   # the trainer waits for this process: no interpreter teardown (Note [fast exit])
