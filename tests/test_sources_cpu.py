"""The reads of a first run's gzipped images begun at a program's first line (Note [the images read from the
first line] in lenet/sources.py), without a GPU: the folder the command line names, what is taken and what is
left to data.read_idx's own read, a pipe never waited on, a later run reading nothing early."""

from __future__ import annotations

import gzip
import os
import time

import numpy as np
import pytest

from lenet import data, sources


@pytest.fixture(autouse=True)
def _no_reads_left(monkeypatch, tmp_path):
    monkeypatch.setattr(sources, "_early", {})
    monkeypatch.setattr(sources, "EARLY_MIN_CPUS", 1)   # this machine may have fewer: a test of its own below
    monkeypatch.setenv("LENET_DATA_CACHE", str(tmp_path / "cache"))   # the cache the early reads look in


def _split(root, n=30, split="train", seed=0, wrap=lambda raw: gzip.compress(raw, mtime=0)):
    rng = np.random.default_rng(seed)
    images, labels = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n, dtype=np.uint8)
    for stem, arr in zip(data.SPLITS[split], (images, labels)):
        (root / f"{stem}.gz").write_bytes(wrap(data.idx_bytes(arr)))
    return images, labels


def _read(root, cache, split="train"):
    sources.read_early(["--data-dir", str(root)], (split,))
    return data.load_split(root, split, cache)


def test_a_first_runs_images_are_taken_from_the_early_read_and_cached(tmp_path, monkeypatch):
    root, cache = tmp_path / "d", tmp_path / "cache"
    root.mkdir()
    imgs, labs = _split(root)
    _split(root, n=7, split="test", seed=1)
    inflates = []
    real = data._Gunzip.read
    monkeypatch.setattr(data._Gunzip, "read", lambda self, n: inflates.append(n) or real(self, n))
    x, y = _read(root, cache)
    assert np.array_equal(x, imgs) and np.array_equal(y, labs)
    assert inflates == [4, 4, 30 + 1], inflates   # the labels' header, dims and body: the images not inflated again
    assert not sources._early, "taken once"
    # cached as a first read caches: a later run maps the copy, and reads nothing early
    assert list(cache.glob("*-train-images-idx3-ubyte.npy"))
    sources.read_early(["--data-dir", str(root)], ("train",))
    early = sources._early[os.path.realpath(root / "train-images-idx3-ubyte.gz")]
    assert early.done.wait(10) and early.raw is None
    x2, _ = data.load_split(root, "train", cache)
    assert np.array_equal(x2, imgs)


def test_without_a_cache_folder_the_early_read_is_taken_too(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    imgs, _ = _split(root)
    x, _ = _read(root, None)
    assert np.array_equal(x, imgs) and not sources._early


@pytest.mark.parametrize("wrap,error", [
    (lambda raw: gzip.compress(raw[:500], mtime=0) + gzip.compress(raw[500:], mtime=0), None),   # two members
    (lambda raw: gzip.compress(raw, mtime=0) + b"not a gzip member", "corrupt gzip data"),
    (lambda raw: (lambda z: z[:-8] + bytes([z[-8] ^ 1]) + z[-7:])(gzip.compress(raw, mtime=0)), "corrupt gzip data"),
    (lambda raw: gzip.compress(raw + b"\0" * 100, mtime=0), "inflates beyond the size its header declares"),
    (lambda raw: gzip.compress(raw[:-100], mtime=0), "truncated"),
    (lambda raw: gzip.compress(raw, mtime=0)[:-50], "corrupt gzip data"),   # the stream cut short
])
def test_what_the_early_read_cannot_vouch_for_is_read_as_before(tmp_path, wrap, error):
    """Several members, bytes after the member, a wrong CRC, a stream longer or shorter than its header
    declares: nothing taken, or the same checks on the whole stream; the same answer or the same error."""
    root = tmp_path / "d"
    root.mkdir()
    imgs, _ = _split(root, wrap=wrap)
    if error is None:
        x, _ = _read(root, tmp_path / "cache")
        assert np.array_equal(x, imgs)
    else:
        with pytest.raises(data.DataError, match=error):
            _read(root, tmp_path / "cache")
        assert not list((tmp_path / "cache").glob("*.npy")), "nothing cached of an invalid file"


def test_a_file_changed_after_its_early_read_is_read_again(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    _split(root, seed=0)
    sources.read_early(["--data-dir", str(root)], ("train",))
    early = sources._early[os.path.realpath(root / "train-images-idx3-ubyte.gz")]
    assert early.done.wait(10) and early.raw is not None
    imgs, _ = _split(root, n=31, seed=2)   # another dataset in its place (another size)
    x, _ = data.load_split(root, "train", tmp_path / "cache")
    assert np.array_equal(x, imgs)


def test_a_file_of_the_same_size_and_time_renamed_into_place_is_read_again(tmp_path):
    """What cp -p, rsync -t or tar leave: another file of the same size and modification time (another inode)."""
    root, other = tmp_path / "d", tmp_path / "other"
    root.mkdir(), other.mkdir()
    _split(root, seed=0)
    imgs, _ = _split(other, seed=3)
    name = "train-images-idx3-ubyte.gz"
    st = (root / name).stat()
    assert (other / name).stat().st_size == st.st_size
    os.utime(other / name, ns=(st.st_atime_ns, st.st_mtime_ns))
    sources.read_early(["--data-dir", str(root)], ("train",))
    assert sources._early[os.path.realpath(root / name)].done.wait(10)
    os.replace(other / name, root / name)
    os.replace(other / "train-labels-idx1-ubyte.gz", root / "train-labels-idx1-ubyte.gz")
    x, _ = data.load_split(root, "train", tmp_path / "cache")
    assert np.array_equal(x, imgs)


def test_reads_nobody_took_are_let_go_once_the_data_is_read(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    for root in (a, b):
        _split(root), _split(root, n=7, split="test", seed=1)
    sources.read_early(["--data-dir", str(a)])   # guessed a, the program reads b
    assert len(sources._early) == 2
    data.load_splits(b, ("train", "test"), tmp_path / "cache")
    assert not sources._early


def test_a_pipe_where_the_images_should_be_is_never_opened(tmp_path):
    """Never waited on, and never opened: a writer blocked on the pipe stays blocked (an open for reading would
    let it go, and close it with SIGPIPE)."""
    import subprocess
    import sys

    root = tmp_path / "d"
    root.mkdir()
    _split(root)
    images = root / "train-images-idx3-ubyte.gz"
    images.unlink()
    os.mkfifo(images)
    writer = subprocess.Popen([sys.executable, "-c", f"open({str(images)!r}, 'wb').write(b'x' * 100)"])
    try:
        sources.read_early(["--data-dir", str(root)], ("train",))
        early = sources._early.get(os.path.realpath(images))
        assert early is None or early.done.wait(5), "the read waited on the pipe"
        time.sleep(0.3)
        assert writer.poll() is None, "the pipe was opened: its writer was let go"
        assert sources.taken(images) is None
    finally:
        writer.kill()
        writer.wait()
    with pytest.raises(data.DataError, match="not a regular file"):
        data.load_split(root, "train", tmp_path / "cache")


def test_nothing_is_read_early_on_a_machine_of_few_cpus(tmp_path, monkeypatch):
    root = tmp_path / "d"
    root.mkdir()
    _split(root)
    monkeypatch.setattr(sources, "EARLY_MIN_CPUS", 10 ** 6)
    sources.read_early(["--data-dir", str(root)])
    assert not sources._early


def test_a_raw_file_beside_the_gzip_one_is_what_is_read(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    _split(root)
    (root / "train-images-idx3-ubyte").write_bytes(gzip.decompress((root / "train-images-idx3-ubyte.gz").read_bytes()))
    sources.read_early(["--data-dir", str(root)], ("train",))
    assert not sources._early   # data._file takes the raw file: nothing to inflate


def test_the_folder_is_the_one_the_command_line_names(tmp_path, monkeypatch):
    named = sources._named_folder
    monkeypatch.delenv("LENET_DATA", raising=False)
    assert named(["--epochs", "3", "--data-dir", "a", "--data-dir=b"]) == sources.Path("b")   # the last, as argparse
    assert named(["--data", "c"]) == sources.Path("c") == named(["--data-d=c"])   # argparse's abbreviations
    assert named(["--dat", "c", "--data-dirs", "d"]) != sources.Path("c")   # not ours: another flag's, or none
    assert named(["--data-dir=", "--seed", "1"]) is None   # no folder at all
    monkeypatch.setenv("LENET_DATA", str(tmp_path / "env"))
    assert named([]) == tmp_path / "env" and named(["--data-dir", "x"]) == sources.Path("x")
    monkeypatch.delenv("LENET_DATA")
    monkeypatch.chdir(tmp_path)
    system = named([])   # no ./data here: a system folder, or none
    assert system is None or system.is_absolute()
    (tmp_path / "data" / "mnist").mkdir(parents=True)
    _split(tmp_path / "data" / "mnist")
    assert named([]) == system   # the training split alone: no dataset
    _split(tmp_path / "data" / "mnist", split="test")
    assert named([]) == sources.Path("data") / "mnist"
    sources.read_early(["--synthetic"])   # train_step's random batches: nothing read
    assert not sources._early
