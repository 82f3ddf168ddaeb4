"""Writing files without ever losing one: the one atomic writer every program uses, and the
checks that keep a program from writing over its own inputs or into a place it cannot.

Note [atomic writes]: a file is written to a temporary file in the same folder, flushed and
fsynced, given the permissions the umask allows (0666 & ~umask, as open() would; mkstemp
alone makes it 0600), renamed over the target, and the folder is fsynced so the rename itself
survives a crash. An interruption at any point leaves either the old file or the new one,
never a mix, and a temporary that was being written is removed.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import stat
import sys
import tempfile
import threading
from pathlib import Path

from . import _early, interrupt

_temporaries: set = set()        # temporary files being written now (Note [atomic writes])
_temporary_names: set = set()    # (folder, prefix, suffix) of each: a signal between mkstemp and its record
_temporaries_lock = threading.Lock()
_stoppers: list = []             # callables that end a process writing into a leftover, run before it is removed
_children_lock = threading.RLock()   # held while a leftover and the process writing into it are made (starting_child)
_left_on_signal = threading.Event()   # a signal's discard_temporaries began: no child starts after it


# Note [a child started as a signal came]: a signal is handled on its own thread (lenet/interrupt.py) at any
# moment, and one between a child's fork and its Popen's return found no process to end: the plotting child,
# in a session of its own, when it drew with matplotlib, then made its font list in the run's temporary folder
# after that was removed (16 of 120 runs interrupted 35-60 ms in left one in TMPDIR). So a leftover, its record
# and the process writing into it are made while ``_children_lock`` is held (``starting_child``), which a
# discard takes before it ends the children; and once a signal's discard began, a thread that would start a
# child (the plotting child too, which makes no folder now) waits for the process's end instead.
@contextlib.contextmanager
def starting_child():
    """Hold while making a leftover and starting the process that writes into it (Note [a child started as a
    signal came])."""
    with _children_lock:
        if _left_on_signal.is_set():   # the signal's thread is ending the process: nothing more starts, and
            _children_lock.release()   # its discard, which may be waiting for the lock, takes it
            threading.Event().wait()
        yield


def _discard_on_signal() -> None:
    """discard_temporaries, as a signal leaves (lenet/interrupt.py): no child starts after it."""
    _left_on_signal.set()
    discard_temporaries()


def discard_temporaries() -> None:
    """Remove every temporary file a write of this process has not finished, and every file of this run's
    own (``leftover``): what a program leaving through os._exit runs (on a signal: Note [signals from the
    first line] in lenet/interrupt.py; at its end: lenet.cli.leave), so the old files stay whole and
    nothing of ours stays behind."""
    with _children_lock:   # a child being started is started, then ended (Note [a child started as a signal came])
        _discard_temporaries()


def _discard_temporaries() -> None:
    import shutil

    while _stoppers:   # whatever still writes into a leftover ends first (a child process: Plotter)
        try:
            _stoppers.pop()()
        except Exception:   # noqa: BLE001 - leaving regardless
            pass
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


interrupt.before_exit(_discard_on_signal)


def leftover(path: str, stop=None) -> None:
    """A file or folder of this run's own, removed when the process ends however it ends; ``stop()`` first,
    where another process may still write into it (it must end that process)."""
    import atexit

    with _temporaries_lock:
        _temporaries.add(path)
        if stop is not None:
            _stoppers.append(stop)
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
# be (HOME=/proc, a read-only HOME), the run goes on without its caches after one warning line, printed once
# the program's checks passed (a bad flag or dataset is the one line it prints then).
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
    root, why = None, f"HOME={show(home) or '(unset)'} is not a folder that exists"
    if base is not None and not _gate_open.is_set():   # planned, made once the checks passed (Note [nothing
        if _can_make(base / "lenet"):                  # written before the checks]); not decided yet
            return base / "lenet"
        why = f"{show(base / 'lenet')} cannot be made"
    elif base is not None:
        try:
            (base / "lenet").mkdir(parents=True, exist_ok=True)
            root = base / "lenet" if _writable(base / "lenet") else None
            why = f"{show(base / 'lenet')} is not writable"
        except OSError as e:
            why = f"{show(base / 'lenet')} cannot be made ({e.strerror or e})"
    _root[(xdg, home)] = root
    if root is None:   # one line a run, however many caches ask, once the checks passed (a bad flag's line alone)
        line = f"warning: no cache folder ({why}); running without the caches of earlier runs"
        after_checks(lambda: print(line, file=sys.stderr, flush=True))
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
    on the GPU as kernels are compiled: HOME that did not exist was made, with .nv in it, on the GPU
    machine). Each keeps its own where that may be made (Note [cache folders]); else
    <cache_root()>/<library>; else a folder of this run's own, removed when it ends. (The plotting child
    draws with Pillow, which keeps no cache: Note [charts on Pillow] in lenet/chart.py.)
    Called by every program before CuPy's import and the driver's start (lenet/startup.py,
    lenet.cli.run); our programs compile no kernel through CuPy's cache."""
    home = os.environ.get("HOME") or ""
    usable_home = os.path.isabs(home) and os.path.isdir(home)
    if not os.environ.get("CUDA_CACHE_DISABLE"):
        _keep_or_own("CUDA_CACHE_PATH", os.path.join(home, ".nv", "ComputeCache") if usable_home else "",
                     "nv-compute-cache")
    _keep_or_own("CUPY_CACHE_DIR", os.path.join(home, ".cupy", "kernel_cache") if usable_home else "", "cupy")
    _cupy_cache_aside()


# Note [CuPy's cache folder after the checks]: CuPy 14 makes its kernel cache folder as it is imported (its
# disk cache, made by cupy.cuda.compiler's import), and on a GPU our compiles' threads import it early (to load
# the binaries they built: lenet/kernels/nvrtc.py), before the program's checks: a first run that then failed
# a check left ~/.cupy/kernel_cache behind, and the preload thread, which waited for the checks before its own
# import where that folder was missing (lenet/startup.py), held a first run's plans back until the dataset had
# been read (docs/performance.md, "Time to accuracy"). So where writes are held and the folder is not there
# yet, CUPY_CACHE_DIR names the temporary folder itself (temporary_base) until the checks pass: a folder that
# exists, so CuPy's import makes none, and into which it writes nothing (it writes only what it compiles, and
# no program compiles a CuPy kernel before its checks). Once they passed, CUPY_CACHE_DIR is what it was and
# CuPy's disk cache is made again to read it (its folder made then). A folder of the run's own in its place,
# removed as the run left, was made again by an import still running on another thread (a flag error's run
# left it in a test). A CuPy without that cache object reads the variable when it compiles. The processes we
# start get the variable as it was (``children_environ``): each is a program of ours that makes its own choice,
# and a lenet sweep --gpus parent, whose own checks never pass (its workers check), had handed its workers the
# temporary folder for good (CuPy's disk cache there for the whole sweep, its compiled kernels in /tmp).
_SET_ASIDE: dict[str, str | None] = {}   # variable: its value before this process set it aside (None: unset)


def _cupy_cache_aside() -> None:
    """Note [CuPy's cache folder after the checks]."""
    had = os.environ.get("CUPY_CACHE_DIR")
    real = had or os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")
    if writes_allowed() or os.path.isdir(real) or "cupy" in sys.modules:
        return
    _SET_ASIDE["CUPY_CACHE_DIR"] = had
    os.environ["CUPY_CACHE_DIR"] = temporary_base()
    after_checks(_cupy_cache_back)


def children_environ(**extra: str) -> dict:
    """This process's environment for a process it starts, with the variables it set aside until its checks
    pass as they were (Note [CuPy's cache folder after the checks]), and ``extra``."""
    env = dict(os.environ)
    for name, had in list(_SET_ASIDE.items()):
        if had is None:
            env.pop(name, None)
        else:
            env[name] = had
    env.update(extra)
    return env


def _cupy_cache_back() -> None:
    """CUPY_CACHE_DIR as it was, and CuPy's disk cache made again to read it (Note [CuPy's cache folder after
    the checks])."""
    had = _SET_ASIDE.pop("CUPY_CACHE_DIR")
    if had is None:
        os.environ.pop("CUPY_CACHE_DIR", None)
    else:
        os.environ["CUPY_CACHE_DIR"] = had
    if "cupy.cuda.compiler" not in sys.modules:
        return                      # its import, when it comes, reads the variable as it is now
    # Imported, or being imported on another thread: the import statement waits for that import to finish (its
    # module lock), so the backend it made from the temporary folder is there to replace, and so is the setter.
    import cupy.cuda.compiler as compiler
    use, disk = (getattr(compiler, "_set_kernel_cache_backend", None),
                 getattr(compiler, "_DiskKernelCacheBackend", None))
    if use is not None and disk is not None:
        use(disk())


def _keep_or_own(variable: str, default: str, name: str) -> None:
    """A library's cache folder: $variable, else ``default`` (its own place; "": none), kept where it can be
    made; else _own_folder(name), set in $variable."""
    where = os.environ.get(variable) or default
    if not (where and _can_make(Path(where))):
        os.environ[variable] = _own_folder(name)


def _own_folder(name: str) -> str:
    """<cache_root()>/<name>, or a folder of this run's own in the temporary folder, removed when it ends:
    named here, made by the library that uses it (nothing is made before the checks: Note [nothing written
    before the checks])."""
    root = cache_root()
    if root is not None:
        return str(root / name)
    own = os.path.join(temporary_base(), f"lenet-{name}-{os.getpid()}")
    leftover(own)
    return own


def temporary_base() -> str:
    """The temporary folder, as tempfile would choose it ($TMPDIR, $TEMP, $TMP, /tmp, /var/tmp, /usr/tmp) but
    without its probe: tempfile.gettempdir() writes a file of a random name into each candidate to try it,
    which a signal's os._exit leaves behind (a 0-byte file in $TMPDIR, once in 32 SIGTERMs)."""
    for where in (os.environ.get("TMPDIR"), os.environ.get("TEMP"), os.environ.get("TMP"), "/tmp", "/var/tmp",
                  "/usr/tmp"):
        if where and os.path.isabs(where) and os.path.isdir(where) and os.access(where, os.W_OK | os.X_OK):
            return where
    return os.getcwd()


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


def escaped(text: str) -> str:
    """``text`` as one printable line: a byte no encoding takes (a name of bad bytes reaches Python as
    surrogates) as \\xff, a newline, a tab or any other control character as its escape (\\n, \\x1b).
    What every message goes through (``show`` for a name; cli.run and the parser for the whole line)."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:   # a surrogate that no byte made
        raw = text.encode("utf-8", "backslashreplace")
    text = raw.decode("utf-8", "backslashreplace")
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def show(path) -> str:
    """A path (or any name a user gave) as a one-line message shows it: escaped (``escaped``), and a very
    long one cut to its ends with its length."""
    s = os.fspath(path) if not isinstance(path, str) else path
    s = escaped(os.fsdecode(s) if isinstance(s, bytes) else s)
    return s if len(s) <= 120 else f"{s[:60]}...{s[-30:]} ({len(s)} characters)"


def what_is(path) -> tuple[str, str]:
    """(kind, words) of what ``path`` names, following links: kind one of "file" (a regular file), "folder",
    "missing", "dangling" (a link to nothing), "loop" (a symlink loop), "special" (a pipe, a socket, a
    device); words say it in a message ("a symlink loop", "a pipe (FIFO)"). Never blocks, never raises
    for the name's sake (a name the system refuses: its OSError)."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "loop", "a symlink loop (a link that leads back to itself)"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            if os.path.islink(p):
                return "dangling", f"a link to {show(os.readlink(p))}, which does not exist"
            return "missing", "missing"
        raise
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return "file", "a file"
    if stat.S_ISDIR(mode):
        return "folder", "a folder"
    if stat.S_ISFIFO(mode):
        return "special", "a pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "special", "a socket"
    return "special", "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file or folder"


class InputError(ValueError):
    """A file a program reads that is not there or not a regular file; names it and what is allowed."""


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiouAEIOU' else 'a'} {noun}"


def _lead(label: str, path) -> str:
    return f"{label} {show(path)}".strip() if label else show(path)


def check_input_file(path, label: str = "", noun: str = "file", error=InputError) -> Path:
    """The one check of a file a program reads: a regular file (through links), or one ``error`` line naming
    it (``label``: the flag that gave it, "" for a positional argument) as what it is: missing, a link to
    nothing, a symlink loop, a folder, a pipe, a socket or a device (which a read would block on or never
    end). ``noun`` says what was wanted ("checkpoint")."""
    if not os.fspath(path):
        raise error(f"{label or 'a file name'} is empty: give {_a(noun)}")
    if "\0" in os.fspath(path):
        raise error(f"{_lead(label, path)}: a file name cannot hold a NUL byte")
    lead = _lead(label, path)
    try:
        kind, words = what_is(path)
    except OSError as e:
        raise error(f"{lead}: {e.strerror or e}") from None
    if kind == "missing":
        raise error(f"{lead}: no such {noun}")
    if kind == "folder":
        raise error(f"{lead} is a folder, not {_a(noun)}")
    if kind in ("dangling", "loop"):
        raise error(f"{lead} is {words}; give {_a(noun)}")
    if kind != "file":
        raise error(f"{lead} is {words}, not a regular file; give {_a(noun)}")
    return Path(path)


def open_input(path, label: str = "", noun: str = "file", error=InputError):
    """``path`` opened for reading in binary, after check_input_file; opened without blocking and checked
    again on the open file (a pipe put there meanwhile is refused, never waited on)."""
    check_input_file(path, label, noun, error)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"{_lead(label, path)}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{_lead(label, path)} is not a regular file; give {_a(noun)}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def json_of(data) -> object:
    """json.loads, with a document nested too deeply for Python's parser (a RecursionError) a ValueError as
    any other that is not JSON: what every stored file we read goes through."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def check_npz(z, lead: str, limits: dict, error=InputError) -> None:
    """Each array of the open .npz ``z`` (numpy.lib.npyio.NpzFile) named in ``limits`` holds at most that many
    bytes, read from its header before any of it is: an absurd header (a shape of 10**12) is refused, never
    allocated. One ``error`` line naming the file (``lead``) otherwise."""
    import numpy as np

    for name, most in limits.items():
        if name not in z.files:
            continue
        try:
            with z.zip.open(name + ".npy") as m:
                version = np.lib.format.read_magic(m)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(m)
        except Exception:   # noqa: BLE001 - not an array NumPy reads: the caller's load says so
            raise error(f"{lead}: its {name} is not a readable array") from None
        size = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
        if size > most:
            raise error(f"{lead}: its {name} declares {size:,} bytes (shape {tuple(shape)}), more than the {most:,} "
                        f"it can hold")


def read_input(path, label: str = "", noun: str = "file", error=InputError, limit: int | None = None) -> bytes:
    """The bytes of the file ``path`` (open_input); ``limit``: a file larger than that is refused unread."""
    with open_input(path, label, noun, error) as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise error(f"{_lead(label, path)}: {size} bytes, more than the {limit} {_a(noun)} can hold")
        try:
            return f.read()
        except OSError as e:
            raise error(f"{_lead(label, path)}: cannot read ({e.strerror or e})") from None


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
        raise OutputError(f"cannot write {show(path)}: {e.strerror or e}") from None
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
            raise OutputError(f"cannot write {show(path)}: {e.strerror or e}") from None
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

# Note [nothing written before the checks]: a program writes nothing of its own accord (a cache's entry, a
# cache folder, the bytecode Python keeps for it, a study in --storage, CuPy's folder)
# before every check that needs no GPU has passed: a flag error, a bad dataset or an output in the way leaves
# the user's HOME, TMPDIR and storage as they were. A program's start (``hold_writes``, lenet.startup.begin and
# lenet.cli.run) holds such writes back; ``checks_passed``, which each program calls once its last check that
# needs no GPU passed (right before it asks for the GPU), makes the cache root, runs the writes held back (on
# threads: write_later) and the callables ``after_checks`` registered. A run that fails a check leaves
# through os._exit with the writes still held: they never happen. Outside a program (a library's user, the
# tests) nothing is held.
_gate = {"held": False}
_held: list = []                  # (fn, args) of write_later calls held back
_after_checks: list = []          # callables run when the checks pass
_gate_open = threading.Event()    # set while writes are allowed
_gate_open.set()


def hold_writes() -> None:
    """Note [nothing written before the checks]: from here, until checks_passed(). Also names the temporary
    folder for tempfile (temporary_base), so that no library's tempfile call probes it."""
    if tempfile.tempdir is None:
        tempfile.tempdir = temporary_base()
    with _writes_lock:
        if not _gate["held"] and not _gate.get("passed"):
            _gate["held"] = True
            _gate_open.clear()


def writes_allowed() -> bool:
    return _gate_open.is_set()


def wait_for_checks(timeout: float | None = None) -> bool:
    """Block until the program's checks passed (at once outside a program); True once they have."""
    return _gate_open.wait(timeout)


def after_checks(fn) -> None:
    """Run ``fn()`` once the checks passed (now, where nothing is held)."""
    with _writes_lock:
        if _gate_open.is_set():
            held = False
        else:
            _after_checks.append(fn)
            held = True
    if not held:
        fn()


def checks_passed() -> None:
    """Every check that needs no GPU passed: what was held back may be written now (Note [nothing written
    before the checks])."""
    with _writes_lock:
        if _gate_open.is_set():
            return
        _gate["held"], _gate["passed"] = False, True
        jobs, calls = list(_held), list(_after_checks)
        _held.clear()
        _after_checks.clear()
        _gate_open.set()
    if jobs or calls:
        cache_root()   # made now, where it was planned
    for fn in calls:
        try:
            fn()
        except Exception:   # noqa: BLE001 - a cache that cannot be set up costs speed only
            pass
    for fn, args in jobs:
        write_later(fn, *args)


def write_when_allowed(fn, *args) -> None:
    """``fn(*args)`` now where writes are allowed, else on a thread once the checks passed (write_later)."""
    if _gate_open.is_set():
        fn(*args)
    else:
        write_later(fn, *args)


def write_later(fn, *args) -> None:
    """Run ``fn(*args)``, a write nothing in this run reads back (a cache's new entry), on a thread of
    its own, so the run goes on meanwhile; held back until the checks passed (Note [nothing written before
    the checks]). The thread is not a daemon: an interpreter that exits
    waits for it, and a program that leaves through os._exit (cli.leave) calls wait_for_writes
    first, so a write is never cut short and no temporary file is left behind."""
    with _writes_lock:
        if not _gate_open.is_set():
            _held.append((fn, args))
            return
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
    """Whether two paths name one file (through links, relative paths, ..); never raises (a symlink loop
    names no file)."""
    try:
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def same_place(a, b) -> bool:
    """Whether two paths name one file or one place for a file, through links (os.path.realpath: never
    raises, a loop resolved as far as it goes)."""
    return same_file(a, b) or os.path.realpath(a) == os.path.realpath(b)


def check_output_file(path, flag: str, inputs=(), overwrite: bool | None = None) -> Path:
    """The one check of a file a program will write (before anything is read or written): a name the
    system takes, nothing there or a regular file (never a folder, a pipe, a device, a link to nothing or a
    symlink loop), none of the program's ``inputs``, in a folder that exists and is writable; an existing
    file only with ``overwrite`` (None: the caller's own rule). One-line OutputError otherwise."""
    try:
        return _check_output_file(path, flag, inputs, overwrite)
    except OSError as e:
        raise OutputError(os_error(e, flag)) from None


def _check_output_file(path, flag: str, inputs=(), overwrite: bool | None = None) -> Path:
    path = _named(path, flag)
    kind, words = what_is(path)
    if kind == "folder":
        raise OutputError(f"{flag} {show(path)} is a folder; give a file name")
    if kind in ("dangling", "loop"):
        raise OutputError(f"{flag} {show(path)} is {words}; give a file name")
    if kind not in ("file", "missing"):
        raise OutputError(f"{flag} {show(path)} is {words}, not a regular file; give a file name")
    for i in inputs:
        if i is not None and same_place(path, i):
            raise OutputError(f"{flag} {show(path)} is also an input of this program ({show(i)}); write to "
                              f"another file")
    parent = path.parent
    pkind, pwords = what_is(parent)
    if pkind == "missing":
        blocker = _first_file(parent)
        if blocker is not None:
            raise OutputError(f"{flag} {show(path)}: {show(blocker)} is {what_is(blocker)[1]}, not a folder")
        raise OutputError(f"{flag} {show(path)}: the folder {show(parent)} does not exist")
    if pkind != "folder":
        raise OutputError(f"{flag} {show(path)}: {show(parent)} is {pwords}, not a folder")
    if not _writable(parent):
        raise OutputError(f"{flag} {show(path)}: the folder {show(parent)} is not writable")
    if kind == "file" and overwrite is False:
        raise OutputError(f"{flag} {show(path)} exists; replace it with --overwrite, or write to another file")
    return path


def check_output_dir(path, flag: str) -> Path:
    """A folder a program will write into: it is a writable folder, or the nearest folder above
    it that exists is writable (so it can be made). Checks only: makes nothing. One line otherwise
    (a name the system refuses, a link to nowhere, a symlink loop, too)."""
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
    kind, words = what_is(path)
    if kind == "file":
        raise OutputError(f"{flag} {show(path)} is a file, not a folder; give a folder")
    if kind in ("dangling", "loop"):
        raise OutputError(f"{flag} {show(path)} is {words}; give a folder")
    if kind not in ("folder", "missing"):
        raise OutputError(f"{flag} {show(path)} is {words}, not a folder; give a folder")
    blocker = _first_file(path)
    if blocker is not None:
        raise OutputError(f"{flag} {show(path)}: {show(blocker)} is {what_is(blocker)[1]}, not a folder")
    existing = path
    while what_is(existing)[0] == "missing" and existing != existing.parent:
        existing = existing.parent
    ekind, ewords = what_is(existing)
    if ekind != "folder":
        raise OutputError(f"{flag} {show(path)}: {show(existing)} is {ewords}, not a folder")
    if not _writable(existing):
        raise OutputError(f"{flag} {show(path)}: the folder {show(existing)} is not writable")
    return path


def check_files_in(folder: Path, names, flag: str) -> None:
    """Each of ``names`` in ``folder`` (what a program writes there) is nothing yet, a regular file, or (a
    name ending in /) a folder: never a pipe, a device, a link to nothing or a symlink loop, which a write
    would block on or go through."""
    for name in names:
        want_dir = name.endswith("/")
        p = folder / name.rstrip("/")
        kind, words = what_is(p)
        if kind == "missing" or kind == ("folder" if want_dir else "file"):
            continue
        raise OutputError(f"{flag} {show(folder)}: {show(p)} is {words}, not a "
                          f"{'folder' if want_dir else 'regular file'}; remove it, or write to another folder")


def _first_file(path: Path) -> Path | None:
    """The first component of ``path`` that exists and is not a folder, if any."""
    p = Path()
    for part in path.parts:
        p = p / part
        kind = what_is(p)[0]
        if kind == "missing":
            return None
        if kind != "folder":
            return p
    return None
