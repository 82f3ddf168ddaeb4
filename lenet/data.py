"""IDX datasets (MNIST, Fashion-MNIST, KMNIST, EMNIST): reading, validation, locating.

The IDX format: a 4-byte magic (0, 0, type code, number of dims), one big-endian
uint32 per dim, then the data. Images are type 0x08 (ubyte) with 3 dims, labels
0x08 with 1 dim. Files may be gzipped (detected by content, not by name).
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from . import files, sources
# Re-exported where callers have long found them: the splits' files, where datasets are looked for, the cache's
# folder and index (lenet/sources.py, which needs no NumPy).
from .sources import (KNOWN, SPLITS, SYSTEM_DIRS, DataError, NotAFile, _file, cache_dir, candidates,  # noqa: F401
                      complete, entry_path, forget, remembered, source_digest)

_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
          0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


# More than any IDX dataset this reads (EMNIST's largest split is ~0.6 GB): a header that
# declares more is refused before anything is read.
MAX_BYTES = 4 << 30


class _Gunzip:
    """A gzip file's data, read as gzip.GzipFile reads it (every member; each member's CRC and length
    checked by zlib) but from the compressed bytes in memory, each ``read(n)`` one zlib call.

    Note [inflating beside threads]: GzipFile inflates 128 KB of input per call and takes the GIL
    back between calls; beside the start-up threads, which hold the GIL for most of their imports
    (Note [overlapped start-up] in lenet/startup.py), each of Fashion-MNIST's 200 calls waited for
    its turn, and reading its training images took several times as long as alone (docs/probes.md,
    read_beside.py). zlib lets go of the GIL for the whole of one call (taking it back only to grow its
    output, about ten times for 47 MB), so a read costs about the same beside them as alone. For
    the same reason a first read of a gzip file reads its bytes once, hashes them in one call for
    the cache's key and inflates them (read_idx_cached), where it read the file in 1 MB blocks to
    hash it and again to inflate it."""

    def __init__(self, raw: bytes):
        self._d, self._pending = zlib.decompressobj(wbits=31), raw

    def read(self, n: int) -> bytes:
        parts = []
        while n > 0:
            if self._d.eof:
                if not self._d.unused_data:
                    break   # the last member ended
                self._d, self._pending = zlib.decompressobj(wbits=31), self._d.unused_data
            chunk = self._d.decompress(self._pending, n)
            self._pending = self._d.unconsumed_tail
            if not chunk and not self._pending and not self._d.eof:
                raise EOFError("compressed file ended before the end-of-stream marker was reached")
            parts.append(chunk)
            n -= len(chunk)
        return b"".join(parts)


class _Whole:
    """A gzip file's whole inflated stream, read as _Gunzip reads the file: each ``read(n)`` a view of the next
    n bytes, no copy (the images' 47 MB are read once, and the array read_idx returns is a view of them)."""

    def __init__(self, inflated: bytes):
        self._v, self._at = memoryview(inflated), 0

    def read(self, n: int) -> memoryview:
        out = self._v[self._at:self._at + n]
        self._at += len(out)
        return out


def _gzip_bytes(path: Path, label: str = "") -> bytes:
    """A gzip file's bytes, in one read; a file larger than any IDX dataset's is refused first."""
    with files.open_input(path, label, "IDX file", DataError) as f:
        return _whole(f, files.show(path))


def _whole(f, shown: str) -> bytes:
    """An open gzip file's bytes, in one read; a file larger than any IDX dataset's is refused first."""
    size = os.fstat(f.fileno()).st_size
    if size > MAX_BYTES:
        raise DataError(f"{shown}: {size} bytes of gzip, more than the {MAX_BYTES >> 30} GiB an IDX file of a "
                        f"dataset for LeNet can hold")
    return f.read()


def read_idx(path, *, ndim: int | None = None, data: bytes | None = None, label: str = "",
             inflated: bytes | None = None) -> np.ndarray:
    """Read one IDX file (raw or gzipped), validating magic, dims and size.

    Note [bounded IDX reading]: the header is read first and the data after it is read up to
    the size the header declares plus one byte, so a gzip file that inflates beyond what its
    header says is an error found after reading that much, never a memory spike. A gzip file's
    compressed bytes are read whole (a file of more than MAX_BYTES is refused first), then
    inflated as far as that (Note [inflating beside threads]). ``data``: the file's bytes, when
    the caller read them already; ``inflated``: a gzip file's whole inflated stream, when the caller has
    that too (Note [the images read from the first line] in lenet/sources.py), read as its inflate would
    give it; ``label``: the flag that named the file (its messages name it).
    """
    shown = files.show(path) if not label else f"{label} {files.show(path)}"
    f = files.open_input(path, label, "IDX file", DataError) if data is None else io.BytesIO(data)
    path = shown   # every message below names the file as the user gave it, escaped
    with f:
        gz = f.read(2) == b"\x1f\x8b"
        f.seek(0)
        try:
            src = (_Whole(inflated) if inflated is not None else
                   _Gunzip(data if data is not None else _whole(f, path))) if gz else f
            head = src.read(4)
            if len(head) < 4:
                raise DataError(f"{path}: too short for an IDX header ({len(head)} bytes)")
            if head[0] != 0 or head[1] != 0 or head[2] not in _TYPES:
                raise DataError(f"{path}: bad IDX magic number {head.hex()} (want 0000 then a type code "
                                f"and a dim count, e.g. 00000803 for images)")
            dt, nd = np.dtype(_TYPES[head[2]]), head[3]
            if ndim is not None and nd != ndim:
                raise DataError(f"{path}: has {nd} dimensions, expected {ndim}")
            dims_raw = src.read(4 * nd)
            if len(dims_raw) < 4 * nd:
                raise DataError(f"{path}: truncated header ({4 + len(dims_raw)} bytes)")
            dims = tuple(int(d) for d in np.frombuffer(dims_raw, ">u4", nd))
            if any(d == 0 for d in dims):
                raise DataError(f"{path}: a dimension is zero {dims}")
            want = int(np.prod(dims, dtype=np.float64)) * dt.itemsize
            if want > MAX_BYTES:
                raise DataError(f"{path}: header declares {dims}, {want} data bytes: more than the "
                                f"{MAX_BYTES >> 30} GiB an IDX file of a dataset for LeNet can hold")
            body = src.read(want + 1)   # see Note [bounded IDX reading]
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: corrupt gzip data ({files.escaped(str(e))})") from None
    if len(body) != want:
        if len(body) < want:
            raise DataError(f"{path}: truncated: header says {dims} ({want} data bytes), file has {len(body)}")
        what = "inflates beyond the size its header declares" if gz else "has trailing bytes"
        raise DataError(f"{path}: {what}: header says {dims} ({want} data bytes)")
    return np.frombuffer(body, dt).reshape(dims)


def idx_bytes(a: np.ndarray) -> bytes:
    """An IDX file's bytes for a uint8 array (the inverse of read_idx, raw)."""
    if a.dtype != np.uint8:
        raise ValueError(f"IDX bytes are written from uint8 arrays, got {a.dtype}")
    return bytes([0, 0, 0x08, a.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in a.shape) + a.tobytes()


CACHE_LIMIT_BYTES = 512 << 20   # the dataset cache keeps its most recently used entries up to this size


def read_idx_cached(path, *, ndim: int, cache: Path | None, pending: list | None = None) -> np.ndarray:
    """read_idx, through an inflated copy in ``cache`` for a .gz file.

    Note [dataset cache]: inflating Fashion-MNIST's training images (26 MB of gzip, 47 MB of
    pixels) takes 0.25-0.4 s, the largest piece of a training run's start-up once the plan
    cache is warm; a .npy copy is mapped in milliseconds. An entry is named by a digest of the
    source's bytes (source_digest, remembered by path, size and modification time), so copies of
    one dataset in several folders share their entries and a changed source gets a new one. A
    copy missing from the cache is not written here but put on ``pending`` (when given), and
    written by ``commit`` once the whole dataset validated: a run that fails on another file
    leaves no entry (python -m lenet.train commits on a thread, files.write_later, while it
    starts training: its fsync stays off the way to the first step). The cache keeps its most recently used entries up to CACHE_LIMIT_BYTES. A
    missing, truncated or unreadable entry is read from the source again; a cache folder that
    cannot be written costs nothing but the speed. Raw IDX files are read directly."""
    path = Path(path)
    early = sources.taken(path)   # read from the program's first line (Note [the images read from the first line])
    given = {} if early is None else {"data": early.raw, "inflated": early.inflated}
    if cache is None or path.suffix != ".gz" or not path.is_file():
        return read_idx(path, ndim=ndim, **given)
    raw, digest = None, remembered(path, cache)[2]
    if digest is None:   # a first read: its bytes are hashed and inflated from one read
        raw = _gzip_bytes(path) if early is None else early.raw
        digest = source_digest(path, cache, raw, None if early is None else early.digest)
    entry = entry_path(cache, digest, path)
    try:
        if files.what_is(entry)[0] != "file":   # not there, or a pipe or a link to nothing: never read
            raise FileNotFoundError(entry)
        a = np.load(entry, mmap_mode="r", allow_pickle=False)
        if a.dtype == np.uint8 and a.ndim == ndim and min(a.shape) > 0:
            try:
                os.utime(entry)   # recently used: kept longest
            except OSError:
                pass
            return a
    except (OSError, ValueError):
        pass   # not there yet, or damaged: read the source, and write it again once validated
    try:
        a = read_idx(path, ndim=ndim, **(given or {"data": raw}))
    except DataError:
        forget(path, cache)   # an invalid file is not remembered
        raise
    if pending is not None:
        pending.append((entry, a))
    else:
        commit([(entry, a)], cache)
    return a


def commit(pending: list, cache: Path | None, limit: int = CACHE_LIMIT_BYTES) -> None:
    """Write the validated copies ``pending`` into ``cache`` (Note [dataset cache]), then remove the
    least recently used entries beyond ``limit`` bytes."""
    if cache is None:
        return
    try:
        for entry, a in pending:
            cache.mkdir(parents=True, exist_ok=True)
            buf = io.BytesIO()
            np.save(buf, np.asarray(a), allow_pickle=False)
            files.write_atomic(entry, buf.getvalue())
        entries = sorted(cache.glob("*.npy"), key=lambda p: p.stat().st_mtime, reverse=True)
        total = 0
        for e in entries:
            total += e.stat().st_size
            if total > limit:
                e.unlink(missing_ok=True)
    except (OSError, ValueError):
        pass


def load_split(root, split: str, cache: Path | None = None, pending: list | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, 28, 28), labels uint8 (N,)) of 'train' or 'test' in root, validated;
    gzipped files through inflated copies in ``cache`` when given (Note [dataset cache]): written
    once this split validated, or, with ``pending``, left there for the caller's ``commit``."""
    root = Path(root)
    mine = [] if pending is None else pending
    img_p, lab_p = (_file(root, s) for s in SPLITS[split])
    images, labels = (read_idx_cached(img_p, ndim=3, cache=cache, pending=mine),
                      read_idx_cached(lab_p, ndim=1, cache=cache, pending=mine))
    if images.dtype != np.uint8 or labels.dtype != np.uint8:
        raise DataError(f"{files.show(img_p if images.dtype != np.uint8 else lab_p)}: expected unsigned bytes (type 0x08)")
    if images.shape[1:] != (28, 28):
        raise DataError(f"{files.show(img_p)}: images are {images.shape[1]}x{images.shape[2]}, LeNet takes 28x28")
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"{files.show(img_p)} has {images.shape[0]} images but {files.show(lab_p)} has {labels.shape[0]} labels")
    if labels.max() >= 10:
        raise DataError(f"{files.show(lab_p)}: labels must be in 0..9, found {int(labels.max())}")
    if pending is None:
        commit(mine, cache)
    return images, labels


def declared_images(root, split: str) -> int | None:
    """How many 28x28 images the header of ``split``'s images file in ``root`` declares, where the file's size
    agrees (a raw file's bytes, a gzip file's inflated size as its trailer gives it, are the header's 16 and
    28 x 28 an image); read from its first 64 KB (inflated as far as the header) and its last 4 bytes. None
    where there is no such file, no such header, or the sizes disagree. What a program may plan with before
    the split is read (Note [the model beside the data] in lenet/train.py): load_split's checks still decide."""
    try:
        path = _file(Path(root), SPLITS[split][0])
        with files.open_input(path, "", "IDX file", DataError) as f:
            first = f.read(1 << 16)
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - 4))
            last = f.read(4)
        gz = first[:2] == b"\x1f\x8b"
        head = zlib.decompressobj(wbits=31).decompress(first, 16) if gz else first[:16]
    except (DataError, OSError, zlib.error, KeyError):
        return None
    if len(head) < 16 or head[:4] != b"\x00\x00\x08\x03" or head[8:16] != bytes([0, 0, 0, 28, 0, 0, 0, 28]):
        return None
    n = int.from_bytes(head[4:8], "big")
    whole = 16 + 784 * n
    agrees = int.from_bytes(last, "little") == whole % (1 << 32) if gz else size == whole
    return n if n and agrees else None


def load_splits(root, splits=("train", "test"), cache: Path | None = None, pending: list | None = None
                ) -> list[tuple[np.ndarray, np.ndarray]]:
    """load_split of each of ``splits``, read at once on threads of their own (zlib and the file
    reads let go of the GIL: Fashion-MNIST's test split is read while its training images inflate);
    the first split's error is raised first, as one after the other would."""
    try:
        with ThreadPoolExecutor(len(splits), thread_name_prefix="lenet-read") as pool:
            futures = [pool.submit(load_split, root, s, cache, pending) for s in splits]
            return [f.result() for f in futures]
    finally:
        sources.drop_early()   # reads from the first line of files not read here (a folder guessed wrong): let go


def fingerprint(root, cache: Path | None = None) -> str:
    """What identifies a dataset for --resume: a digest of its four files' bytes (not its folder's name)."""
    h = hashlib.blake2b(digest_size=16)
    for split in ("train", "test"):
        for stem in SPLITS[split]:
            h.update(source_digest(_file(Path(root), stem), cache).encode())
    return h.hexdigest()


def find_dataset(data_dir=None) -> Path | None:
    """The first directory holding all four IDX files; None if none does (or data_dir lacks them).
    $LENET_DATA, when set and data_dir is not, is the only place looked in: one it does not name a
    dataset folder by is a DataError naming it, never a silent fall-back to another dataset."""
    if data_dir is None and os.environ.get("LENET_DATA"):
        root = Path(os.environ["LENET_DATA"])
        problem = _folder_problem("$LENET_DATA", root)
        if problem:
            raise DataError(problem)
        return root
    if data_dir is not None and not os.fspath(data_dir):
        return None   # --data-dir '': no folder at all (not_found_message says so), never the current one
    for root in candidates(data_dir):
        try:
            if root.is_dir() and complete(root):
                return root
        except OSError:   # a name the system refuses: not a dataset (not_found_message says why)
            continue
    return None


def _folder_problem(label: str, root: Path) -> str | None:
    """Why ``root`` (given by ``label``) is no dataset folder, in one line; None where it is one."""
    if not os.fspath(root):
        return f"{label} is empty: give a folder holding the four IDX files"
    try:
        kind, words = files.what_is(root)
        if kind == "missing":
            return f"{label} {files.show(root)}: no such folder"
        if kind in ("dangling", "loop"):
            return f"{label} {files.show(root)} is {words}; give a folder holding the four IDX files"
        if kind != "folder":
            return f"{label} {files.show(root)} is {words}, not a folder holding the four IDX files"
        missing = missing_files(root)
    except OSError as e:
        return files.os_error(e, label)
    except DataError as e:
        return f"{label}: {e}"
    if missing:
        return (f"{label} {files.show(root)}: missing {', '.join(missing)} (each raw or .gz); a dataset folder "
                f"holds {', '.join(s for pair in SPLITS.values() for s in pair)}")
    return None


def missing_files(root: Path) -> list[str]:
    """The IDX files a dataset folder lacks (each may also be .gz)."""
    out = []
    for pair in SPLITS.values():
        for stem in pair:
            try:
                _file(root, stem)
            except NotAFile:   # there, but no file: say so rather than call it missing
                raise
            except DataError:
                out.append(stem)
    return out


def not_found_message(data_dir=None) -> str:
    if data_dir is not None:
        problem = _folder_problem("--data-dir", data_dir if data_dir == "" else Path(data_dir))
        if problem:
            return problem
    partial = [f"{files.show(p)} lacks {', '.join(missing_files(p))}" for p in candidates(data_dir)
               if p.is_dir() and 0 < len(missing_files(p)) < 4]
    where = ", ".join(files.show(p) for p in candidates(data_dir))
    return (f"no IDX dataset found (looked in: {where}{'; ' + '; '.join(partial) if partial else ''}); get "
            f"Fashion-MNIST with 'apt-get install dataset-fashion-mnist' or put the four IDX files in "
            f"./data/fashion-mnist or a directory named by --data-dir or $LENET_DATA")


def pixel_stats(images: np.ndarray) -> tuple[float, float]:
    """Mean and standard deviation of pixels / 255 over a uint8 image set.

    From the exact integer sums of the pixels and of their squares (Python ints: no rounding
    until the last division), in ~0.05 s for 60k images; a histogram by np.bincount converts
    every byte to a 64-bit index first (0.5 s and 376 MB for the same images)."""
    flat = np.ascontiguousarray(images).reshape(-1)
    n = flat.size
    total = int(flat.sum(dtype=np.uint64))
    squares = int(np.einsum("i,i->", flat, flat, dtype=np.uint64))
    if n == 0 or n * squares == total * total:   # no pixels, or all of them equal
        raise DataError(f"the {n:,} training pixels are all {total // max(n, 1)}: there is nothing to normalize "
                        f"or learn from (give images that differ)")
    mean = total / (255.0 * n)
    std = math.sqrt(n * squares - total * total) / (255.0 * n)
    return mean, std


def dataset_name(root) -> str:
    """A short name for a dataset directory (its folder name, e.g. 'fashion-mnist')."""
    return Path(root).resolve().name


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The batch order of one epoch: a permutation of range(n) that depends only on (seed, epoch),
    so a resumed run draws exactly the batches an uninterrupted one would."""
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n).astype(np.int32)


def _mix(h: np.ndarray) -> np.ndarray:
    """lowbias32, as lenet_mix in kernels/data.cu (uint32 arithmetic, wrapping)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x7FEB352D)
    h = h ^ (h >> np.uint32(15))
    h = h * np.uint32(0x846CA68B)
    return h ^ (h >> np.uint32(16))


def augment_params(seed: int, epoch: int, positions, shift: int, flip: bool):
    """(dy, dx, mirrored) of the images at ``positions`` of an epoch's order: the numbers the
    gather kernel (kernels/data.cu) draws, computed on the host for references and tests."""
    h = _draws(seed, epoch, positions)
    span = np.uint32(2 * shift + 1)
    dx = (h % span).astype(np.int64) - shift
    dy = ((h // span) % span).astype(np.int64) - shift
    mirrored = ((h >> np.uint32(24)) & np.uint32(1)).astype(bool) & bool(flip)
    return dy, dx, mirrored


CUTOUT_MAX = 28   # a cutout's side in pixels, at most the whole image (its centre is drawn inside it)


def _draws(seed: int, epoch: int, positions) -> np.ndarray:
    """The gather kernel's hash h of each image at ``positions`` of an epoch (lenet_hash in data.cu)."""
    with np.errstate(over="ignore"):
        i = np.asarray(positions, dtype=np.uint32)
        s = _mix(np.uint32((seed + 0x9E3779B9) & 0xFFFFFFFF) * np.ones_like(i))
        return _mix(_mix(s ^ np.uint32(epoch & 0xFFFFFFFF)) ^ i)


def cutout_params(seed: int, epoch: int, positions, size: int):
    """(top, left) of each image's cutout square of side ``size`` (kernels/data.cu, lenet_cut): its centre
    uniform over the image, the square's first row and column size // 2 before it (and possibly outside)."""
    with np.errstate(over="ignore"):
        g = _mix(_draws(seed, epoch, positions) ^ np.uint32(0x68E31DA4))
    return (g % np.uint32(28)).astype(np.int64) - size // 2, ((g >> np.uint32(16)) % np.uint32(28)).astype(np.int64) - size // 2


def cut_images(images: np.ndarray, top, left, size: int) -> np.ndarray:
    """uint8 (n, 28, 28) images with rows top..top+size-1 and columns left..left+size-1 of each cleared to 0
    (clipped to the image): the cutout of the gather kernel, on images already mirrored and translated."""
    r = np.arange(28)[None, :, None] - np.asarray(top)[:, None, None]
    c = np.arange(28)[None, None, :] - np.asarray(left)[:, None, None]
    inside = (r >= 0) & (r < size) & (c >= 0) & (c < size)
    return np.where(inside, 0, images).astype(np.uint8)


def augment_images(images: np.ndarray, dy, dx, mirrored) -> np.ndarray:
    """uint8 (n, 28, 28) images mirrored where asked, then translated by (dy, dx) with a zero border:
    out[r, c] = image[r - dy, c' - dx], c' = 27 - c when mirrored (the gather kernel's rule)."""
    n = images.shape[0]
    r = np.arange(28)[None, :, None] - np.asarray(dy)[:, None, None]             # (n, 28, 1)
    c = np.arange(28)[None, None, :]
    c = np.where(np.asarray(mirrored)[:, None, None], 27 - c, c) - np.asarray(dx)[:, None, None]  # (n, 1, 28)
    inside = (r >= 0) & (r < 28) & (c >= 0) & (c < 28)
    out = images[np.arange(n)[:, None, None], np.clip(r, 0, 27), np.clip(c, 0, 27)]
    return np.where(inside, out, 0).astype(np.uint8)


def _to_device(a: np.ndarray, stream):
    """A device copy of ``a``, sent on ``stream`` straight from its own memory.

    Note [uploading a split]: cupy.asarray copies a large host array through page-locked memory of
    its own, which it allocates (and locks) first: the training split of Fashion-MNIST (47 MB, the
    dataset cache's memory-mapped copy) took that long on a training run's critical path. Sent from
    where it lies (ndarray.set: the driver stages pageable memory through its own buffers, and the
    host array may go once the call returns) it takes a fifth of the time (docs/probes.md, upload.py)."""
    import cupy

    with stream:   # from the pool of the stream that writes it (and frees it)
        out = cupy.empty(a.shape, a.dtype)
    out.set(np.ascontiguousarray(a), stream=stream)
    return out


class GpuDataset:
    """One split on the GPU as uint8, sent once; batches are gathered and normalized there."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, mean: float, std: float, stream=None):
        import cupy

        if images.dtype != np.uint8 or images.shape[1:] != (28, 28) or labels.shape != (images.shape[0],):
            raise ValueError(f"images must be uint8 (N, 28, 28) and labels (N,), got {images.shape} "
                             f"{images.dtype} and {labels.shape}")
        self.size = int(images.shape[0])
        self.mean, self.std = float(mean), float(std)
        self.stream = stream = stream or cupy.cuda.get_current_stream()
        self.images = _to_device(images, stream)                                   # (N, 28, 28) uint8
        self.labels = _to_device(labels.astype(np.uint8), stream)                  # (N,) uint8
        self.identity = _to_device(np.arange(self.size, dtype=np.int32), stream)   # (N,) for evaluation (uploaded: no arange kernel to compile)

    def order(self, seed: int, epoch: int):
        """The epoch's order of the split's images, sent on the split's stream: a model's gathers read it on
        theirs, which waits for no other, so a split read by one model is made on its stream (lenet.train); a
        pack's stream waits for its splits' (lenet.pack), whose orders it sends itself."""
        return _to_device(epoch_order(seed, epoch, self.size), self.stream)
