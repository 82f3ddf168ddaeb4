"""Nothing lost, the real problem named first, on a machine without a GPU (the GPU is hidden, so
these run the same on a GPU machine): each refused command exits 2 with one line naming the
flag or file and what is allowed, and changes no file."""

from __future__ import annotations

import ast
import gzip
import hashlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from lenet import checkpoint as ckpt
from lenet import data, files
from lenet import params as P
from test_data_cpu import idx_bytes

ROOT = Path(__file__).resolve().parents[1]


def run(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=120,
                          cwd=cwd or ROOT)


def snapshot(root: Path) -> dict:
    """Every file under root with its mode and content hash: 'no file changed' is equality."""
    return {str(p.relative_to(root)): (p.stat().st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def refused(out, *needles):
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    for n in needles:
        assert n in out.stderr, out.stderr
    assert "no usable NVIDIA GPU" not in out.stderr, "the GPU was reported before the real problem"


@pytest.fixture
def checkpoint(tmp_path):
    p = tmp_path / "run" / "checkpoint.npz"
    p.parent.mkdir()
    ckpt.save(p, P.pack(P.init_host(1)), np.zeros(P.TOTAL, np.float32),
              {"epoch": 1, "step": 0, "iteration": 1, "config": {"mean": 0.2, "std": 0.3, "dataset": "data"},
               "history": []})
    return p


# ------------------------------------------------------------------ 1. never destroy work

def test_export_onto_its_own_checkpoint_is_refused(tmp_path, checkpoint):
    before = snapshot(tmp_path)
    refused(run("lenet.export", str(checkpoint), "--to", str(checkpoint)), "is also an input")
    link = tmp_path / "run" / "alias.npz"
    link.symlink_to(checkpoint)
    refused(run("lenet.export", str(checkpoint), "--to", str(link)), "is also an input")
    link.unlink()
    assert snapshot(tmp_path) == before


def test_train_into_an_earlier_run_is_refused(tmp_path, dataset):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"epoch": 1}\n')
    (out / "checkpoint.npz").write_bytes(b"an earlier run's checkpoint")
    before = snapshot(tmp_path)
    refused(run("lenet.train", "--data-dir", str(dataset), "--out", str(out)),
            "holds an earlier run", "--resume", "--overwrite")
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------ 3. the real problem first

def _break(dataset: Path, case: str) -> None:
    img = dataset / "train-images-idx3-ubyte"
    lab = dataset / "train-labels-idx1-ubyte"
    if case == "truncated":
        img.write_bytes(img.read_bytes()[:-100])
    elif case == "label 10":
        lab.write_bytes(idx_bytes(np.full(40, 10, np.uint8)))
    elif case == "count mismatch":
        lab.write_bytes(idx_bytes(np.zeros(39, np.uint8)))
    elif case == "not gzip":
        img.unlink()
        (dataset / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b" + b"not gzip at all" * 10)
    elif case == "empty":
        img.write_bytes(b"")


@pytest.mark.parametrize("case,needle", [
    ("truncated", "truncated"), ("label 10", "labels must be in 0..9"), ("count mismatch", "40 images but"),
    ("not gzip", "corrupt gzip data"), ("empty", "too short for an IDX header")])
def test_train_names_a_broken_dataset(tmp_path, dataset, case, needle):
    _break(dataset, case)
    before = snapshot(tmp_path)
    refused(run("lenet.train", "--data-dir", str(dataset), "--out", str(tmp_path / "new")), needle)
    assert snapshot(tmp_path) == before and not (tmp_path / "new").exists()


def test_train_names_a_missing_or_incomplete_dataset(tmp_path, dataset):
    refused(run("lenet.train", "--data-dir", str(tmp_path / "nowhere")), "nowhere: no such folder")
    for f in dataset.glob("t10k-*"):
        f.unlink()
    refused(run("lenet.train", "--data-dir", str(dataset)), "missing t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte")


def test_train_out_that_cannot_be_a_folder(tmp_path, dataset):
    f = tmp_path / "file"
    f.write_text("not a folder")
    before = snapshot(tmp_path)
    refused(run("lenet.train", "--data-dir", str(dataset), "--out", str(f)), "is a file, not a folder")
    refused(run("lenet.train", "--data-dir", str(dataset), "--out", str(f / "sub")), "is a file, not a folder")
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: an unwritable folder needs another user")
def test_train_out_not_writable(tmp_path, dataset):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    refused(run("lenet.train", "--data-dir", str(dataset), "--out", str(ro / "run")), "is not writable")


@pytest.mark.parametrize("case", ["missing", "garbage", "folder", "foreign", "array"])
def test_train_resume_from_a_bad_checkpoint(tmp_path, dataset, checkpoint, case):
    target = {"missing": tmp_path / "none.npz", "garbage": tmp_path / "garbage.npz", "folder": tmp_path,
              "foreign": tmp_path / "foreign.npz", "array": tmp_path / "array.npy"}[case]
    if case == "garbage":
        target.write_bytes(os.urandom(300))
    if case == "foreign":
        np.savez(target, weights=np.zeros(3))
    if case == "array":
        np.save(target, np.zeros(3))
    before = snapshot(tmp_path)
    out = run("lenet.train", "--data-dir", str(dataset), "--out", str(tmp_path / "new"), "--resume", str(target))
    refused(out, {"missing": "no such checkpoint", "garbage": "is not a LeNet checkpoint",
                  "folder": "is a folder, not a checkpoint", "foreign": "without params, velocity, meta",
                  "array": "is a single NumPy array"}[case])
    assert "allow_pickle" not in out.stderr
    assert snapshot(tmp_path) == before


def test_resume_from_another_runs_checkpoint(tmp_path, dataset, checkpoint):
    out = run("lenet.train", "--data-dir", str(dataset), "--out", str(tmp_path / "new"), "--resume", str(checkpoint))
    refused(out, "was made with", "resume with the same settings")


# ------------------------------------------------------------------ 4. our own messages

def test_pickled_file_is_not_suggested_to_unpickle(tmp_path):
    p = tmp_path / "pickled.npz"
    np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    p = p.with_suffix(".npz.npy") if not p.exists() else p
    for args in (["lenet.export", str(p), "--to", str(tmp_path / "m.npz")],
                 ["lenet.predict", "--checkpoint", str(p), str(p)]):
        out = run(*args)
        refused(out, "not a LeNet checkpoint")
        assert "allow_pickle" not in out.stderr and "unsafe" not in out.stderr


@pytest.mark.parametrize("to,needle", [("missing/m.safetensors", "does not exist"), ("file/m.safetensors", "is a file"),
                                        ("adir", "is a folder")])
def test_export_to_a_bad_place(tmp_path, checkpoint, to, needle):
    (tmp_path / "file").write_text("x")
    (tmp_path / "adir.npz").mkdir()
    target = tmp_path / (to + ".npz" if to == "adir" else to)
    before = snapshot(tmp_path)
    refused(run("lenet.export", str(checkpoint), "--to", str(target)), "--to", needle)
    assert snapshot(tmp_path) == before


def test_predict_given_a_folder(tmp_path, checkpoint):
    refused(run("lenet.predict", "--checkpoint", str(checkpoint), str(tmp_path)), "is a folder, not an IDX image file")


@pytest.mark.parametrize("args,needle", [
    (["lenet.train_step", "--workspace-limit", "-5M"], "--workspace-limit: invalid size '-5M'"),
    (["lenet.train_step", "--seed", "-1"], "--seed: invalid value '-1': must be an integer >= 0"),
    (["lenet.train", "--seed", "-1"], "--seed: invalid value '-1': must be an integer >= 0"),
    (["lenet.train_step", "--warmup", "-3"], "--warmup: invalid value '-3': must be an integer >= 0"),
    (["lenet.train", "--checkpoint-every", "-2"], "--checkpoint-every: invalid value '-2'"),
])
def test_flag_values(args, needle):
    refused(run(*args), needle)


def test_dump_into_a_missing_folder(tmp_path):
    refused(run("lenet.train_step", "--synthetic", "--dump", str(tmp_path / "no" / "d.npz")), "--dump", "does not exist")


# ------------------------------------------------------------------ IDX bound, files, install

def test_gzip_that_inflates_beyond_its_header(tmp_path, monkeypatch):
    raw = idx_bytes(np.zeros((2, 28, 28), np.uint8)) + b"\0" * (50 << 20)   # 50 MB more than declared
    p = tmp_path / "train-images-idx3-ubyte.gz"
    p.write_bytes(gzip.compress(raw))
    assert p.stat().st_size < 1 << 20
    inflated = []
    read = data._Gunzip.read
    monkeypatch.setattr(data._Gunzip, "read", lambda self, *a: inflated.append(len(r := read(self, *a))) or r)
    with pytest.raises(data.DataError, match="inflates beyond the size its header declares"):
        data.read_idx(p)
    assert sum(inflated) <= 16 + 2 * 784 + 1, f"inflated {sum(inflated)} bytes for a 2-image file"


def test_absurd_header_is_refused_before_reading(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(bytes([0, 0, 8, 3]) + (100000).to_bytes(4, "big") + (100000).to_bytes(4, "big") * 2)
    with pytest.raises(data.DataError, match="more than the 4 GiB"):
        data.read_idx(p)


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        files.write_atomic(tmp_path / "a.bin", b"x")
        files.save_npz(tmp_path / "b.npz", {"a": np.zeros(2)})
        ckpt.save(tmp_path / "c.npz", P.pack(P.init_host(0)), np.zeros(P.TOTAL, np.float32), {"epoch": 0})
    finally:
        os.umask(old)
    for name in ("a.bin", "b.npz", "c.npz"):
        assert (tmp_path / name).stat().st_mode & 0o777 == mode, name


def test_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    p = tmp_path / "f"
    files.write_atomic(p, b"old")

    def interrupted(fd):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        files.write_atomic(p, b"new and longer")
    assert p.read_bytes() == b"old" and [f.name for f in tmp_path.iterdir()] == ["f"]


# Top-level modules the programs import, and the distribution that provides each.
PROVIDES = {"numpy": "numpy", "cupy": "cupy-cuda13x", "cupy_backends": "cupy-cuda13x", "cuda": "cuda-python",
            "nvmath": "nvmath-python", "cudnn": "nvidia-cudnn-frontend", "tqdm": "tqdm",
            "safetensors": "safetensors", "PIL": "pillow"}


def test_the_first_install_has_every_module_the_programs_import():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("<")[0].split("=")[0].strip().lower()
             for d in project["dependencies"] + project["optional-dependencies"]["cu13"]}
    imported = set()
    for f in [*(ROOT / "lenet").rglob("*.py"), *(ROOT / "descriptors").rglob("*.py")]:
        if f == ROOT / "lenet" / "torch.py":   # the optional extra .[torch] (tests/test_torch_cpu.py)
            continue
        if f == ROOT / "lenet" / "study.py":   # the optional extra .[sweep]: optuna (and its own SQLAlchemy)
            assert "optuna" in " ".join(project["optional-dependencies"]["sweep"])
        mods = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods.add(node.module.split(".")[0])
        imported |= mods - ({"optuna", "sqlalchemy"} if f == ROOT / "lenet" / "study.py" else set())
    third_party = imported - set(sys.stdlib_module_names) - {"lenet", "descriptors", "__future__"}
    unknown = third_party - set(PROVIDES)
    assert not unknown, f"modules with no known distribution: {unknown}"
    missing = {m: PROVIDES[m] for m in third_party if PROVIDES[m] not in names}
    assert not missing, f"imported by the programs but not installed by pip install '.[cu13]': {missing}"
    assert "torch" not in third_party


def test_python_m_lenet_lists_the_programs_and_scripts_exist():
    out = run("lenet")
    assert out.returncode == 0
    for prog in ("lenet.train", "lenet.train_step", "lenet.export", "lenet.predict"):
        assert prog in out.stdout
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        module, func = target.split(":")
        assert callable(getattr(__import__(module, fromlist=[func]), func)), name


def test_ci_removes_its_environment_and_leaves_the_checkout_as_it_was():
    text = (ROOT / ".ci" / "run").read_text()
    assert "trap cleanup EXIT" in text and 'rm -rf "$tmp"' in text
    assert "git status --porcelain --ignored" in text and "python -B -m pytest" in text


# ------------------------------------------------------------------ files and values a user can have

def _png_header_only(path, w, h):
    """A PNG that says it is w x h (8-bit gray) and holds a few bytes: what a decompression bomb looks like."""
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("case", ["no config", "no mean", "string params"])
def test_a_checkpoint_whose_record_or_numbers_are_not_ours(tmp_path, checkpoint, dataset, case):
    bad = tmp_path / "bad.npz"
    meta = {"epoch": 1, "step": 0, "iteration": 1, "history": [],
            "config": {"mean": 0.2, "std": 0.3, "dataset": "data"}}
    params = P.pack(P.init_host(1))
    if case == "no config":
        del meta["config"]
    if case == "no mean":
        del meta["config"]["mean"]
    if case == "string params":
        params = np.array(["x"] * P.TOTAL)
    arrays = {"params": params, "velocity": np.zeros(P.TOTAL, np.float32),
              "meta": np.array(__import__("json").dumps({"format": ckpt.FORMAT, **meta}))}
    np.savez(bad, **arrays)
    before = snapshot(tmp_path)
    needle = {"no config": "holds no run configuration", "no mean": "has no usable pixel mean",
              "string params": "not floating-point numbers"}[case]
    refused(run("lenet.export", str(bad), "--to", str(tmp_path / "m.npz")), needle)
    refused(run("lenet.predict", "--checkpoint", str(bad), str(bad)), needle)
    refused(run("lenet.train", "--data-dir", str(dataset), "--resume", str(bad), "--out", str(tmp_path / "r")),
            needle)
    assert snapshot(tmp_path) == before


def test_predict_refuses_a_huge_picture_before_decoding_it(tmp_path, checkpoint):
    big = tmp_path / "big.png"
    _png_header_only(big, 20000, 20000)
    refused(run("lenet.predict", "--checkpoint", str(checkpoint), str(big)), "a picture larger than Pillow reads",
            "pixels are read")
    _png_header_only(big, 9000, 9000)   # under Pillow's own limit, over ours
    refused(run("lenet.predict", "--checkpoint", str(checkpoint), str(big)), "a 9000x9000 picture", "pixels are read")


def test_predict_names_a_device_as_not_a_regular_file(checkpoint):
    refused(run("lenet.predict", "--checkpoint", str(checkpoint), "/dev/null"), "/dev/null is a device, not a regular file")


@pytest.mark.parametrize("args,needle", [
    (["lenet.export", "CKPT", "--to", "/proc/m.npz"], "the folder /proc is not writable"),
    (["lenet.train", "--data-dir", "DATA", "--out", "/proc/forbidden"], "the folder /proc is not writable"),
    (["lenet.train_step", "--synthetic", "--dump", "/proc/x.npz"], "the folder /proc is not writable"),
    (["lenet.train", "--data-dir", "DATA", "--batch-size", "10000000"], "at most 1048576 images a batch"),
    (["lenet.train_step", "--batch-size", "10000000"], "at most 1048576 images a batch"),
    (["lenet.train", "--data-dir", "DATA", "--momentum", "1e10"], "--momentum: invalid value '1e10'"),
    (["lenet.train", "--data-dir", "DATA", "--warmup-epochs", "1e308"], "is longer than the run"),
    (["lenet.train", "--data-dir", "DATA", "--train-size", "70"], "--train-size 70 is more than the 40 images"),
    (["lenet.predict", "--checkpoint", "CKPT", "CKPT", "--show", "-1"], "--show: invalid value '-1'"),
])
def test_values_and_places_refused_before_the_gpu(tmp_path, checkpoint, dataset, args, needle):
    # Root included: /proc takes no file, whatever os.access says.
    args = [str(checkpoint) if a == "CKPT" else str(dataset) if a == "DATA" else a for a in args]
    before = snapshot(tmp_path)
    refused(run(*args), needle)
    assert snapshot(tmp_path) == before


def test_a_split_whose_pixels_are_all_equal(tmp_path):
    from test_data_cpu import write_split
    root = tmp_path / "flat"
    root.mkdir()
    write_split(root, n=10, images=np.full((10, 28, 28), 7, np.uint8))
    write_split(root, n=5, split="test")
    refused(run("lenet.train", "--data-dir", str(root), "--no-data-cache"), "are all 7",
            "nothing to normalize")


def test_resume_knows_a_dataset_by_its_content_not_its_folder(tmp_path, dataset):
    # The checkpoint records the files' fingerprint: the same files under another folder name resume
    # (they reach the GPU step), other files of the same size under the same name are refused.
    import shutil

    from lenet import train
    args = train.parser().parse_args(["--data-dir", str(dataset)])
    made = {**train.config_of(args, dataset, 40, data.fingerprint(dataset)), "mean": 0.2, "std": 0.3}
    path = tmp_path / "checkpoint.npz"
    ckpt.save(path, P.pack(P.init_host(0)), np.zeros(P.TOTAL, np.float32),
              {"epoch": 1, "step": 0, "iteration": 1, "config": made, "history": []})
    renamed = tmp_path / "mnist"
    shutil.copytree(dataset, renamed)
    out = run("lenet.train", "--data-dir", str(renamed), "--resume", str(path))
    assert out.returncode == 2 and "no usable NVIDIA GPU" in out.stderr, out.stderr   # past every check
    other = tmp_path / "elsewhere" / dataset.name
    other.parent.mkdir()
    shutil.copytree(dataset, other)
    from test_data_cpu import write_split
    write_split(other, n=40, images=np.random.default_rng(9).integers(0, 256, (40, 28, 28), dtype=np.uint8))
    refused(run("lenet.train", "--data-dir", str(other), "--resume", str(path)), "was trained on other data")


def test_programs_write_only_into_the_caches_they_name(tmp_path):
    # With HOME and XDG_CACHE_HOME pointed at fresh folders and bytecode off (as on the GPU machine),
    # a training run that stops at the missing GPU and a train_step write only under the cache folder:
    # nothing in HOME, nothing beside the sources.
    from test_data_cpu import write_split
    root = tmp_path / "d"
    root.mkdir()
    write_split(root, n=40, gz=True)
    write_split(root, n=20, split="test", gz=True)
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    pycache = lambda: {str(p) for top in ("lenet", "descriptors") for p in (ROOT / top).rglob("__pycache__")}  # noqa: E731
    before = pycache()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LENET_", "PYTHONPYCACHEPREFIX"))}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(cache), CUPY_CACHE_DIR=str(cache / "cupy"),
               PYTHONDONTWRITEBYTECODE="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for args in (["lenet.train", "--data-dir", str(root)], ["lenet.train_step", "--synthetic"]):
        out = subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=120,
                             cwd=tmp_path)
        assert out.returncode == 2 and "no usable NVIDIA GPU" in out.stderr, out.stderr
    assert not any(home.rglob("*")), sorted(home.rglob("*"))
    written = {p.relative_to(cache).parts[:2] for p in cache.rglob("*") if p.is_file()}
    assert {("lenet", "data"), ("lenet", "bytecode")} <= written and all(w[0] in ("lenet", "cupy") for w in written), \
        written
    assert pycache() == before, f"bytecode written beside the sources: {sorted(pycache() - before)}"
