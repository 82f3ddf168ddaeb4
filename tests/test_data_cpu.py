"""IDX reading and validation, gzip and raw, and every corrupt-file case, without a GPU."""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np
import pytest

from lenet import data


idx_bytes = data.idx_bytes


def write_split(root, n=20, split="train", gz=False, images=None, labels=None):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8) if images is None else images
    labels = rng.integers(0, 10, n, dtype=np.uint8) if labels is None else labels
    for stem, arr in zip(data.SPLITS[split], (images, labels)):
        raw = idx_bytes(arr)   # gzip's header holds a time: a fixed one, so equal content gives equal bytes
        (root / (stem + (".gz" if gz else ""))).write_bytes(gzip.compress(raw, mtime=0) if gz else raw)
    return images, labels


@pytest.mark.parametrize("gz", [False, True])
def test_read_raw_and_gzip(tmp_path, gz):
    imgs, labs = write_split(tmp_path, gz=gz)
    write_split(tmp_path, split="test", gz=gz)
    x, y = data.load_split(tmp_path, "train")
    assert np.array_equal(x, imgs) and np.array_equal(y, labs)
    assert data.find_dataset(tmp_path) == tmp_path


def _corrupt(tmp_path, raw: bytes, name="train-images-idx3-ubyte"):
    p = tmp_path / name
    p.write_bytes(raw)
    return p


@pytest.mark.parametrize("mutate,msg", [
    (lambda r: r[:2] + b"\x07\x03" + r[4:], "bad IDX magic number"),
    (lambda r: b"\x01" + r[1:], "bad IDX magic number"),
    (lambda r: r[:3] + b"\x02" + r[4:], "has 2 dimensions, expected 3"),
    (lambda r: r[:-100], "truncated"),
    (lambda r: r + b"\x00" * 5, "trailing bytes"),
    (lambda r: r[:10], "truncated header"),
    (lambda r: r[:2], "too short"),
    (lambda r: r[:4] + struct.pack(">I", 0) + r[8:], "a dimension is zero"),
    (lambda r: gzip.compress(r)[:-20], "corrupt gzip"),
])
def test_corrupt_images(tmp_path, mutate, msg):
    rng = np.random.default_rng(1)
    raw = idx_bytes(rng.integers(0, 256, (10, 28, 28), dtype=np.uint8))
    p = _corrupt(tmp_path, mutate(raw))
    with pytest.raises(data.DataError, match=msg) as e:
        data.read_idx(p, ndim=3)
    assert str(p) in str(e.value)


def test_gzip_members_checks_and_size_bound(tmp_path, monkeypatch):
    """A gzip file reads as gzip.GzipFile reads it: every member in order; a member whose CRC or length
    is wrong, garbage after the last member, or compressed bytes beyond MAX_BYTES are refused."""
    rng = np.random.default_rng(2)
    raw = idx_bytes(rng.integers(0, 256, (30, 28, 28), dtype=np.uint8))
    p = _corrupt(tmp_path, gzip.compress(raw[:1000]) + gzip.compress(raw[1000:7001]) + gzip.compress(raw[7001:]))
    assert np.array_equal(data.read_idx(p, ndim=3), np.frombuffer(raw[16:], np.uint8).reshape(30, 28, 28))
    whole = bytearray(gzip.compress(raw))
    whole[-8] ^= 1   # the member's CRC32
    p = _corrupt(tmp_path, bytes(whole))
    with pytest.raises(data.DataError, match="corrupt gzip data"):
        data.read_idx(p, ndim=3)
    p = _corrupt(tmp_path, gzip.compress(raw) + b"not a gzip member")
    with pytest.raises(data.DataError, match="corrupt gzip data"):
        data.read_idx(p, ndim=3)
    p = _corrupt(tmp_path, gzip.compress(raw))
    monkeypatch.setattr(data, "MAX_BYTES", p.stat().st_size - 1)
    with pytest.raises(data.DataError, match="bytes of gzip, more than"):
        data.read_idx(p, ndim=3)


def test_count_mismatch_and_label_range_and_size(tmp_path):
    write_split(tmp_path, labels=np.zeros(19, np.uint8))
    with pytest.raises(data.DataError, match="has 20 images but .* has 19 labels"):
        data.load_split(tmp_path, "train")
    write_split(tmp_path, labels=np.full(20, 10, np.uint8))
    with pytest.raises(data.DataError, match="labels must be in 0..9, found 10"):
        data.load_split(tmp_path, "train")
    write_split(tmp_path, images=np.zeros((20, 32, 32), np.uint8))
    with pytest.raises(data.DataError, match="images are 32x32, LeNet takes 28x28"):
        data.load_split(tmp_path, "train")


def test_missing_files(tmp_path):
    write_split(tmp_path)  # train only
    assert data.find_dataset(tmp_path) is None
    with pytest.raises(data.DataError, match="no t10k-images-idx3-ubyte"):
        data.load_split(tmp_path, "test")
    msg = data.not_found_message(tmp_path)
    assert "missing t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte" in msg and "train-images" not in msg.split(";")[0]
    assert "apt-get install dataset-fashion-mnist" in data.not_found_message(tmp_path / "nowhere") or \
        "no such folder" in data.not_found_message(tmp_path / "nowhere")


def test_search_order(tmp_path, monkeypatch):
    monkeypatch.setenv("LENET_DATA", str(tmp_path / "env"))
    monkeypatch.chdir(tmp_path)
    c = data.candidates()
    assert c[0] == tmp_path / "env" and c[1].as_posix() == "data/fashion-mnist"
    assert c[-1].as_posix() == "/usr/share/datasets/fashion-mnist"


def test_pixel_stats():
    imgs = np.random.default_rng(2).integers(0, 256, (50, 28, 28), dtype=np.uint8)
    m, s = data.pixel_stats(imgs)
    f = imgs / 255.0
    assert abs(m - f.mean()) < 1e-12 and abs(s - f.std()) < 1e-12


def _npy(cache):
    return sorted(p.name for p in cache.glob("*.npy"))


def test_dataset_cache(tmp_path, monkeypatch):
    """A .gz split is inflated once into the cache, then read from it; a changed source gets an entry
    of its own; a damaged entry is rewritten; raw files are not copied."""
    root, cache = tmp_path / "d", tmp_path / "cache"
    root.mkdir()
    imgs, labs = write_split(root, n=30, gz=True)
    a, b = data.load_split(root, "train", cache)
    assert np.array_equal(a, imgs) and np.array_equal(b, labs)
    assert len(_npy(cache)) == 2

    real = data.read_idx
    monkeypatch.setattr(data, "read_idx", lambda *a, **k: pytest.fail("read the source despite the cache"))
    a2, b2 = data.load_split(root, "train", cache)
    assert np.array_equal(a2, imgs) and np.array_equal(b2, labs)
    monkeypatch.setattr(data, "read_idx", real)

    new, _ = write_split(root, n=30, gz=True, images=255 - imgs, labels=labs)   # same size, new content
    img_gz = root / "train-images-idx3-ubyte.gz"
    os.utime(img_gz, ns=(img_gz.stat().st_atime_ns, img_gz.stat().st_mtime_ns + 10**9))
    a3, _ = data.load_split(root, "train", cache)
    assert np.array_equal(a3, new)
    assert len(_npy(cache)) == 3   # the new content's entry beside the old (bounded: see the pruning test)

    for e in cache.glob("*.npy"):   # damaged entries: read from the source, rewritten
        e.write_bytes(e.read_bytes()[:100])
    a4, b4 = data.load_split(root, "train", cache)
    assert np.array_equal(a4, new) and np.array_equal(b4, labs)

    raw = tmp_path / "raw"
    raw.mkdir()
    write_split(raw, n=10)
    before = _npy(cache)
    data.load_split(raw, "train", cache)
    assert _npy(cache) == before


def test_dataset_cache_is_keyed_by_content_and_written_after_validation(tmp_path):
    cache = tmp_path / "cache"
    for name in ("fashion-mnist", "copy", "mnist"):   # three folders, one dataset: one set of entries
        root = tmp_path / name
        root.mkdir()
        write_split(root, n=30, gz=True)
        data.load_split(root, "train", cache)
    assert len(_npy(cache)) == 2
    bad = tmp_path / "bad"
    bad.mkdir()
    rng = np.random.default_rng(5)
    write_split(bad, n=30, gz=True, images=rng.integers(0, 256, (30, 28, 28), dtype=np.uint8))
    write_split(bad, n=30, gz=True, split="test", labels=np.full(30, 12, np.uint8))   # labels out of range
    pending = []
    data.load_split(bad, "train", cache, pending)
    with pytest.raises(data.DataError, match="labels must be in 0..9"):
        data.load_split(bad, "test", cache, pending)
    assert len(_npy(cache)) == 2, "a dataset that failed validation left entries in the cache"


def test_dataset_cache_keeps_the_most_recently_used_within_its_bound(tmp_path):
    cache = tmp_path / "cache"
    entries = []
    for i in range(4):
        root = tmp_path / f"d{i}"
        root.mkdir()
        rng = np.random.default_rng(i)
        write_split(root, n=30, gz=True, images=rng.integers(0, 256, (30, 28, 28), dtype=np.uint8))
        pending = []
        data.load_split(root, "train", cache, pending)
        data.commit(pending, cache, limit=3 * 30 * 28 * 28)   # about three image entries
        entries.append({e for e, _ in pending if "images" in e.name})   # the labels are one shared entry
    left = set(cache.glob("*.npy"))
    assert entries[-1] <= left and not (entries[0] & left), "the oldest dataset was kept, or the newest dropped"
    assert sum(p.stat().st_size for p in left) <= 3 * 30 * 28 * 28


def test_a_dataset_fingerprint_follows_content_not_folder_names(tmp_path):
    a, b, c = (tmp_path / n for n in ("fashion-mnist", "mnist", "other"))
    for root, seed in ((a, 0), (b, 0), (c, 1)):
        root.mkdir()
        rng = np.random.default_rng(seed)
        write_split(root, n=20, gz=True, images=rng.integers(0, 256, (20, 28, 28), dtype=np.uint8))
        write_split(root, n=10, split="test")
    assert data.fingerprint(a) == data.fingerprint(b) != data.fingerprint(c)
    cache = tmp_path / "cache"
    assert data.fingerprint(a, cache) == data.fingerprint(a, cache) == data.fingerprint(a)


def test_dataset_cache_unwritable(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    imgs, _ = write_split(root, n=10, gz=True)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    a, _ = data.load_split(root, "train", blocker / "cache")   # cannot be made: read as if uncached
    assert np.array_equal(a, imgs)


def test_dataset_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("LENET_DATA_CACHE", str(tmp_path / "c"))
    assert data.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("LENET_DATA_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert data.cache_dir() == tmp_path / "x" / "lenet" / "data"


@pytest.mark.parametrize("gz", [False, True])
def test_the_images_a_header_declares_are_read_from_its_first_bytes(tmp_path, gz):
    """What lenet.train plans with before the data is read (Note [the model beside the data]): the images
    header's count, raw or gzipped, where the file's size agrees with it; None where the file is missing, not
    an images file of 28x28 images, its header cut short, or its size another count's (a header that claims
    a million images on a small file sizes no model)."""
    write_split(tmp_path, n=37, gz=gz)
    write_split(tmp_path, n=11, split="test", gz=gz)
    assert (data.declared_images(tmp_path, "train"), data.declared_images(tmp_path, "test")) == (37, 11)
    name = data.SPLITS["train"][0] + (".gz" if gz else "")
    raw = idx_bytes(np.zeros((37, 28, 28), np.uint8))
    for bad, want in ((raw, 37), (raw[:-100], None), (raw + b"\0", None), (raw[:6], None), (b"", None),
                      (b"\x00\x00\x08\x01" + raw[4:], None), (b"\x00\x00\x0d\x03" + raw[4:], None),
                      (raw[:4] + (10 ** 6).to_bytes(4, "big") + raw[8:], None),
                      (idx_bytes(np.zeros((37, 28, 27), np.uint8)), None)):
        (tmp_path / name).write_bytes(gzip.compress(bad, mtime=0) if gz else bad)
        assert data.declared_images(tmp_path, "train") == want, bad[:16]
    if gz:
        (tmp_path / name).write_bytes(b"\x1f\x8b" + b"\xff" * 40)   # gzip's magic, then garbage
        assert data.declared_images(tmp_path, "train") is None
    (tmp_path / name).unlink()
    assert data.declared_images(tmp_path, "train") is None
    assert data.declared_images(tmp_path / "nowhere", "test") is None
