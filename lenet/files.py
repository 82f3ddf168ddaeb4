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
import sys
import tempfile
import threading
from pathlib import Path

from . import _early, interrupt

_temporaries: set = set()        # temporary files being written now (Note [atomic writes])
_temporary_names: set = set()    # (folder, prefix, suffix) of each: a signal between mkstemp and its record
_temporaries_lock = threading.Lock()


def discard_temporaries() -> None:
    """Remove every temporary file a write of this process has not finished, and every file of this run's
    own (``leftover``): what a program leaving through os._exit runs (on a signal: Note [signals from the
    first line] in lenet/interrupt.py; at its end: lenet.cli.leave), so the old files stay whole and
    nothing of ours stays behind."""
    import shutil

    with _temporaries_lock:
        found = set(_temporaries)
        for folder, prefix, suffix in _temporary_names:   # this process's names (its pid), recorded or not yet
            try:
                found.update(str(p) for p in Path(folder).glob(f"{prefix}*{suffix}"))
            except OSError:
                pass
        for tmp in found:
            try:
                if os.path.isdir(tmp):
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    os.unlink(tmp)
            except OSError:
                pass
        _temporaries.clear()


interrupt.before_exit(discard_temporaries)


def leftover(path: str) -> None:
    """A file or folder of this run's own, removed when the process ends however it ends."""
    import atexit

    with _temporaries_lock:
        _temporaries.add(path)
    atexit.register(discard_temporaries)


def temporary(folder, prefix: str, suffix: str = ".tmp") -> tuple[int, str]:
    """mkstemp in ``folder``, remembered until ``finished(tmp)``: a signal removes it meanwhile (its name
    holds this process's id, so even one a signal meets between its making and its record is found)."""
    prefix = f"{prefix}{os.getpid()}."
    with _temporaries_lock:
        _temporary_names.add((str(folder), prefix, suffix))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=suffix)
    with _temporaries_lock:
        _temporaries.add(tmp)
    return fd, tmp


def finished(tmp: str) -> None:
    with _temporaries_lock:
        _temporaries.discard(tmp)


# Note [cache folders]: a cache is a convenience; a run never fails for lack of one, and never writes
# outside the folders the user named or the cache folders that exist. The root of our caches is
# $XDG_CACHE_HOME/lenet when XDG_CACHE_HOME is an absolute path (the XDG spec ignores a relative one),
# else $HOME/.cache/lenet when HOME is a folder that exists (HOME=/nonexistent, the home of Debian's
# nobody, made a root run create /nonexistent/.cache); it is made once per process, and where it cannot
# be (HOME=/proc, a read-only HOME), the run goes on without its caches after one warning line.
_root: dict = {}


def cache_root() -> Path | None:
    """The folder our caches live in, made if need be (Note [cache folders]); None: there is none."""
    with _root_lock:   # start-up threads ask too: one decision, one warning
        return _cache_root()


_root_lock = threading.Lock()


def _cache_root() -> Path | None:
    xdg = os.environ.get("XDG_CACHE_HOME") or ""
    home = os.environ.get("HOME") or ""
    if (xdg, home) in _root:   # decided once a run (a folder made meanwhile by another program changes nothing)
        return _root[(xdg, home)]
    base = _early.cache_base()
    base = None if base is None else Path(base)
    root, why = None, f"HOME={home or '(unset)'} is not a folder that exists"
    if base is not None:
        try:
            (base / "lenet").mkdir(parents=True, exist_ok=True)
            root = base / "lenet" if _writable(base / "lenet") else None
            why = f"{base / 'lenet'} is not writable"
        except OSError as e:
            why = f"{base / 'lenet'} cannot be made ({e.strerror or e})"
    _root[(xdg, home)] = root
    if root is None:   # one line a run, however many caches ask
        print(f"warning: no cache folder ({why}); running without the caches of earlier runs", file=sys.stderr)
    return root


def cache_path(name: str) -> Path | None:
    """Where the cache ``name`` lives unless its own variable says otherwise: <cache_root()>/<name>, or
    None where there is no cache folder (Note [cache folders])."""
    root = cache_root()
    return None if root is None else root / name


def library_caches() -> None:
    """Give the libraries that make cache folders of their own a folder they can make: CuPy (its kernel
    cache, ~/.cupy/kernel_cache or $CUPY_CACHE_DIR, made as it is imported: an import that fails where it
    cannot), the CUDA driver and NVRTC (their compute cache, ~/.nv/ComputeCache or $CUDA_CACHE_PATH, made
    on the GPU as kernels are compiled: HOME that did not exist was made, with .nv in it, on an H100
    machine) and matplotlib in the plotting child (its font cache, in $XDG_CACHE_HOME/matplotlib or
    ~/.cache/matplotlib, or $MPLCONFIGDIR: HOME=/nonexistent made /nonexistent/.cache, a relative
    XDG_CACHE_HOME a folder in the current one). Each keeps its own where that may be made (Note [cache
    folders]); else <cache_root()>/<library>; else a folder of this run's own, removed when it ends.
    Called by every program before CuPy's import and the driver's start (lenet/startup.py,
    lenet.cli.run); our programs compile no kernel through CuPy's cache."""
    home = os.environ.get("HOME") or ""
    xdg = os.environ.get("XDG_CACHE_HOME") or ""
    usable_home = os.path.isabs(home) and os.path.isdir(home)
    if not os.environ.get("CUDA_CACHE_DISABLE"):
        _keep_or_own("CUDA_CACHE_PATH", os.path.join(home, ".nv", "ComputeCache") if usable_home else "",
                     "nv-compute-cache")
    _keep_or_own("CUPY_CACHE_DIR", os.path.join(home, ".cupy", "kernel_cache") if usable_home else "", "cupy")
    _keep_or_own("MPLCONFIGDIR", os.path.join(xdg, "matplotlib") if os.path.isabs(xdg) else
                 os.path.join(home, ".cache", "matplotlib") if usable_home and not xdg else "", "matplotlib")


def _keep_or_own(variable: str, default: str, name: str) -> None:
    """A library's cache folder: $variable, else ``default`` (its own place; "": none), kept where it can be
    made; else _own_folder(name), set in $variable."""
    where = os.environ.get(variable) or default
    if not (where and _can_make(Path(where))):
        os.environ[variable] = _own_folder(name)


def _own_folder(name: str) -> str:
    """<cache_root()>/<name>, or a folder of this run's own, removed when it ends."""
    root = cache_root()
    if root is not None:
        return str(root / name)
    own = tempfile.mkdtemp(prefix=f"lenet-{name}-")
    leftover(own)
    return own


def _can_make(folder: Path) -> bool:
    """Whether ``folder`` exists as a writable folder, or its nearest existing ancestor is one, under a
    parent that exists (HOME itself is never made)."""
    if folder.is_dir():
        return _writable(folder)
    existing = folder
    while not existing.exists():
        if existing.parent == existing:
            return False
        existing = existing.parent
    home = os.environ.get("HOME") or ""
    if home and not os.path.isdir(home) and str(folder).startswith(home.rstrip("/") + "/"):
        return False
    return existing.is_dir() and _writable(existing)


class OutputError(ValueError):
    """An output path that cannot or must not be written; names the flag and what is allowed."""


def show(path) -> str:
    """A path as a one-line message shows it: bytes the terminal cannot take escaped (a name of bad bytes
    reaches Python as surrogates), and a very long one cut to its ends with its length."""
    s = os.fspath(path) if not isinstance(path, str) else path
    s = os.fsdecode(s) if isinstance(s, bytes) else s
    s = s.encode("utf-8", "backslashreplace").decode("utf-8").replace("\n", "\\n")
    return s if len(s) <= 120 else f"{s[:60]}...{s[-30:]} ({len(s)} characters)"


def os_error(e: OSError, what: str = "") -> str:
    """An OSError as one line: what, the name it is about (shown), and the system's reason."""
    name = getattr(e, "filename", None)
    where = f"{what} {show(name)}" if name is not None else what
    return f"{where.strip()}: {e.strerror or e}".strip(": ")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (see Note [atomic writes]). A failure to write (a
    full disk, a folder that takes no files) is one OutputError naming the path, and leaves nothing."""
    path = Path(path)
    try:
        fd, tmp = temporary(path.parent, prefix=f".{path.name}.")
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
    finally:
        finished(tmp)
    _fsync_dir(path.parent)


def _writable(folder: Path) -> bool:
    """Whether a file can be made in ``folder``: tried, not asked (os.access says yes to root even where
    nothing can be written, as under /proc)."""
    try:
        fd, tmp = temporary(folder, prefix=".lenet-probe.")   # removed by a signal meanwhile too
    except OSError:
        return False
    os.close(fd)
    os.unlink(tmp)
    finished(tmp)
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
    with _writes_lock:   # started and listed at once: start-up threads write too (a join met one unstarted)
        t.start()
        _writes.append(t)


_writes_lock = threading.Lock()


def wait_for_writes() -> None:
    """Wait for every write_later write of this process to end."""
    while True:
        with _writes_lock:
            if not _writes:
                return
            t = _writes.pop()
        t.join()


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
    it is none of the program's ``inputs``. One-line OutputError otherwise (a name the system refuses
    too: too long, or holding a byte it takes no file name with)."""
    try:
        return _check_output_file(path, flag, inputs)
    except OSError as e:
        raise OutputError(os_error(e, flag)) from None


def _check_output_file(path, flag: str, inputs=()) -> Path:
    path = _named(path, flag)
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
    it that exists is writable (so it can be made). Checks only: makes nothing. One line otherwise
    (a name the system refuses, a link to nowhere, too)."""
    try:
        return _check_output_dir(path, flag)
    except OSError as e:
        raise OutputError(os_error(e, flag)) from None


def _named(path, flag: str) -> Path:
    """``path`` as a Path, or one line where it is no name at all."""
    if not os.fspath(path):
        raise OutputError(f"{flag} is empty: give a path")
    if "\0" in os.fspath(path):
        raise OutputError(f"{flag} {show(path)}: a file name cannot hold a NUL byte")
    return Path(path)


def _check_output_dir(path, flag: str) -> Path:
    path = _named(path, flag)
    if path.is_symlink() and not path.exists():
        raise OutputError(f"{flag} {show(path)} is a link to {show(os.readlink(path))}, which does not exist")
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
