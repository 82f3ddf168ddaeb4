"""Checkpoints, schedules and the training programs' flags, without a GPU."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lenet import checkpoint as ckpt
from lenet import params as P
from lenet.schedule import Schedule

ROOT = Path(__file__).resolve().parents[1]


def test_checkpoint_roundtrip_and_atomic(tmp_path):
    p = tmp_path / "c.npz"
    flat = P.pack(P.init_host(0))
    vel = np.random.default_rng(0).standard_normal(P.TOTAL).astype(np.float32)
    ckpt.save(p, flat, vel, {"epoch": 3, "iteration": 30, "config": {"a": 1}, "history": []})
    a, b, meta = ckpt.load(p)
    assert np.array_equal(a, flat) and np.array_equal(b, vel) and meta["epoch"] == 3
    assert [f.name for f in tmp_path.iterdir()] == ["c.npz"], "no temporary file left behind"
    assert ckpt.state_dict(p)["fc1.weight"].shape == (120, 256)


def test_interrupted_write_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    p = tmp_path / "c.npz"
    flat = P.pack(P.init_host(0))
    ckpt.save(p, flat, flat, {"epoch": 1})
    before = p.read_bytes()

    def boom(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(p, flat * 2, flat, {"epoch": 2})
    assert p.read_bytes() == before and [f.name for f in tmp_path.iterdir()] == ["c.npz"]


@pytest.mark.parametrize("content,msg", [(b"not a zip", "is not a LeNet checkpoint"),
                                         (None, "no such checkpoint")])
def test_bad_checkpoints(tmp_path, content, msg):
    p = tmp_path / "c.npz"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(ckpt.CheckpointError, match=msg):
        ckpt.load(p)


def test_checkpoint_wrong_shape_and_nan(tmp_path):
    p = tmp_path / "c.npz"
    np.savez(p, params=np.zeros(5, np.float32), velocity=np.zeros(5, np.float32), meta=np.array('{"format": 1}'))
    with pytest.raises(ckpt.CheckpointError, match="parameter buffer"):
        ckpt.load(p)
    flat = P.pack(P.init_host(0))
    flat[3] = np.nan
    ckpt.save(p, flat, flat, {})
    with pytest.raises(ckpt.CheckpointError, match="non-finite"):
        ckpt.load(p)


def test_schedules():
    assert Schedule("constant", 0.1).at(999, 10, 100) == 0.1
    s = Schedule("step", 0.1, step_size=2, step_gamma=0.5)
    assert [s.at(i * 10, 10, 100) for i in range(5)] == [0.1, 0.1, 0.05, 0.05, 0.025]
    c = Schedule("cosine", 0.2)
    assert c.at(0, 10, 100) == 0.2 and abs(c.at(50, 10, 100) - 0.1) < 1e-12 and c.at(100, 10, 100) < 1e-12
    i = Schedule("inv", 0.01, gamma=1e-4, power=0.75)
    assert abs(i.at(10000, 1, 1) - 0.01 * 2 ** -0.75) < 1e-15
    with pytest.raises(ValueError, match="unknown schedule"):
        Schedule("linear")


def run(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=120)


def test_train_help_and_errors():
    out = run("lenet.train", "--help")
    assert out.returncode == 0
    for flag in ("--data-dir", "--epochs", "--batch-size", "--lr", "--momentum", "--weight-decay", "--schedule",
                 "--out", "--resume", "--quiet", "--algo", "--deterministic", "--cuda-graph"):
        assert flag in out.stdout
    for args, msg in [(["--schedule", "linear"], "invalid choice: 'linear'"), (["--epochs", "0"], "--epochs"),
                      (["--resume"], "--resume needs a checkpoint path or --out")]:
        out = run("lenet.train", *args)
        assert out.returncode == 2 and msg in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_train_data_cache_flag(tmp_path):
    """The dataset is read (and its gzipped files cached) before the GPU is needed; --no-data-cache
    writes no copy."""
    from test_data_cpu import write_split

    root = tmp_path / "d"
    root.mkdir()
    write_split(root, n=40, gz=True)
    write_split(root, n=20, split="test", gz=True)
    for flags, entries in (["--no-data-cache"], 0), ([], 4):
        cache = tmp_path / f"cache{entries}"
        env_run = subprocess.run([sys.executable, "-m", "lenet.train", "--data-dir", str(root), *flags],
                                 env=dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="",
                                          LENET_DATA_CACHE=str(cache)), capture_output=True, text=True, timeout=120)
        assert env_run.returncode == 2 and "no usable NVIDIA GPU" in env_run.stderr, env_run.stderr
        assert len(list(cache.glob("*.npy")) if cache.exists() else []) == entries


def test_export_and_predict_errors(tmp_path):
    out = run("lenet.export", str(tmp_path / "none.npz"), "--to", str(tmp_path / "m.safetensors"))
    assert out.returncode == 2 and "no such checkpoint" in out.stderr
    out = run("lenet.export", str(tmp_path / "none.npz"), "--to", str(tmp_path / "m.pt"))
    assert out.returncode == 2 and "--to must end in .safetensors or .npz" in out.stderr
    out = run("lenet.predict", "--checkpoint", str(tmp_path / "none.npz"), "x.png")
    assert out.returncode == 2 and "no such checkpoint" in out.stderr


def test_export_safetensors_loads_in_torch(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file
    from torch_lenet import TorchLeNet
    c = tmp_path / "c.npz"
    ckpt.save(c, P.pack(P.init_host(7)), np.zeros(P.TOTAL, np.float32),
              {"epoch": 1, "config": {"mean": 0.1, "std": 0.3, "dataset": "x"}})
    out = run("lenet.export", str(c), "--to", str(tmp_path / "m.safetensors"))
    assert out.returncode == 0, out.stderr
    m = TorchLeNet()
    m.load_state_dict(load_file(tmp_path / "m.safetensors"))
    assert all(np.array_equal(v.numpy(), P.init_host(7)[k]) for k, v in m.state_dict().items())


def test_plotter_draws_in_a_child(tmp_path):
    pytest.importorskip("PIL", minversion="10.1")
    from lenet.plot import Plotter

    history = [{"epoch": e, "train_loss": 1 / e, "test_loss": 1 / e + 0.1, "test_accuracy": 0.8 + e / 100}
               for e in range(1, 4)]
    unwritten = Plotter(tmp_path / "unwritten.png")
    unwritten.draw(history[:2], epochs=3, write=False)   # the records only, not written
    assert unwritten.close() is None and not (tmp_path / "unwritten.png").exists()
    p = Plotter(tmp_path / "curves.png")
    p.draw(history[:2], epochs=3, write=False)
    p.draw(history, epochs=3)   # sends the third record only
    assert p.close() is None
    from PIL import Image

    from lenet.plot import Curves
    assert np.array_equal(np.asarray(Image.open(tmp_path / "curves.png")),
                          np.asarray(Image.open(io.BytesIO(Curves().png(history, 3)))))
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [f.name for f in tmp_path.iterdir()] == ["curves.png"]   # no temporary file left

    bad = Plotter(tmp_path / "missing" / "curves.png")
    bad.draw(history)
    err = bad.close()
    assert err is not None and "missing" in err, err

    early = Plotter()   # started before the path is known (lenet.startup.begin), told it before drawing
    early.path = tmp_path / "later.png"
    early.draw(history)
    assert early.close() is None and (tmp_path / "later.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    unused = Plotter()
    unused.discard()
    assert unused._proc.wait(10) is not None


def test_a_pillow_older_than_10_1_cannot_plot(tmp_path):
    """lenet.plot.can_plot reads Pillow's version from its dist-info folder's name (release candidates and local
    versions too): before 10.1 (no scalable font for lenet/chart.py) a run writes no curves.png, saying so."""
    (tmp_path / "PIL").mkdir()
    (tmp_path / "PIL" / "__init__.py").write_text("")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from lenet.plot import can_plot; print(can_plot())"
    for name, want in (("Pillow-9.5.0", "False"), ("pillow-10.0.1", "False"), ("pillow-10.1.0", "True"),
                       ("pillow-10.1rc1", "True"), ("pillow-13.0.0+local", "True")):
        info = tmp_path / f"{name}.dist-info"
        info.mkdir()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
        info.rmdir()
        assert out.stdout.strip() == want, (name, out.stdout, out.stderr)


def test_the_plotting_child_reads_pillows_own_bytecode(tmp_path, monkeypatch):
    """Note [the plotting child's bytecode] in lenet/plot.py: where Python writes no bytecode and our bytecode
    folder exists, a child whose Pillow was installed with its own bytecode keeps none of ours (our folder
    gets no PIL module); a package without bytecode of its own is told apart from one with it."""
    pytest.importorskip("PIL", minversion="10.1")
    from lenet import plot

    if not plot._site_bytecode("PIL"):
        pytest.skip("this Pillow has no bytecode of its own")
    pkg = tmp_path / "pkgs" / "bare"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    assert not plot._site_bytecode("bare") and not plot._site_bytecode("no_such_package")
    import py_compile

    py_compile.compile(str(pkg / "__init__.py"), cfile=str(pkg / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc"))
    assert plot._site_bytecode("bare")

    ours = tmp_path / "cache" / "lenet" / "bytecode"
    ours.mkdir(parents=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    p = plot.Plotter(tmp_path / "curves.png")
    p.draw([{"epoch": 1, "train_loss": 1.0, "test_loss": 1.1, "test_accuracy": 0.8}], epochs=2)
    assert p.close() is None and (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    kept = [f for f in ours.rglob("*.pyc") if "PIL" in f.parts]
    assert not kept, f"the child compiled Pillow into our folder: {kept[:3]}"


def _pixels(png: bytes):
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)


def _near(pixels, rgb, tol=40):
    """Where a pixel is within ``tol`` of the colour ``rgb`` (each channel)."""
    return (np.abs(pixels - np.array(rgb)) <= tol).all(axis=-1)


def test_the_curves_figure_draws_each_curve_in_its_panel():
    """lenet/chart.py through Curves: 1000 x 400 pixels, the losses' two colours in the left panel only and the
    accuracy's in the right only, the x axis the run's epochs; a diverged run (inf and NaN losses) and a
    history of one epoch draw too, the points that are not finite left out."""
    pytest.importorskip("PIL", minversion="10.1")
    from lenet import chart
    from lenet.plot import Curves

    history = [{"epoch": e, "train_loss": 1 / e ** 0.3, "test_loss": 1.1 / e ** 0.3, "test_accuracy": 0.8 + e / 150}
               for e in range(1, 9)]
    px = _pixels(Curves().png(history, 16))
    assert px.shape == (400, 1000, 3)
    left, right = px[:, :500], px[:, 500:]
    for colour, panel, other in (("C0", left, right), ("C1", left, right), ("C2", right, left)):
        assert _near(panel, chart.COLORS[colour]).sum() > 200, colour
        assert _near(other, chart.COLORS[colour]).sum() == 0, colour
    # the run's 16 epochs fix the x axis: eight epochs reach about halfway across the left panel
    cols = np.nonzero(_near(left, chart.COLORS["C0"]).any(axis=0))[0]
    assert 0.45 < (cols.max() - 70) / (480 - 70) < 0.6, cols.max()

    diverged = [dict(h) for h in history]
    diverged[5]["train_loss"], diverged[6]["train_loss"], diverged[7]["test_loss"] = float("inf"), float("nan"), 1e30
    assert _pixels(Curves().png(diverged, 16)).shape == (400, 1000, 3)
    one = _pixels(Curves().png(history[:1]))
    assert _near(one, chart.COLORS["C2"]).sum() > 20   # a marker, no line
    # the first and last accuracies drawn whole where they fall on ticks (80 .. 85: the frame cut them in half
    # with no margin)
    on_ticks = [dict(h, test_accuracy=0.80 + 0.05 * (h["epoch"] - 1) / 7) for h in history]
    acc = _near(_pixels(Curves().png(on_ticks, 8))[:, 500:], chart.COLORS["C2"])
    rows = np.nonzero(acc.any(axis=1))[0]
    assert rows.min() > 0.12 * 400 + 3 and rows.max() < 0.88 * 400 - 3, (rows.min(), rows.max())
    flat = [{"epoch": 1, "train_loss": 1e-13, "test_loss": 3e-13, "test_accuracy": 1.0}]   # no range to speak of
    assert _pixels(Curves().png(flat, 2)).shape == (400, 1000, 3)
    far = [dict(h) for h in history]
    far[3]["test_loss"] = 1.7e308   # a segment to a point far outside, cut to the panel
    assert _near(_pixels(Curves().png(far, 16))[:, :500], chart.COLORS["C1"]).sum() > 200


def test_ticks_are_round_steps_that_span_the_range():
    from lenet.chart import label, ticks

    assert ticks(0.43, 1.1) == [0.4, 0.6, 0.8, 1.0, 1.2]
    assert ticks(80.6, 90.7) == [80.0, 82.5, 85.0, 87.5, 90.0, 92.5]
    assert ticks(0.5, 16.5, integer=True) == [0, 5, 10, 15, 20]
    assert ticks(0.5, 2.5, integer=True) == [0, 1, 2, 3]
    assert ticks(3.0, 3.0) == ticks(2.85, 3.15)   # one value: widened around it
    for lo, hi in ((0.0, 1e-7), (-3.2, 7.9), (1e6, 1e6 + 3), (91.2, 91.9)):
        t = ticks(lo, hi)
        steps = {round(b - a, 12) for a, b in zip(t, t[1:])}
        assert t[0] <= lo and t[-1] >= hi and len(t) <= 6 and len(steps) == 1, (lo, hi, t)
    assert [label(v, 2.5) for v in (80.0, 82.5)] == ["80.0", "82.5"]
    assert [label(v, 0.25) for v in (0.5, 0.75)] == ["0.50", "0.75"] and label(10.0, 5.0) == "10"
    assert label(2e30, 1e30) == "2e+30" and label(3e-6, 1e-6) == "0.000003" and label(3e-7, 1e-7) == "3e-07"
    for lo, hi, integer in ((0.25101, 0.25119, False), (1e6, 1e6 + 3, False), (1e-13, 3e-13, False),
                            (2.0, 1.0, False), (0.5, 0.52, True), (0.0, 1e-323, False), (0.0, 1.7e308, False)):
        t = ticks(lo, hi, integer=integer)   # close, huge, tiny, reversed: each tick its own text, finite
        texts = [label(v, t[1] - t[0]) for v in t]
        assert len(set(texts)) == len(t) > 1 and all(map(np.isfinite, t)), (lo, hi, texts)
    with pytest.raises(ValueError, match="not finite"):
        ticks(0.0, float("inf"))


def test_a_sweeps_figure_draws_the_best_over_the_rest():
    pytest.importorskip("PIL", minversion="10.1")
    from lenet import chart
    from lenet.plot import sweep_png

    curves = [{"label": f"seed {k}", "accuracy": [0.8 + 0.01 * e + 0.002 * k for e in range(8)], "best": k == 3}
              for k in range(5)]
    px = _pixels(sweep_png(curves, "validation"))
    assert px.shape == (500, 800, 3)
    inside = px[55:400, 85:770]   # the panel, above its legend: no text
    assert _near(inside, chart.COLORS["C3"], 30).sum() > 300 and _near(inside, chart.COLORS["gray"], 40).sum() > 300
    assert _near(_pixels(sweep_png([dict(c, best=False) for c in curves], "test")), chart.COLORS["C3"], 30).sum() == 0
    assert _pixels(sweep_png([], "test")).shape == (500, 800, 3)
    assert _pixels(sweep_png([{"label": "a", "accuracy": []}], "test")).shape == (500, 800, 3)
    # the legend over the lines: grey curves through the lower right leave its box white behind the text
    # the legend over the lines: grey curves level with it (75.7% on an axis of 75 .. 95) leave it as it is
    # without them, and show beside it
    rest = [{"label": "best", "accuracy": [0.9] * 8, "best": True}] + \
        [{"label": f"seed {k}", "accuracy": [0.8] * 8, "best": False} for k in range(20)]
    low = [{"label": f"low {k}", "accuracy": [0.9] * 5 + [0.757] * 3, "best": False} for k in range(10)]
    with_low, without = _pixels(sweep_png(rest + low, "test")), _pixels(sweep_png(rest, "test"))
    assert not np.array_equal(with_low[430:442, 560:660], without[430:442, 560:660])
    assert np.array_equal(with_low[428:444, 685:772], without[428:444, 685:772])


def test_the_plotting_child_reads_what_waits_at_once():
    """The child reads every ask that arrived while it drew before it draws again (lenet.plot._asks):
    one drawing for all of them (lenet.plot.main)."""
    from lenet.plot import _asks

    r, w = os.pipe()
    lines = [{"from": 0, "records": [1]}, {"from": 1, "records": [2]}, {"sweep": [], "split": "test"}]
    os.write(w, "".join(json.dumps(x) + "\n" for x in lines).encode())
    os.close(w)
    got = list(_asks(r))
    os.close(r)
    assert got == [lines]


def test_train_starts_its_plotting_child_before_its_imports(tmp_path):
    """python -m lenet.train with --out starts the plotting child in lenet.startup.begin, before the
    flags are parsed, and the run takes that child (Note [the plotting child's first run]); without
    --out none is started."""
    pytest.importorskip("PIL", minversion="10.1")
    code = ("from lenet import plot, startup; startup.begin(then=plot.start_early); p = plot.take_early(); "
            "print(type(p).__name__, p is not None and p.path is None); p and p.discard()")
    for argv, want in ((["--out", str(tmp_path / "o")], "Plotter True"), ([f"--out={tmp_path / 'o'}"], "Plotter True"),
                       (["--epochs", "1"], "NoneType False"), (["--out", "x", "--help"], "NoneType False")):
        out = subprocess.run([sys.executable, "-c", code, *argv], env=dict(os.environ, PYTHONPATH=str(ROOT),
                             CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.split("\n")[0] == want, (argv, out.stdout, out.stderr)


def test_one_table_of_run_settings_covers_every_flag():
    # A flag is a run setting (stored, checked on --resume) or named as not one: a new flag that is
    # neither fails here, and the stored configuration, the resume keys and the older checkpoints'
    # defaults all come from the one table.
    from lenet import train
    dests = {a.dest for a in train.parser()._actions}
    settings, others = set(train.RUN_SETTINGS), set(train.NOT_RUN_SETTINGS)
    assert not settings & others and dests == settings | others, \
        (sorted(dests - settings - others), sorted((settings | others) - dests))
    args = train.parser().parse_args(["--epochs", "3", "--flip"])
    config = train.config_of(args, Path("/x/fashion-mnist"), 100, "f" * 32)
    assert set(config) == settings | {"dataset", "data_fingerprint", "data_dir", "train_size"}
    assert config["epochs"] == 3 and config["flip"] is True and config["train_size"] == 100
    assert set(train.RESUME_KEYS) - {"dataset", "train_size"} == {k for k, v in train.RUN_SETTINGS.items() if v.resume}
    assert train.RECIPE_OFF == {"nesterov": False, "label_smoothing": 0.0, "warmup_epochs": 0.0, "ema": None,
                                "shift": 0, "flip": False, "tta": False, "cutout": 0}


_SIGNAL_IN_POPEN = """
import os, signal, sys, time
sys.argv = ["lenet/train.py", "--out", sys.argv[1]]
from lenet import interrupt, files, plot
interrupt.guard("lenet train")   # as a program's first line
files.hold_writes()
files.library_caches()
real = plot.subprocess.Popen


class SignalledPopen(real):   # the signal's thread acts while the main thread is still inside Popen.__init__
    def __init__(self, *a, **k):
        super().__init__(*a, **k)   # the child exists now
        print(self.pid, flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)


plot.subprocess.Popen = SignalledPopen
plot.start_early(sys.argv[1:])
time.sleep(10)
"""


def test_a_signal_as_the_plotting_child_starts_leaves_no_child_and_no_folder(tmp_path):
    """Note [a child started as a signal came] in lenet/files.py: a SIGINT handled while the plotting child's
    Popen has not returned leaves no child running and nothing written in TMPDIR or HOME (the child, in a
    session of its own, had lived on and made its folder again, when it drew with matplotlib)."""
    pytest.importorskip("PIL", minversion="10.1")
    import time

    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")}
    p = subprocess.run([sys.executable, "-c", _SIGNAL_IN_POPEN, str(tmp_path / "o")], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env={**env, "HOME": str(home), "TMPDIR": str(tmp)})
    assert p.returncode == 130 and "interrupted by SIGINT" in p.stderr, (p.returncode, p.stderr)
    child = int(p.stdout.split()[0])
    time.sleep(2.0)   # what a child still running would have written by now
    try:
        os.kill(child, 0)
        alive = not open(f"/proc/{child}/stat").read().split()[2] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        alive = False
    assert not alive, "the plotting child outlived the interrupted trainer"
    assert not list(tmp.rglob("*")) and not list(home.rglob("*")), (list(tmp.rglob("*")), list(home.rglob("*")))


@pytest.mark.parametrize("batch,eval_batch,train_n,test_n,want", [
    (128, 1000, 60000, 10000, (1000, (128, 96), (1000,))),   # the fast recipe on Fashion-MNIST
    (64, 1000, 60000, 10000, (1000, (64, 32), (1000,))),
    (100, 100, 1000, 500, (100, (100,), ())),                 # every batch whole: the evaluation's is a step's
    (1000000, 1000, 200, 20, (200, (200,), (20,))),           # a batch past its split: the split
    (7, 3, 40, 20, (7, (7, 5), (3, 2))),
    (8, 5, 40, 20, (8, (8,), (5,))),
    (8, 8, 44, 20, (8, (8, 4), ())),                          # the test split's last batch is a step's size
])
def test_the_run_plans_every_batch_size_it_steps_or_evaluates_at(batch, eval_batch, train_n, test_n, want):
    """What Trainer plans, and what the preload thread plans from the headers' counts (Note [the model beside
    the data] in lenet/train.py): max_batch, then each size a step runs once, then each size only an evaluation
    runs (planned forward only: Note [forward-only plans] in lenet/ops.py)."""
    from lenet import train

    args = train.parser().parse_args(["--batch-size", str(batch), "--eval-batch-size", str(eval_batch)])
    assert train.run_shape(args, train_n, test_n) == want


def test_the_batch_sizes_a_run_plans_are_its_steps_and_evaluations_each_once():
    """lenet.schedule.batch_sizes, which a lone run (train.run_shape) and a sweep's pack (lenet.pack.Pack) plan:
    the model's size; the epoch's batch and its last, each once; the evaluation's and its last, each once and
    none that a step has (a batch past its split is the whole split)."""
    import itertools

    from lenet.schedule import batch_sizes

    for batch, eval_batch, train_n, test_n in itertools.product((1, 7, 96, 150, 10**6), (5, 1000, 10**6),
                                                                (40, 60000), (20, 10000)):
        most, steps, evals = batch_sizes(batch, train_n, eval_batch, test_n)
        B, E = min(batch, train_n), min(eval_batch, test_n)
        assert most == max(B, E)
        assert set(steps) == {B, train_n - (-(-train_n // B) - 1) * B} and steps[0] == B
        assert set(evals) == {E, test_n % E or E} - set(steps)
        assert len(set(steps)) == len(steps) and len(set(evals)) == len(evals)


# Two runs of train.main in one process, build_model and the GPU faked: the first stops at a check after its
# model was made beside the data (--out holds another run), the second runs with another seed.
_TWO_RUNS = """
import json, sys, threading
from pathlib import Path
root, out = sys.argv[1], sys.argv[2]
from lenet import startup, train
import descriptors

made, got = [], []


def build_model(args, policy, shape):
    made.append([args.seed, threading.current_thread().name])
    return ["made for seed", args.seed]


train.build_model = build_model


class Trainer:   # the real Trainer's first step: the model made beside the data, if it was made for this run
    def __init__(self, args, run, policy, argv):
        shape = train.run_shape(args, len(run["train"][0]), len(run["test"][0]))
        got.append(startup.built(train.early_key(args, shape)))
        raise SystemExit(0)


train.Trainer, descriptors.require_gpu = Trainer, lambda: "a GPU"
try:
    train.main(["--data-dir", root, "--seed", "1", "--out", out, "--epochs", "1"])
except Exception as e:
    got.append(type(e).__name__)
try:
    train.main(["--data-dir", root, "--seed", "2", "--epochs", "1"])
except SystemExit:
    pass
print(json.dumps({"made": made, "got": got}))
"""


@pytest.mark.stack
def test_a_model_made_beside_the_data_serves_only_the_run_it_was_made_for(dataset, tmp_path):
    """Note [the model beside the data]: the model made on the preload thread for a run that then stopped at a
    check is never handed to the next run in the process (another seed), which makes its own (the start-up
    threads run once a process)."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")   # an earlier run's folder: the first run stops there
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", _TWO_RUNS, str(dataset), str(out)], env=env, capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"made": [[1, "lenet-imports"]],
                                                             "got": ["OutputError", None]}, r.stdout
