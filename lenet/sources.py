"""A dataset's files before NumPy: where datasets are looked for, the dataset cache's folder and its index of the
source files' digests, and the reads of a first run's gzipped images begun at a program's first line. The
standard library and lenet.files only, so that python -m lenet.train can start them before its own imports
(lenet/startup.py: begin); lenet/data.py reads, validates and caches the IDX files through these.

Note [the images read from the first line]: on a first run (the dataset cache empty), inflating the training
images on the main thread, after its imports, was the longest way to the first step once the plans on the preload
thread no longer were (Note [the heuristic's engine] in lenet/engines/registry.py). So ``read_early`` starts, on a
thread a file, the read, digest and inflate of the gzipped images files of the dataset folder a program's command
line names (its --data-dir, else $LENET_DATA, else the first folder ``candidates`` lists that holds a whole
dataset, as data.find_dataset looks) as the program starts, beside its imports: zlib and hashlib let go of the GIL
for a whole call. Nothing is decided there: ``taken`` hands data.read_idx_cached the bytes read, their digest and
the inflated stream where the file there is still the one read (its inode, size, modification and change times),
and the IDX checks are data.read_idx's, on the whole stream as the file's own inflate would give it (a stream cut
short, of several gzip members, or followed by other bytes, a corrupt one, one larger than EARLY_LIMIT_BYTES:
nothing taken, read as before). A later run, whose copy is in the dataset cache, reads nothing early (the index
names the file's digest, the copy is there); data.load_splits lets go of the reads nobody took (a folder guessed
wrong). Only regular files are opened (a pipe or a device never is: a writer waiting on a pipe stays waiting),
nothing is written, and on a machine of fewer than EARLY_MIN_CPUS CPUs nothing is read early (there the reads
slowed the imports: a bad flag's one line came later). The measurements: docs/performance.md, "Notes' numbers".
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import zlib
from pathlib import Path

from . import files

SPLITS = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
KNOWN = ("fashion-mnist", "mnist", "kmnist", "emnist")
SYSTEM_DIRS = (Path("/usr/share/datasets/fashion-mnist"),)   # Debian: apt-get install dataset-fashion-mnist
INDEX_LIMIT = 64                 # index.json remembers at most this many files, the most recent
EARLY_LIMIT_BYTES = 256 << 20    # read_early inflates no file whose gzip trailer declares more
EARLY_MIN_CPUS = 4               # ... and reads nothing on a machine of fewer CPUs


class DataError(ValueError):
    """A dataset that is missing, truncated or corrupt; names the file and what is wrong."""


class NotAFile(DataError):
    """Something other than a regular file where a dataset's file should be."""


def candidates(data_dir=None) -> list[Path]:
    """Where a dataset is looked for, in order."""
    if data_dir is not None:
        return [Path(data_dir)]
    out = []
    if os.environ.get("LENET_DATA"):
        out.append(Path(os.environ["LENET_DATA"]))
    out += [Path("data") / name for name in KNOWN]
    out += list(SYSTEM_DIRS)
    return out


def _file(root: Path, stem: str) -> Path:
    """The file of ``stem`` in the dataset folder ``root``: the raw file, else the gzipped one (either name
    form); a one-line DataError where there is none, NotAFile where something else stands there."""
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        p = root / name
        kind, words = files.what_is(p)
        if kind == "file":
            return p
        if kind != "missing":   # a folder, a pipe, a link to nothing where the file should be: say what it is
            raise NotAFile(f"{files.show(p)} is {words}, " + ("not an IDX file" if kind == "folder" else
                                                               "not a regular file holding an IDX file"))
    raise DataError(f"{files.show(root)}: no {stem} or {stem}.gz")


def complete(root: Path) -> bool:
    """Whether the folder ``root`` holds a file of each of a dataset's four."""
    try:
        for pair in SPLITS.values():
            for stem in pair:
                _file(root, stem)
        return True
    except DataError:
        return False


# ------------------------------------------------------------------ the dataset cache's index (Note [dataset cache])

def cache_dir() -> Path | None:
    """Where inflated copies of gzipped IDX files are kept (Note [dataset cache] in lenet/data.py):
    $LENET_DATA_CACHE, else $XDG_CACHE_HOME/lenet/data, else ~/.cache/lenet/data; None where there is no
    cache folder (Note [cache folders] in lenet/files.py)."""
    if os.environ.get("LENET_DATA_CACHE"):
        return Path(os.environ["LENET_DATA_CACHE"])
    return files.cache_path("data")


def entry_path(cache: Path, digest: str, path: Path) -> Path:
    """The cache's inflated copy of the gzipped file ``path`` whose bytes have ``digest``."""
    return cache / f"{digest}-{path.name[:-3]}.npy"


def _current(key: str, entry) -> bool:
    """Whether an index entry still describes its file (there, the same size and modification time)."""
    try:
        st = os.stat(key)
    except OSError:
        return False
    return isinstance(entry, dict) and entry.get("state") == [st.st_size, st.st_mtime_ns]


def _remember(cache: Path, key: str, entry) -> None:
    """index.json with ``key`` set (or dropped, for None), entries of files gone or changed dropped, and at
    most INDEX_LIMIT kept, the newest (Note [dataset cache])."""
    with _index_lock:
        index = {k: v for k, v in _index(cache).items() if k != key and _current(k, v)}
        if entry is not None:
            index[key] = entry   # newest last
        for k in list(index)[: max(0, len(index) - INDEX_LIMIT)]:
            del index[k]
        files.write_atomic(cache / "index.json", json.dumps(index).encode())


def _index(cache: Path) -> dict:
    """index.json as a dict of entries; {} where it is missing, not a regular file, or not an object."""
    try:
        v = files.json_of(files.read_input(cache / "index.json", limit=64 << 20).decode())
        return v if isinstance(v, dict) else {}
    except (OSError, ValueError):   # files.InputError is a ValueError: a pipe there is never read
        return {}


_index_lock = threading.Lock()   # index.json's read-modify-write, from the threads of load_splits


def remembered(path: Path, cache: Path | None, st: os.stat_result | None = None) -> tuple[str, list, str | None]:
    """(index key, state, the digest index.json remembers for the file as it is now, or None); ``st``: the
    file's stat, when the caller has it."""
    st = path.stat() if st is None else st
    key, state = os.path.realpath(path), [st.st_size, st.st_mtime_ns]
    hit = _index(cache).get(key) if cache is not None else None
    if isinstance(hit, dict) and hit.get("state") == state and isinstance(hit.get("digest"), str):
        return key, state, hit["digest"]
    return key, state, None


def source_digest(path: Path, cache: Path | None = None, data: bytes | None = None, digest: str | None = None) -> str:
    """A digest of a file's bytes (BLAKE2b, 16 bytes as hex), remembered in the cache's index.json by
    the file's path, size and modification time so a second run does not read it again; ``data``:
    the file's bytes, when the caller read them already; ``digest``: theirs, when it has it too."""
    path = Path(path)
    key, state, known = remembered(path, cache)
    if known is not None:
        return known
    if digest is None and data is not None:
        digest = _digest(data)
    if digest is None:
        h = hashlib.blake2b(digest_size=16)
        with files.open_input(path, "", "IDX file", DataError) as f:   # 16 MB a read: the GIL is taken back once a block
            for block in iter(lambda: f.read(16 << 20), b""):
                h.update(block)
        digest = h.hexdigest()
    if cache is not None:   # once the checks passed (Note [nothing written before the checks] in lenet/files.py)
        files.write_when_allowed(_remember_quietly, cache, key, {"state": state, "digest": digest})
    return digest


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _remember_quietly(cache: Path, key: str, entry) -> None:
    try:
        cache.mkdir(parents=True, exist_ok=True)
        _remember(cache, key, entry)
    except (OSError, ValueError):
        pass   # a cache that cannot be written costs the speed only


def forget(path: Path, cache: Path | None) -> None:
    """Drop ``path`` from the cache's index (a file that did not validate: nothing to remember of it)."""
    if cache is None:
        return
    files.write_when_allowed(_remember_quietly, cache, os.path.realpath(path), None)


# ------------------------------------------------------------------ reads from the first line

class Early:
    """One file's read begun by ``read_early``: ``done`` once it ended; then ``state`` (the file's identity as
    read: ``_identity``), ``raw`` (its bytes), ``digest`` and ``inflated`` (its whole inflated stream), or None
    where nothing is to be taken."""

    def __init__(self):
        self.done = threading.Event()
        self.state = self.raw = self.digest = self.inflated = None


_early: dict[str, Early] = {}   # a file's real path -> its read


def read_early(args: list[str], splits=("train", "test")) -> None:
    """Note [the images read from the first line]: start reading the gzipped images files of ``splits`` in the
    dataset folder the command line ``args`` names, each on a thread of its own; on a machine of fewer than
    EARLY_MIN_CPUS CPUs, none (the reads would take a CPU the imports need)."""
    if "--synthetic" in args or _cpus() < EARLY_MIN_CPUS:   # train_step's random batches: no dataset read
        return
    try:
        root = _named_folder(args)
        if root is None:
            return
        cache = cache_dir()
        for split in splits:
            path = _file(root, SPLITS[split][0])   # the file the program reads: a raw one is read as it is
            key = os.path.realpath(path)
            if path.suffix != ".gz" or key in _early:
                continue
            _early[key] = Early()
            threading.Thread(target=_read, args=(path, cache, _early[key]), name="lenet-read-early",
                             daemon=True).start()
    except (OSError, ValueError, TypeError):   # DataError too: a folder the program's own checks will name
        return


def drop_early() -> None:
    """Let go of the reads nobody took (a folder guessed wrong): called once a program has read its data."""
    _early.clear()


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _named_folder(args: list[str]) -> Path | None:
    """The dataset folder the program will read, as far as the command line says it plainly: the last
    --data-dir (as argparse takes it, abbreviations from --data on), else $LENET_DATA, else the first of
    ``candidates`` that holds a whole dataset (as data.find_dataset looks); None where that is not plain (the
    program finds its own, as ever)."""
    given = None
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if len(name) >= len("--data") and "--data-dir".startswith(name):
            if eq:
                given = value
            elif i + 1 < len(args):
                given = args[i + 1]
    if given is not None:
        return Path(given) if given else None   # --data-dir '': no folder at all
    if os.environ.get("LENET_DATA"):
        return Path(os.environ["LENET_DATA"])
    return next((r for r in candidates() if r.is_dir() and complete(r)), None)


def _identity(st: os.stat_result) -> tuple:
    """What says a file is the one read: its device, inode, size, modification and change times (a file of the
    same size and modification time renamed into its place is another inode)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _read(path: Path, cache: Path | None, early: Early) -> None:
    try:
        first = os.stat(path)
        if not stat.S_ISREG(first.st_mode) or not 18 <= first.st_size <= EARLY_LIMIT_BYTES:
            return   # a pipe, a device: never opened (a writer waiting on a pipe stays waiting)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))   # replaced meanwhile by a pipe: never waits
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or _identity(st)[:2] != _identity(first)[:2]:
                return
            os.set_blocking(fd, True)
            _, _, digest = remembered(path, cache, st)
            if digest is not None and cache is not None and entry_path(cache, digest, path).is_file():
                return   # a later run: the copy is mapped from the cache
            raw = f.read()
        if not isinstance(raw, bytes) or len(raw) != st.st_size:
            return
        digest = digest if digest is not None else _digest(raw)
        if cache is not None and entry_path(cache, digest, path).is_file():
            return   # another folder's copy of the same file is cached: mapped from there
        want = int.from_bytes(raw[-4:], "little") + 1   # the trailer's size of the (last) member, and one more
        if want > EARLY_LIMIT_BYTES:
            return
        d = zlib.decompressobj(wbits=31)
        inflated = d.decompress(raw, want)
        if not d.eof or d.unused_data or d.unconsumed_tail or len(inflated) >= want:
            return   # cut short, several members, bytes after the member, more than its trailer says: as before
        early.state, early.raw, early.digest, early.inflated = _identity(st), raw, digest, inflated
    except Exception:   # noqa: BLE001 (nothing is taken: the program reads the file itself, and says what is wrong)
        early.state = early.raw = early.digest = early.inflated = None
    finally:
        early.done.set()


def taken(path: Path) -> Early | None:
    """The read ``read_early`` began of ``path`` once it ended (waiting for it), where it read the file that is
    there now (the same inode, size, modification and change times); None where it began none, or has nothing to
    give. Taken once: its bytes are the caller's from then on."""
    early = _early.pop(os.path.realpath(path), None) if _early else None
    if early is None:
        return None
    early.done.wait()
    try:
        st = os.stat(path)
    except OSError:
        return None
    return early if early.raw is not None and early.state == _identity(st) else None
