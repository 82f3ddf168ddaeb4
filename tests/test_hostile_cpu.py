"""Tried as a stranger would, on a machine without a GPU: a signal at any moment of a run's first 1.5 s, a
home folder that cannot be written, names the system refuses, another run's files in the way, bad values
that must be refused before the GPU, and `lenet predict` on the CPU. One line each, nothing written,
never a hang (lenet/interrupt.py, Note [cache folders] in lenet/files.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lenet import checkpoint as ckpt
from lenet import params as P
from signals import guarded

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = "no usable NVIDIA GPU"


def _env(**extra):
    e = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    e.update({k: v for k, v in extra.items() if v is not None})
    for k in [k for k, v in extra.items() if v is None]:
        e.pop(k, None)
    return e


def run(module, *args, env=None, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], env=_env(**(env or {})), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def one_line(out) -> str:
    """The program's stderr, which must be one line (with at most one warning line before it)."""
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert "Traceback" not in out.stderr and 1 <= len(lines) <= 2, out.stderr
    assert len(lines) == 1 or lines[0].startswith("warning:"), out.stderr
    return lines[-1]


def _gpu_here() -> bool:
    from descriptors import gpu_status

    try:
        return gpu_status()[0]
    except Exception:   # noqa: BLE001
        return False


# ------------------------------------------------------------------ signals from the first line

def _startup_seconds() -> float:
    """How long this machine's interpreter takes to start (site and its .pth files): before it, a signal
    meets no Python at all (Note [signals from the first line])."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "pass"], env=_env(), check=True)
    return time.monotonic() - t0


@pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals")
def test_a_signal_at_any_moment_of_the_first_seconds_is_one_line_and_never_a_hang(dataset, tmp_path):
    first = max(0.1, 3 * _startup_seconds())   # the interpreter's own start-up is not ours
    gpu = _gpu_here()
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "lenet.train", "--quiet", "--data-dir", str(dataset), "--epochs", "1"]
    lasts = []   # runs unsignaled: how long one lasts here (no GPU: until it says so), its caches warm
    for i in range(2):
        t0 = time.monotonic()
        subprocess.run(cmd + ["--out", str(tmp_path / f"warm{i}")], env=_env(XDG_CACHE_HOME=str(cache)),
                       capture_output=True, timeout=120, cwd=tmp_path)
        lasts.append(time.monotonic() - t0)
    last = min(1.5, 0.8 * min(lasts))
    seen, slowest = {}, 0.0
    for i in range(14):
        offset = first + (last - first) * i / 13
        sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
        out_dir = tmp_path / f"run{i}"
        p = subprocess.Popen(cmd + ["--out", str(out_dir)], env=_env(XDG_CACHE_HOME=str(cache)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        time.sleep(offset)
        early = not guarded(p.pid)   # still in the interpreter's own start (a loaded machine): not ours yet
        sent = time.monotonic()
        p.send_signal(sig)
        try:
            out, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail(f"a {sig.name} {offset:.2f} s in: no exit within 10 s")
        slowest = max(slowest, time.monotonic() - sent)
        lines = [x for x in (out + err).splitlines() if x.strip()]
        if p.returncode in (130, 143):   # one line on stderr; stdout has the run's own log lines, if it got there
            said = [x for x in err.splitlines() if x.strip()]   # (on a GPU that starts fast: its header line)
            assert p.returncode == 128 + sig and said == [f"python -m lenet.train: interrupted by {sig.name}"], \
                (offset, p.returncode, out, err)
            assert "Traceback" not in out and all(x.startswith("GPU ") for x in out.splitlines() if x.strip()), \
                (offset, out)
        elif early and p.returncode == -sig:   # Python's own handling, before our first line ran
            pass
        else:   # the run ended before the signal came (no GPU here: one line saying so; on a GPU, trained)
            assert (p.returncode == 0 and "Traceback" not in err if gpu else
                    p.returncode == 2 and len(lines) == 1 and NO_GPU in lines[0]), (offset, p.returncode, out, err)
            # The runs are faster now than the two that set the range (a machine under load a moment ago):
            # the later offsets aim inside a run of this length.
            last = max(first, min(last, 0.8 * offset))
        seen[p.returncode] = seen.get(p.returncode, 0) + 1
        left = [f for f in list(cache.rglob("*")) + list(out_dir.rglob("*")) if f.name.endswith(".tmp")]
        assert not left, f"a {sig.name} {offset:.2f} s in left {left}"
    assert seen.get(130, 0) + seen.get(143, 0) >= 9, seen   # most offsets land inside the run
    assert slowest < 5.0, slowest


# ------------------------------------------------------------------ hostile environments

@pytest.mark.parametrize("what,env", [
    ("HOME=/proc", {"HOME": "/proc", "XDG_CACHE_HOME": None}),
    ("HOME that does not exist", {"HOME": "NOHOME", "XDG_CACHE_HOME": None}),
    ("XDG_CACHE_HOME relative", {"XDG_CACHE_HOME": "relative-cache"}),
    ("CUPY_CACHE_DIR unwritable", {"CUPY_CACHE_DIR": "/proc/cupy-cache"}),
])
@pytest.mark.parametrize("program", ["lenet.train", "lenet.train_step"])
def test_a_home_that_cannot_be_written_runs_without_caches(dataset, tmp_path, what, env, program):
    env = {k: (str(tmp_path / "no-such-home") if v == "NOHOME" else v) for k, v in env.items()}
    work = tmp_path / "work"
    work.mkdir()
    args = ["--data-dir", dataset] + (["--quiet", "--out", tmp_path / "run", "--epochs", "1"]
                                      if program == "lenet.train" else [])
    out = run(program, *args, env={**env, "LENET_DATA_CACHE": None}, cwd=work)
    if not _gpu_here():
        assert out.returncode == 2 and NO_GPU in one_line(out), (what, out.stderr)
    else:   # the run itself, with at most the warning that it has no caches
        assert out.returncode == 0 and "Traceback" not in out.stderr, (what, out.stderr)
        assert all(x.startswith("warning:") for x in out.stderr.splitlines() if x.strip()), (what, out.stderr)
    assert not (tmp_path / "no-such-home").exists(), "a home that does not exist was made"
    assert not list(work.iterdir()), f"{what}: wrote into the current folder: {list(work.iterdir())}"



@pytest.mark.parametrize("program,args", [
    ("lenet.train", ["--batch-size", "0"]),
    ("lenet.train", ["--data-dir", "NODATA"]),
    ("lenet", ["sweep", "--seeds", "3-1"]),
    ("lenet.train_step", ["--engine", "nope"]),
])
def test_a_bad_input_is_one_line_where_there_is_no_cache_folder(tmp_path, program, args):
    """Note [cache folders] in lenet/files.py: the warning that a run goes on without caches is printed once the
    checks passed, so a bad flag or dataset where HOME cannot hold one is the error's line alone."""
    args = [str(tmp_path / "no-such-data") if a == "NODATA" else a for a in args]
    out = run(program, *args, env={"HOME": "/proc", "XDG_CACHE_HOME": None}, cwd=tmp_path)
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "error:" in lines[0] and "Traceback" not in out.stderr, \
        out.stderr
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())


_CACHES = """
import json, os
from lenet import files
files.library_caches()
print(json.dumps({k: os.environ.get(k) for k in ("CUDA_CACHE_PATH", "CUPY_CACHE_DIR")}))
"""


@pytest.mark.parametrize("case", ["home", "no home", "HOME=/proc", "theirs", "theirs unwritable", "disabled"])
def test_the_cuda_compute_cache_goes_where_it_can_be_made(tmp_path, case):
    # CUDA's driver and NVRTC keep ~/.nv/ComputeCache: on a GPU, a HOME that did not exist was made.
    home = tmp_path / ("home" if case != "no home" else "no-such-home")
    if case != "no home":
        home.mkdir()
    env = {"HOME": "/proc" if case == "HOME=/proc" else str(home), "XDG_CACHE_HOME": None,
           "CUDA_CACHE_PATH": {"theirs": str(tmp_path / "nv"), "theirs unwritable": "/proc/nv"}.get(case),
           "CUDA_CACHE_DISABLE": "1" if case == "disabled" else None, "CUPY_CACHE_DIR": None}
    out = subprocess.run([sys.executable, "-c", _CACHES], env=_env(**env), capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    nv = json.loads(out.stdout.strip().splitlines()[-1])["CUDA_CACHE_PATH"]
    if case in ("home", "disabled"):   # the driver's own place, or none at all
        assert nv is None
    elif case == "theirs":
        assert nv == str(tmp_path / "nv")
    else:   # a folder of ours that can be made, never under a HOME that is not there
        assert nv and not nv.startswith("/proc") and os.access(os.path.dirname(nv), os.W_OK), nv
        assert case != "no home" or not nv.startswith(str(home)), nv
    assert not (tmp_path / "no-such-home").exists()


_CUPY_ASIDE = """
import json, os, sys, threading
from lenet import files
files.hold_writes()   # as a program starts (lenet.cli.run)
files.library_caches()
home = os.environ["HOME"]
if sys.argv[1] == "before":
    import cupy
    from cupy.cuda import compiler
    before = {"folder": compiler._kernel_cache_backend._cache_dir, "home": sorted(os.listdir(home))}
    files.checks_passed()
else:   # imported on another thread as the checks pass (a compile's thread), at any point of its import
    importing = threading.Thread(target=lambda: __import__("cupy.cuda.compiler"))
    importing.start()
    files.checks_passed()
    importing.join()
    from cupy.cuda import compiler
    before = {"folder": str(os.environ["TMPDIR"]), "home": []}
after = {"folder": compiler._kernel_cache_backend._cache_dir, "variable": os.environ.get("CUPY_CACHE_DIR")}
files.discard_temporaries()   # as the program leaves (lenet.cli.leave)
print(json.dumps({"before": before, "after": after}))
"""


@pytest.mark.parametrize("imported", ["before", "meanwhile"])
def test_cupys_cache_folder_is_made_only_once_the_checks_passed(tmp_path, imported):
    """Note [CuPy's cache folder after the checks] in lenet/files.py: CuPy 14 makes its kernel cache folder as
    it is imported; imported before the checks (our compiles' threads load their binaries early on a GPU), it
    is pointed at the temporary folder, which exists and where it writes nothing, then at its own folder once the
    checks passed."""
    pytest.importorskip("cupy")
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    out = subprocess.run([sys.executable, "-c", _CUPY_ASIDE, imported], env=_env(HOME=str(home), TMPDIR=str(tmp),
                         XDG_CACHE_HOME=None, CUPY_CACHE_DIR=None), capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == {"folder": str(tmp), "home": []}, got
    assert got["after"] == {"folder": str(home / ".cupy" / "kernel_cache"), "variable": None}, got
    assert (home / ".cupy" / "kernel_cache").is_dir() and not list(tmp.iterdir()), got


def test_a_read_only_current_folder_is_only_read(dataset):
    out = run("lenet.train_step", "--data-dir", dataset, cwd="/proc")   # a folder nothing can be made in
    if _gpu_here():
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    else:
        assert out.returncode == 2 and NO_GPU in one_line(out), out.stderr


# ------------------------------------------------------------------ names the system refuses

LONG = "x" * 300


@pytest.mark.parametrize("module,args,flag", [
    ("lenet.train", ["--quiet", "--out", f"OUT/{LONG}"], "--out"),
    ("lenet.train", ["--quiet", "--data-dir", f"OUT/{LONG}"], "--data-dir"),
    ("lenet.train_step", ["--synthetic", "--dump", f"OUT/{LONG}.npz"], "--dump"),
    ("lenet.export", [f"OUT/{LONG}.npz", "--to", "OUT/w.npz"], ""),
    ("lenet.export", ["CKPT", "--to", f"OUT/{LONG}.npz"], "--to"),
    ("lenet.predict", ["--checkpoint", "CKPT", f"OUT/{LONG}.png"], ""),
    ("lenet.train", ["--quiet", "--out", "OUT/bad-\udcff-name", "--data-dir", "DATA", "--epochs", "1"], "--out"),
])
def test_a_name_the_system_refuses_is_one_line(tmp_path, dataset, module, args, flag):
    ck = tmp_path / "checkpoint.npz"
    ckpt.save(ck, P.pack(P.init_host(0)), np.zeros(P.TOTAL, np.float32),
              {"epoch": 1, "iteration": 5, "config": {"mean": 0.1, "std": 0.3, "dataset": "x"}, "history": []})
    args = [a.replace("OUT", str(tmp_path)).replace("CKPT", str(ck)).replace("DATA", str(dataset)) for a in args]
    out = subprocess.run([sys.executable, "-m", module, *[os.fsencode(a) for a in args]], env=_env(),
                         capture_output=True, timeout=120)
    stderr = out.stderr.decode(errors="replace")
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert "Traceback" not in stderr, stderr
    if "\udcff" in " ".join(args):   # a name of bad bytes is a name the system takes: the run goes on to the GPU
        assert (out.returncode, len(lines)) == (0, 0) if _gpu_here() else \
            (out.returncode == 2 and len(lines) == 1 and NO_GPU in lines[0]), stderr
    else:
        assert len(lines) == 1 and out.returncode == 2, stderr
        assert "too long" in lines[0] and flag in lines[0] and " characters)" in lines[0], stderr


# ------------------------------------------------------------------ $LENET_DATA

@pytest.mark.parametrize("kind", ["missing", "file", "empty", "partial"])
def test_an_unusable_lenet_data_is_an_error_naming_it(tmp_path, kind, dataset):
    where = tmp_path / "d"
    if kind == "file":
        where.write_text("x")
    elif kind == "empty":
        where.mkdir()
    elif kind == "partial":
        where.mkdir()
        (where / "train-images-idx3-ubyte").write_bytes((dataset / "train-images-idx3-ubyte").read_bytes())
    out = run("lenet.train", "--quiet", env={"LENET_DATA": str(where)}, cwd=tmp_path)
    line = one_line(out)
    assert out.returncode == 2 and "$LENET_DATA" in line and str(where) in line, line


# ------------------------------------------------------------------ another run's files

def _checkpoint(path, epoch=1):
    ckpt.save(path, P.pack(P.init_host(0)), np.zeros(P.TOTAL, np.float32),
              {"epoch": epoch, "iteration": 5, "config": {"mean": 0.1, "std": 0.3, "dataset": "x"}, "history": []})


def test_export_never_writes_over_a_checkpoint_and_an_existing_file_only_with_overwrite(tmp_path):
    a, other = tmp_path / "a.npz", tmp_path / "other" / "checkpoint.npz"
    other.parent.mkdir()
    _checkpoint(a)
    _checkpoint(other)
    before = other.read_bytes()
    for extra in ([], ["--overwrite"]):
        out = run("lenet.export", a, "--to", other, *extra)
        assert out.returncode == 2 and "is a run's checkpoint" in one_line(out), out.stderr
    assert other.read_bytes() == before
    plain = tmp_path / "w.npz"
    plain.write_bytes(b"someone's file")
    out = run("lenet.export", a, "--to", plain)
    assert out.returncode == 2 and "exists; replace it with --overwrite" in one_line(out)
    assert plain.read_bytes() == b"someone's file"
    out = run("lenet.export", a, "--to", plain, "--overwrite")
    assert out.returncode == 0 and np.load(plain)["fc2.bias"].shape == (10,), out.stderr


def test_resuming_into_another_runs_folder_is_refused_naming_both(tmp_path, dataset):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "metrics.jsonl").write_text("")
        _checkpoint(d / "checkpoint.npz")
    before = (b / "checkpoint.npz").read_bytes()
    out = run("lenet.train", "--quiet", "--data-dir", dataset, "--resume", a / "checkpoint.npz", "--out", b)
    line = one_line(out)
    assert out.returncode == 2 and "holds another run" in line and str(a) in line and str(b) in line, line
    assert (b / "checkpoint.npz").read_bytes() == before


# ------------------------------------------------------------------ every check before the GPU

def _finished_run(tmp_path, dataset) -> Path:
    """A checkpoint of a run of one epoch on ``dataset`` with the default flags, as lenet.train writes it."""
    from lenet import data, train

    args = train.parser().parse_args(["--quiet", "--data-dir", str(dataset), "--epochs", "1"])
    config = {**train.config_of(args, Path(dataset), 40, data.fingerprint(Path(dataset), None)), "mean": 0.5,
              "std": 0.25}
    path = tmp_path / "finished.npz"
    ckpt.save(path, P.pack(P.init_host(0)), np.zeros(P.TOTAL, np.float32),
              {"epoch": 1, "iteration": 1, "step": 0, "config": config, "history": [{"epoch": 1}]})
    return path


def test_checks_that_need_no_gpu_come_before_it(tmp_path, dataset):
    from test_data_cpu import write_split

    _checkpoint(tmp_path / "c.npz")
    labels_dir = tmp_path / "idx"
    labels_dir.mkdir()
    images, _ = write_split(labels_dir, n=5, labels=np.array([3, 12, 249, 0, 1], np.uint8))
    cases = [
        (["lenet.predict", "--checkpoint", tmp_path / "c.npz", "--labels", labels_dir / "train-labels-idx1-ubyte",
          labels_dir / "train-images-idx3-ubyte"], "labels from 0 to 249"),
        (["lenet.train_step", "--algo", "fused-bwd-v9-g4"], "no kernel of ours has that name"),
        (["lenet.train_step", "--algo", "fused-fwd-v1-i0-g0"], "no kernel of ours has that name"),
        (["lenet.train", "--quiet", "--data-dir", dataset, "--resume", _finished_run(tmp_path, dataset), "--epochs",
          "1"], "nothing to do"),
        (["lenet.train", "--quiet", "--data-dir", dataset, "--out", ""], "--out is empty"),
        (["lenet.train_step", "--synthetic", "--dump", ""], "--dump is empty"),
        (["lenet.train", "--quiet", "--data-dir", dataset, "--overwrite"], "--overwrite needs --out"),
        (["lenet.train", "--quiet", "--data-dir", dataset, "--checkpoint-every", "5"], "--checkpoint-every needs --out"),
    ]
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    cases.append((["lenet.train", "--quiet", "--data-dir", dataset, "--out", tmp_path / "dangling"], "does not exist"))
    for args, needle in cases:
        out = run(*args)
        text = out.stdout + out.stderr
        assert needle in text and NO_GPU not in text and "Traceback" not in text, (args, text)
        assert len([x for x in text.splitlines() if x.strip()]) == 1, (args, text)


# ------------------------------------------------------------------ lines that say what is true

def test_an_unreadable_checkpoint_says_so(tmp_path, monkeypatch):
    path = tmp_path / "c.npz"
    _checkpoint(path)

    real = os.open

    def refused(name, *a, **k):   # the one open every read goes through (lenet.files.open_input)
        if os.fspath(name) == str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real(name, *a, **k)
    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(ckpt.CheckpointError, match=r"cannot read \(Permission denied\)"):
        ckpt.load(path)


def test_export_without_safetensors_names_the_package(tmp_path):
    _checkpoint(tmp_path / "c.npz")
    code = ("import sys; sys.modules['safetensors'] = None; sys.argv = ['lenet-export', sys.argv[1], '--to', "
            "sys.argv[2]]\nfrom lenet.export import run; run()")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c.npz"), str(tmp_path / "w.safetensors")],
                         env=_env(), capture_output=True, text=True, timeout=60)
    line = one_line(out)
    assert out.returncode == 2 and "safetensors" in line and "GPU" not in line, line


def test_library_errors_name_their_own_arguments(tmp_path):
    from lenet import export

    with pytest.raises(ValueError, match="seed must be an integer >= 0, got -1"):
        __import__("lenet.model", fromlist=["LeNet"]).LeNet(seed=-1)   # before any GPU work
    with pytest.raises(ValueError) as e:
        export.save(P.init_host(0), tmp_path / "x.pt")
    assert "--to" not in str(e.value) and "x.pt" in str(e.value)
    if not _gpu_here():
        from descriptors.errors import NoGpuError

        with pytest.raises(NoGpuError, match=NO_GPU):
            __import__("lenet.model", fromlist=["LeNet"]).LeNet()


def test_torch_lenet_names_its_seed():
    lt = pytest.importorskip("lenet.torch")
    with pytest.raises(ValueError, match="seed must be an integer >= 0, got -1"):
        lt.LeNet(seed=-1)


@pytest.mark.parametrize("kind", ["folder", "pipe"])
def test_a_folder_or_pipe_in_a_datasets_place_says_what_it_is(tmp_path, kind):
    from test_data_cpu import write_split

    write_split(tmp_path, n=4)
    write_split(tmp_path, n=4, split="test")
    target = tmp_path / "train-labels-idx1-ubyte"
    target.unlink()
    if kind == "folder":
        target.mkdir()
    else:
        os.mkfifo(target)
    out = run("lenet.train", "--quiet", "--data-dir", tmp_path)
    line = one_line(out)
    assert out.returncode == 2 and ("is a folder" if kind == "folder" else "not a regular file") in line, line


# ------------------------------------------------------------------ caches that forget and stay bounded

def test_the_data_caches_index_forgets_files_gone_changed_or_invalid(tmp_path):
    import json

    from lenet import data

    cache = tmp_path / "cache"
    files = []
    for i in range(3):
        f = tmp_path / f"f{i}.bin"
        f.write_bytes(bytes([i]) * 100)
        data.source_digest(f, cache)
        files.append(f)
    files[0].unlink()
    files[1].write_bytes(b"changed")
    data.source_digest(files[2], cache)
    f3 = tmp_path / "f3.bin"
    f3.write_bytes(b"x")
    data.source_digest(f3, cache)
    index = json.loads((cache / "index.json").read_text())
    assert set(index) == {str(files[2].resolve()), str(f3.resolve())}, index
    data.forget(f3, cache)
    assert set(json.loads((cache / "index.json").read_text())) == {str(files[2].resolve())}


def test_the_bytecode_cache_keeps_its_newest_files_under_its_bound(tmp_path):
    from lenet.startup import prune_bytecode

    folder = tmp_path / "bytecode"
    (folder / "a").mkdir(parents=True)
    for i in range(10):
        p = folder / "a" / f"m{i}.pyc"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (1000 + i, 1000 + i))
    prune_bytecode(str(folder), limit=4500)
    kept = sorted(p.name for p in (folder / "a").iterdir())
    assert kept == ["m6.pyc", "m7.pyc", "m8.pyc", "m9.pyc"], kept
    assert (folder / ".pruned").exists()


# ------------------------------------------------------------------ predict without a GPU

def test_predict_runs_on_the_cpu_with_pytorchs_predictions(tmp_path):
    torch = pytest.importorskip("torch")
    from test_data_cpu import write_split
    from torch_lenet import from_state

    state = P.init_host(3)
    rng = np.random.default_rng(1)
    state = {k: v * 8 for k, v in state.items()}   # confident logits: predictions no rounding can change
    ckpt.save(tmp_path / "c.npz", P.pack(state), np.zeros(P.TOTAL, np.float32),
              {"epoch": 1, "iteration": 5, "config": {"mean": 0.2, "std": 0.3, "dataset": "digits"}, "history": []})
    images, _ = write_split(tmp_path, n=50, images=rng.integers(0, 256, (50, 28, 28), dtype=np.uint8))
    out = run("lenet.predict", "--device", "cpu", "--checkpoint", tmp_path / "c.npz", "--show", "50",
              tmp_path / "train-images-idx3-ubyte")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("device: CPU (NumPy"), lines[0]
    ours = [int(x.split(": ")[1].split()[0]) for x in lines[1:51]]
    x = torch.from_numpy(((images.astype(np.float32) / 255 - 0.2) / 0.3)[:, None])
    ref = from_state(state, device="cpu", dtype=torch.float64)(x.double()).argmax(1).tolist()
    assert ours == ref
    if not _gpu_here():   # auto: the CPU, saying why
        out = run("lenet.predict", "--checkpoint", tmp_path / "c.npz", tmp_path / "train-images-idx3-ubyte")
        assert out.returncode == 0 and out.stdout.startswith("device: CPU (NumPy; no usable NVIDIA GPU"), out


_START_AFTER_SIGNAL = """
import os, threading, time
from lenet import files
files._left_on_signal.set()   # a signal's discard has begun (files._discard_on_signal) and not yet taken the lock


def discard():
    time.sleep(0.3)   # the main thread is in starting_child by now
    files.discard_temporaries()
    print("discarded", flush=True)
    os._exit(0)


threading.Thread(target=discard).start()
with files.starting_child():   # waits for the process's end, the lock not held
    print("started a child after the signal", flush=True)
"""


def test_a_child_about_to_start_after_a_signal_leaves_the_discard_its_lock():
    """Note [a child started as a signal came] in lenet/files.py: a thread that would start a child once a
    signal's discard began waits for the process's end without holding the lock the discard takes (it did, and
    the process hung)."""
    out = subprocess.run([sys.executable, "-c", _START_AFTER_SIGNAL], capture_output=True, text=True, timeout=30,
                         env=_env())
    assert out.returncode == 0 and out.stdout.split() == ["discarded"], (out.stdout, out.stderr)
