"""A careless or hostile user's inputs, each of a kind: a pipe, a symlink loop or a link to nothing where a file
is read or written, an output that exists, a name holding a newline or bad bytes, a flag that expands a list
without bound, a stored file of the wrong structure, a storage that must not be made. Each is one line
naming the flag or file and what is allowed (a leading warning line allowed), exit status 2, within seconds,
and nothing written that was not asked for (lenet/files.py: Notes [nothing written before the checks],
[atomic writes]; lenet/sweep.py, lenet/study.py: Note [a storage checked, then made])."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lenet import checkpoint as ckpt
from lenet import params as P

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = "no usable NVIDIA GPU"


def _gpu_here() -> bool:
    try:
        from descriptors import gpu_status

        return gpu_status()[0]
    except Exception:   # noqa: BLE001
        return False


def _checkpoint(path, velocity=None):
    ckpt.save(path, P.pack(P.init_host(0)), np.zeros(P.TOTAL, np.float32) if velocity is None else velocity,
              {"epoch": 1, "iteration": 5, "step": 0, "running_loss": 0.0, "history": [],
               "config": {"mean": 0.1, "std": 0.3, "dataset": "x"}})
    return path


def _listing(folder: Path) -> set:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")} if folder.exists() else set()


def lenet(work: Path, *args, env=None, timeout=30):
    """`python -m lenet ARGS` in ``work`` with a HOME and TMPDIR of its own (work/home, work/tmp) and no cache
    variable set (each cache in its default place under that HOME): (exit status, stderr's lines, what it made
    in HOME, in TMPDIR and in ``work``)."""
    home, tmp = work / "home", work / "tmp"
    home.mkdir(exist_ok=True)
    tmp.mkdir(exist_ok=True)
    before = _listing(work)
    e = {k: v for k, v in os.environ.items() if k not in (
        "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "CUPY_CACHE_DIR", "MPLCONFIGDIR", "LENET_DATA_CACHE", "LENET_DATA",
        "LENET_PLAN_CACHE", "LENET_BYTECODE_CACHE", "CUDA_CACHE_PATH")}
    e.update(HOME=str(home), TMPDIR=str(tmp), PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1", **(env or {}))
    t = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-m", "lenet", *[os.fsencode(str(a)) for a in args]], cwd=work, env=e,
                             capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"lenet {' '.join(map(str, args))}: no exit within {timeout} s")
    err = out.stderr.decode(errors="replace")
    lines = [x for x in err.splitlines() if x.strip()]
    made = sorted(_listing(work) - before)
    return out.returncode, lines, err, made, time.monotonic() - t


def one_line(code, lines, err) -> str:
    assert "Traceback" not in err, err
    assert code == 2 and 1 <= len(lines) <= 2 and (len(lines) == 1 or lines[0].startswith("warning:")), (code, err)
    return lines[-1]


@pytest.fixture
def work(tmp_path, dataset):
    (tmp_path / "DATA").symlink_to(dataset)   # the argument DATA names the dataset
    return tmp_path


def fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def loop(path: Path) -> Path:
    path.symlink_to(path.name)
    return path


def _sweep_json(work: Path, flags) -> None:
    from lenet import data, sweep

    a = sweep.parser().parse_args(["--data-dir", str(work / "DATA"), *flags])
    a.validation = sweep.validation_size(a, 40, len(sweep.grid(a)))   # as prepare() settles it (Note [the ranked split])
    (work / "s").mkdir(exist_ok=True)
    (work / "s" / "sweep.json").write_text(json.dumps(sweep.settings_of(a, data.fingerprint(work / "DATA", None),
                                                                        40 - a.validation, 20)))


RESUME = ["sweep", "--data-dir", "DATA", "--out", "s", "--epochs", "1", "--resume"]
OPTUNA = ["sweep", "--data-dir", "DATA", "--search", "optuna", "--trials", "4"]


def _case_dump_existing(w):
    (w / "x.npz").write_bytes(b"precious")
    return ["train-step", "--synthetic", "--dump", "x.npz"], "exists; replace it with --overwrite"


def _case_dump_checkpoint(w):
    _checkpoint(w / "checkpoint.npz")
    return ["train-step", "--synthetic", "--dump", "checkpoint.npz", "--overwrite"], "is a run's checkpoint"


def _case_dump_loop(w):
    loop(w / "l.npz")
    return ["train-step", "--synthetic", "--dump", "l.npz"], "--dump l.npz is a symlink loop"


def _case_dump_fifo(w):
    fifo(w / "f.npz")
    return ["train-step", "--synthetic", "--dump", "f.npz"], "--dump f.npz is a pipe"


def _case_storage_fifo(w):
    fifo(w / "f.log")
    return OPTUNA + ["--lr", "0.1:0.2", "--storage", "f.log"], "--storage f.log is a pipe"


def _case_labels_fifo(w):
    _checkpoint(w / "c.npz")
    fifo(w / "f")
    return ["predict", "--checkpoint", "c.npz", "DATA/t10k-images-idx3-ubyte", "--labels", "f"], "--labels f is a pipe"


def _resume_fifo(name):
    def case(w):
        _sweep_json(w, ["--out", "s", "--epochs", "1"])
        fifo(w / "s" / name)
        return RESUME, f"{name} is a pipe"
    return case


def _case_seeds(w):
    return ["sweep", "--data-dir", "DATA", "--seeds", "0-99999999"], "at most 10,000"


def _case_grid(w):
    many = [str(v / 100) for v in range(1, 11)]
    return ["sweep", "--data-dir", "DATA", "--lr", *many, "--weight-decay", *many, "--label-smoothing", *many,
            "--momentum", *many, "--warmup-epochs", *many, "0.15"], "combinations"


def _case_export_to_loop(w):
    _checkpoint(w / "c.npz")
    loop(w / "l.npz")
    return ["export", "c.npz", "--to", "l.npz"], "--to l.npz is a symlink loop"


def _case_export_from_loop(w):
    loop(w / "l.npz")
    return ["export", "l.npz", "--to", "m.npz"], "l.npz is a symlink loop"


def _settings(content):
    def case(w):
        _sweep_json(w, ["--out", "s", "--epochs", "1"])
        (w / "s" / "sweep.json").write_text(content)
        return RESUME, "is not a sweep's settings file"
    return case


def _case_garbage_journal(w):
    (w / "g.log").write_bytes(b"\xf5\xff garbage\n\x00")
    return OPTUNA + ["--lr", "0.1:0.2", "--storage", "g.log"], "--storage g.log: line 1 is not an entry of Optuna"


def _case_optuna_shift(w):
    return OPTUNA + ["--shift", "0:14"], "--shift 14: must be an integer from 0 to 13"


def _case_nan_velocity(w):
    v = np.zeros(P.TOTAL, np.float32)
    v[7] = np.nan
    _checkpoint(w / "c.npz", v)
    return ["train", "--quiet", "--data-dir", "DATA", "--resume", "c.npz"], "non-finite values"


def _case_pack_length(w):
    from lenet.pack import Config

    _sweep_json(w, ["--out", "s", "--epochs", "1"])
    state = {"configs": [Config(epochs=1).as_dict()], "done": [False], "step": 1, "running": [0.0],
             "history": [{"accuracy": [], "loss": [], "train_loss": [], "seconds": 0.0}]}
    np.savez(w / "s" / "pack.npz", params=np.zeros(7, np.float32), velocity=np.zeros(7, np.float32),
             ema=np.zeros(7, np.float32), state=np.array(json.dumps(state)))
    return RESUME, "is not the state of a pack in flight (its params are not 34880 finite numbers"


def _case_results_row(w):
    _sweep_json(w, ["--out", "s", "--epochs", "1"])
    (w / "s" / "results.jsonl").write_text('{"trial": 0}\n[1]\n')
    return RESUME, "results.jsonl line 1 is not a model's row"


NL = "a\nb"


def _newline(make, args, needle):
    def case(w):
        make(w)
        return args, needle
    return case


def _nl_file(name):
    return lambda w: (w / name).write_bytes(b"x")


def _nl_data(w):
    from test_data_cpu import write_split

    (w / NL).mkdir()
    write_split(w / NL, n=4)
    write_split(w / NL, n=4, split="test")
    (w / NL / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x05ab")


def _with_checkpoint(make=None):
    def f(w):
        _checkpoint(w / "c.npz")
        if make:
            make(w)
    return f


def _case_fifo_lenet_data(w):
    fifo(w / "d")
    return ["train", "--quiet", {"LENET_DATA": str(w / "d")}], "$LENET_DATA"


def _case_png_zeros(w):
    _checkpoint(w / "c.npz")
    (w / "p.png").write_bytes(b"\x00\x00\x00\x00 not a picture")
    return ["predict", "--checkpoint", "c.npz", "p.png"], "p.png: not a readable picture"


def _case_dash(w):
    _checkpoint(w / "c.npz")
    (w / "-dash.png").write_bytes(b"x")
    return ["predict", "--checkpoint", "c.npz", "-dash.png"], "./-dash.png"


def _case_nested_meta(w):
    np.savez(w / "c.npz", params=np.zeros(P.TOTAL, np.float32), velocity=np.zeros(P.TOTAL, np.float32),
             meta=np.array("[" * 100000 + "]" * 100000))
    return ["export", "c.npz", "--to", "m.npz"], "c.npz is not a LeNet checkpoint"


def _case_absurd_npz_header(w):
    import io
    import zipfile

    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False, "shape": (10**12,)})
    meta = io.BytesIO()
    np.save(meta, np.array(json.dumps({"format": 1})))
    with zipfile.ZipFile(w / "c.npz", "w") as z:
        for name in ("params", "velocity"):
            z.writestr(f"{name}.npy", head.getvalue())
        z.writestr("meta.npy", meta.getvalue())
    return ["train", "--quiet", "--data-dir", "DATA", "--resume", "c.npz"], "its params declares 4,000,000,000,000 bytes"


CASES = {
    "a checkpoint whose record is nested too deeply": _case_nested_meta,
    "a checkpoint whose array header declares 10**12 numbers": _case_absurd_npz_header,
    "--study ''": _newline(lambda w: None, OPTUNA + ["--lr", "0.1:0.2", "--study", ""], "--study '': give a name"),
    "train-step --dump over an existing file": _case_dump_existing,
    "train-step --dump over a run's checkpoint, --overwrite or not": _case_dump_checkpoint,
    "--dump a symlink loop": _case_dump_loop,
    "--dump a pipe": _case_dump_fifo,
    "--storage a pipe": _case_storage_fifo,
    "--labels a pipe": _case_labels_fifo,
    "--resume with sweep.json a pipe": _resume_fifo("sweep.json"),
    "--resume with results.jsonl a pipe": _resume_fifo("results.jsonl"),
    "--resume with pack.npz a pipe": _resume_fifo("pack.npz"),
    "--seeds 0-99999999": _case_seeds,
    "a grid of 110,000 combinations": _case_grid,
    "export --to a symlink loop": _case_export_to_loop,
    "export from a symlink loop": _case_export_from_loop,
    "sweep.json holds [1,2]": _settings("[1, 2]"),
    "sweep.json holds null": _settings("null"),
    "sweep.json holds a string": _settings('"x"'),
    "sweep.json an object without the settings": _settings('{"grid": 1}'),
    "a journal of garbage": _case_garbage_journal,
    "--search optuna --shift 0:14": _case_optuna_shift,
    "a checkpoint whose momentum is NaN": _case_nan_velocity,
    "pack.npz with arrays of the wrong length": _case_pack_length,
    "results.jsonl with a row that is not one": _case_results_row,
    "export --to a name with a newline": _newline(lambda w: (_checkpoint(w / "c.npz"), (w / f"{NL}.npz").write_bytes(b"x")),
                                                  ["export", "c.npz", "--to", f"{NL}.npz"], "--to a\\nb.npz exists"),
    "--resume a name with a newline": _newline(lambda w: None, ["train", "--quiet", "--data-dir", "DATA", "--resume", NL],
                                               "--resume a\\nb: no such checkpoint"),
    "export's checkpoint a name with a newline": _newline(lambda w: None, ["export", f"{NL}.npz", "--to", "m.npz"],
                                                          "a\\nb.npz: no such checkpoint"),
    "predict's input a name with a newline": _newline(_with_checkpoint(), ["predict", "--checkpoint", "c.npz",
                                                                           f"{NL}.png"], "a\\nb.png: no such"),
    "--labels a name with a newline": _newline(_with_checkpoint(), ["predict", "--checkpoint", "c.npz",
                                                                    "DATA/t10k-images-idx3-ubyte", "--labels", NL],
                                               "--labels a\\nb: no such"),
    "--out a file named with a newline": _newline(_nl_file(NL), ["train", "--quiet", "--data-dir", "DATA", "--out", NL],
                                                  "--out a\\nb is a file"),
    "--data-dir named with a newline, a bad file in it": _newline(_nl_data, ["train", "--quiet", "--data-dir", NL],
                                                                  "a\\nb/train-labels-idx1-ubyte: truncated"),
    "--dump a folder named with a newline": _newline(lambda w: (w / NL).mkdir(),
                                                     ["train-step", "--synthetic", "--dump", NL], "--dump a\\nb is a folder"),
    "--data-dir a symlink loop": _newline(lambda w: loop(w / "loop"), ["train", "--quiet", "--data-dir", "loop"],
                                          "--data-dir loop is a symlink loop"),
    "--data-dir a link to nothing": _newline(lambda w: (w / "dang").symlink_to("nowhere"),
                                             ["train", "--quiet", "--data-dir", "dang"], "is a link to nowhere"),
    "--resume a symlink loop": _newline(lambda w: loop(w / "loop"),
                                        ["train", "--quiet", "--data-dir", "DATA", "--resume", "loop"],
                                        "--resume loop is a symlink loop"),
    "--checkpoint a link to nothing": _newline(lambda w: (w / "dang").symlink_to("nowhere"),
                                               ["predict", "--checkpoint", "dang", "DATA/t10k-images-idx3-ubyte"],
                                               "--checkpoint dang is a link to nowhere"),
    "predict's input a symlink loop": _newline(_with_checkpoint(lambda w: loop(w / "loop.png")),
                                               ["predict", "--checkpoint", "c.npz", "loop.png"],
                                               "loop.png is a symlink loop"),
    "$LENET_DATA a pipe": _case_fifo_lenet_data,
    "a .png whose bytes start 00 00": _case_png_zeros,
    "--data-dir ''": _newline(lambda w: None, ["train", "--quiet", "--data-dir", ""], "--data-dir is empty"),
    "--storage ''": _newline(lambda w: None, OPTUNA + ["--lr", "0.1:0.2", "--storage", ""], "--storage is empty"),
    "a name of bad bytes": _newline(lambda w: None, ["export", "bad-\udcff.npz", "--to", "m.npz"], "bad-\\xff.npz"),
    "--lr 0.1:0.2:0.3": _newline(lambda w: None, OPTUNA + ["--lr", "0.1:0.2:0.3"], "'0.1:0.2:0.3': a range is"),
    "--shift 14 in a grid": _newline(lambda w: None, ["sweep", "--data-dir", "DATA", "--shift", "14"], "--shift 14:"),
    "--cutout -1:4 in a study": _newline(lambda w: None, OPTUNA + ["--cutout", "-1:4"],
                                         "--cutout: invalid range '-1:4': LOW:HIGH, each must be an integer >= 0"),
    "--lr -0.1 0.1 in a grid": _newline(lambda w: None, ["sweep", "--data-dir", "DATA", "--lr", "-0.1", "0.1"],
                                        "--lr: invalid value '-0.1': must be a finite number >= 0"),
    "--gpus over a grid of two epoch counts": _newline(
        lambda w: None, ["sweep", "--data-dir", "DATA", "--gpus", "all", "--epochs", "10", "20", "--out", "o"],
        "--gpus spreads one Optuna study over the GPUs: add --search optuna"),
    "--cutout 29 in a grid": _newline(lambda w: None, ["sweep", "--data-dir", "DATA", "--cutout", "29"],
                                      "--cutout 29: must be an integer from 0 to 28"),
    "train --cutout 29": _newline(lambda w: None, ["train", "--data-dir", "DATA", "--cutout", "29"],
                                  "argument --cutout: invalid value '29': must be an integer from 0 to 28 pixels"),
    "train --shift -1": _newline(lambda w: None, ["train", "--data-dir", "DATA", "--shift", "-1"],
                                 "argument --shift: invalid value '-1': must be an integer from 0 to 13 pixels"),
    "--warmup-epochs 50 in a grid": _newline(lambda w: None, ["sweep", "--data-dir", "DATA", "--warmup-epochs", "50"],
                                             "--warmup-epochs 50 is longer than the run (--epochs 16)"),
    "lenet bogus": _newline(lambda w: None, ["bogus"], "unknown program 'bogus'"),
    "lenet ''": _newline(lambda w: None, [""], "the program's name is empty"),
    "lenet -x": _newline(lambda w: None, ["-x"], "unknown program '-x'"),
    "lenet TRAIN": _newline(lambda w: None, ["TRAIN"], "unknown program 'TRAIN'"),
    "predict -dash.png": _case_dash,
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_careless_input_is_one_line_before_the_gpu_and_writes_nothing(work, name):
    args, needle = CASES[name](work)
    env = {}
    for a in list(args):
        if isinstance(a, dict):
            env.update(a)
            args.remove(a)
    kept = {p: p.read_bytes() for p in work.iterdir() if p.is_file() and not p.is_symlink()}
    code, lines, err, made, seconds = lenet(work, *args, env=env)
    line = one_line(code, lines, err)
    assert needle in line and NO_GPU not in line, (needle, line)
    assert not made, f"wrote {made}"
    assert all(p.read_bytes() == b for p, b in kept.items()), "a file was changed"
    assert seconds < 20, seconds


@pytest.mark.parametrize("args", [
    ["--lr", "0.1:0.2", "--storage", "s.log"],
    ["--lr", "0.1:0.2", "--storage", "sqlite:///s.db"],
    ["--ema", "0.9:0.999", "--lr", "0.1", "0.2"],
])
def test_a_storage_is_made_only_once_every_check_passed_and_the_gpu_is_there(work, args):
    if _gpu_here():
        pytest.skip("with a GPU the sweep runs (tests/test_sweep_gpu.py)")
    code, lines, err, made, _ = lenet(work, *OPTUNA, *args)
    line = one_line(code, lines, err)
    assert NO_GPU in line, line
    assert not any(m.endswith((".log", ".db")) for m in made), made


def test_a_study_made_with_other_flags_names_the_flag_and_is_left_as_it_was(work):
    optuna = pytest.importorskip("optuna")
    from optuna.storages.journal import JournalFileBackend

    from lenet import data, sweep
    from lenet.study import STUDY_KEYS

    a = sweep.parser().parse_args(["--data-dir", str(work / "DATA"), *OPTUNA[3:], "--lr", "0.1:0.2"])
    s = sweep.settings_of(a, data.fingerprint(work / "DATA", None), 40, 20)
    st = optuna.storages.JournalStorage(JournalFileBackend(str(work / "s.log")))
    optuna.create_study(study_name="lenet-sweep", storage=st).set_user_attr("lenet", {k: s.get(k) for k in STUDY_KEYS})
    before = (work / "s.log").read_bytes()
    code, lines, err, made, _ = lenet(work, *OPTUNA, "--lr", "0.1:0.3", "--storage", "s.log")
    line = one_line(code, lines, err)
    assert "--lr [[0.1, 0.2]] there, [[0.1, 0.3]] here" in line and len(line) < 300, line
    assert (work / "s.log").read_bytes() == before


def test_the_data_caches_index_a_pipe_is_never_read(work, tmp_path):
    from test_data_cpu import write_split

    gz = tmp_path / "gz"
    gz.mkdir()
    write_split(gz, n=40, gz=True)
    write_split(gz, n=20, split="test", gz=True)
    (tmp_path / "dc").mkdir()
    fifo(tmp_path / "dc" / "index.json")
    code, lines, err, _, _ = lenet(work, "train", "--quiet", "--data-dir", gz, "--epochs", "1",
                                   env={"LENET_DATA_CACHE": str(tmp_path / "dc")})
    if not _gpu_here():
        assert NO_GPU in one_line(code, lines, err)


@pytest.mark.parametrize("program", [["train", "--out", "o", "--lr", "bogus"], ["sweep", "--out", "o", "--seeds", "x"],
                                     ["train-step", "--steps", "0"], ["predict", "--checkpoint", "nowhere", "x.png"]])
def test_a_flag_error_in_a_fresh_home_writes_nothing_anywhere(work, program):
    code, lines, err, made, _ = lenet(work, *program)
    one_line(code, lines, err)
    assert not made, made   # no ~/.cupy/kernel_cache, ~/.cache/lenet/bytecode, no file in TMPDIR


def test_names_in_messages_are_escaped_on_one_line():
    from lenet.files import escaped, show

    assert escaped("a\nb\tc\x1b\udcff") == "a\\nb\\tc\\x1b\\xff"
    assert show("x" * 300).endswith("(300 characters)") and "\n" not in show("a\nb")


def test_what_is_names_every_kind_of_path_without_opening_it(tmp_path):
    from lenet.files import what_is

    fifo(tmp_path / "f")
    loop(tmp_path / "l")
    (tmp_path / "d").symlink_to("nowhere")
    (tmp_path / "r").write_text("x")
    kinds = {n: what_is(tmp_path / n)[0] for n in ("f", "l", "d", "r", "missing")}
    assert kinds == {"f": "special", "l": "loop", "d": "dangling", "r": "file", "missing": "missing"}, kinds
    assert what_is(tmp_path)[0] == "folder"


def test_seeds_are_counted_before_they_are_listed():
    import argparse

    from lenet import sweep

    t = time.perf_counter()
    with pytest.raises(argparse.ArgumentTypeError, match="at most 10,000"):
        sweep.seeds("0-99999999")
    assert time.perf_counter() - t < 0.1
    assert sweep.seeds("0-3,8") == [0, 1, 2, 3, 8]


_FIRST_LINE = """
import _signal, importlib.abc, sys
seen = {}
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in ("lenet._early", "lenet.interrupt", "signal", "threading") and name not in seen:
            seen[name] = sorted(int(s) for s in _signal.pthread_sigmask(_signal.SIG_BLOCK, []))
        return None
sys.meta_path.insert(0, Watch())
for m in ("signal", "threading", "enum"):
    sys.modules.pop(m, None)
sys.argv = ["-m"]
import lenet
print(seen, sorted(int(s) for s in _signal.pthread_sigmask(_signal.SIG_BLOCK, [])))
"""


def test_signals_are_held_back_from_the_packages_first_line_until_the_handlers_are_in_place():
    """Note [a signal before the handlers] in lenet/__init__.py: SIGINT and SIGTERM blocked before any import
    of ours (interrupt.py's own `import signal` and `import threading` met a Ctrl-C on a slow machine), let
    through once guard() is in place."""
    out = subprocess.run([sys.executable, "-c", _FIRST_LINE], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen, after = out.stdout.strip().split("} ")
    held = eval(seen + "}")   # noqa: S307 - our own child's dict
    assert held and all({2, 15} <= set(v) for v in held.values()), held
    assert after == "[]", after
