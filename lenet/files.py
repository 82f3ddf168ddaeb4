"""Writing files without ever losing one: the one atomic writer every program uses, and the
checks that keep a program from writing over its own inputs or into a place it cannot.

Note [atomic writes]: a file is written to a temporary file in the same folder, flushed and
fsynced, given the permissions the umask allows (0666 & ~umask, as open() would; mkstemp
alone makes it 0600), renamed over the target, and the folder is fsynced so the rename itself
survives a crash. An interruption at any point leaves either the old file or the new one,
never a mix, and a temporary that was being written is removed.
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
from pathlib import Path


def cache_path(name: str) -> Path:
    """Where the cache ``name`` lives unless its own variable says otherwise:
    $XDG_CACHE_HOME/lenet/<name>, else ~/.cache/lenet/<name>."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lenet" / name


class OutputError(ValueError):
    """An output path that cannot or must not be written; names the flag and what is allowed."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (see Note [atomic writes]). A failure to write (a
    full disk, a folder that takes no files) is one OutputError naming the path, and leaves nothing."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
        raise
    _fsync_dir(path.parent)


def _writable(folder: Path) -> bool:
    """Whether a file can be made in ``folder``: tried, not asked (os.access says yes to root even where
    nothing can be written, as under /proc)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".lenet-probe.", suffix=".tmp")
    except OSError:
        return False
    os.close(fd)
    os.unlink(tmp)
    return True


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass   # some file systems cannot fsync a folder; the rename is still atomic
    finally:
        os.close(fd)


_writes: list[threading.Thread] = []   # started by write_later, joined by wait_for_writes


def write_later(fn, *args) -> None:
    """Run ``fn(*args)``, a write nothing in this run reads back (a cache's new entry), on a thread of
    its own, so the run goes on meanwhile. The thread is not a daemon: an interpreter that exits
    waits for it, and a program that leaves through os._exit (cli.leave) calls wait_for_writes
    first, so a write is never cut short and no temporary file is left behind."""
    t = threading.Thread(target=fn, args=args, name="lenet-cache-write")
    _writes.append(t)
    t.start()


def wait_for_writes() -> None:
    """Wait for every write_later write of this process to end."""
    while _writes:
        _writes.pop().join()


def save_npz(path, arrays: dict) -> None:
    """An .npz of ``arrays``, written atomically."""
    import numpy as np

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_atomic(path, buf.getvalue())


def append_line(path, line: str) -> None:
    """Append one line and fsync it (a line log: an interruption loses at most that line)."""
    with open(path, "a") as f:
        f.write(line.rstrip("\n") + "\n")
        f.flush()
        os.fsync(f.fileno())


def same_file(a, b) -> bool:
    """Whether two paths name one file (through links, relative paths, ..)."""
    a, b = Path(a), Path(b)
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output_file(path, flag: str, inputs=()) -> Path:
    """The file a program will write: its folder exists and is writable, it is not a folder, and
    it is none of the program's ``inputs``. One-line OutputError otherwise."""
    path = Path(path)
    for i in inputs:
        if i is not None and (same_file(path, i) or path.resolve() == Path(i).resolve()):
            raise OutputError(f"{flag} {path} is also an input of this program ({i}); write to another file")
    if path.is_dir():
        raise OutputError(f"{flag} {path} is a folder; give a file name")
    parent = path.parent
    if not parent.exists():
        raise OutputError(f"{flag} {path}: the folder {parent} does not exist")
    if not parent.is_dir():
        raise OutputError(f"{flag} {path}: {_first_file(parent)} is a file, not a folder")
    if not _writable(parent):
        raise OutputError(f"{flag} {path}: the folder {parent} is not writable")
    return path


def check_output_dir(path, flag: str) -> Path:
    """A folder a program will write into: it is a writable folder, or the nearest folder above
    it that exists is writable (so it can be made). Checks only: makes nothing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{flag} {path} is a file, not a folder; give a folder")
    blocker = _first_file(path)
    if blocker is not None:
        raise OutputError(f"{flag} {path}: {blocker} is a file, not a folder")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not _writable(existing):
        raise OutputError(f"{flag} {path}: the folder {existing} is not writable")
    return path


def _first_file(path: Path) -> Path | None:
    """The first component of ``path`` that exists and is not a folder, if any."""
    p = Path()
    for part in path.parts:
        p = p / part
        if p.exists() and not p.is_dir():
            return p
        if not p.exists():
            return None
    return None
