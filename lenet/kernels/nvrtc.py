"""CUDA modules of ours compiled by NVRTC (through ctypes) into a cache of compiled binaries of our
own, each on a thread of its own, started before they are needed: lenet's kernels (lenet/kernels/)
including the planner's distance kernel (distance.cu), use it.

Note [first run]: on a program's first run on a machine (the kernel cache empty), NVRTC compiles
every module it launches: once our kernels were two modules compiled one after the other on the way to
the first step, and CuPy's own kernels (fills, copies, reductions through CUB) took longer still
(docs/kernels.md, "Launches and compiles"). So: no generic CuPy kernel on the
way to a step (uploads, memset and device copies instead, and the search's distances in a kernel of
our own), and our kernels as small modules whose compiles start on threads as soon as the program
knows what it will run and the GPU's architecture, beside the rest of the start-up (lenet/startup.py).
NVRTC lets go of the GIL while it compiles, so they run beside the imports and each other; a caller
then waits only for the module it asks for, if it is not ready yet. A first run waits for the longest
compile, not for the sum.

The compile needs no CuPy: NVRTC is called through ctypes (libnvrtc as cuda.pathfinder finds it, the
library CuPy loads too) and the architecture comes from the driver (``use_arch``), so compiles start
while CuPy is still being imported; CuPy only loads the binary (cupy.RawModule(path=...)). Compiled
through CuPy instead (RawModule(code=...), with CuPy's kernel cache), the first compile could start
only after CuPy's import.

Note [kernel architecture]: our kernels compile for the GPU's own compute capability (a cubin), or,
with LENET_KERNEL_ARCH=75 (80, 86, 89, ...; at most the GPU's own), as PTX for that one, which the
driver compiles for the GPU as it loads it. The code that runs is then what a GPU of that generation
runs: its kernel versions (a module declares the lowest compute capability it needs, ``arch=`` in
Note [module declarations] in lenet/kernels/__init__.py), its heuristic's rows and no programmatic
launch below 90, at this GPU's speed and resources. That is how an sm_90 GPU tests a T4's (75) or an A100's
(80) code path (scripts/gpu_check.sh's arch parts). The architecture is part of each binary's name and
digest and of our engine's version in stored choices (lenet/plancache.py), so runs of different
architectures never share either.

The cache: $LENET_KERNEL_CACHE, else $XDG_CACHE_HOME/lenet/kernels, else ~/.cache/lenet/kernels; one
file per module and architecture, named by a digest of the source, the options, the architecture and
NVRTC's version, written atomically; a new version of a module's file replaces the old one, so the
folder holds one file per module and architecture. A file that is not a complete binary is compiled
again. A folder that cannot be written costs a compile per run, nothing else.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import tempfile
import threading
import time
from concurrent.futures import Future, wait
from pathlib import Path

_lock = threading.Lock()
_modules: dict = {}   # key -> concurrent.futures.Future of its cupy.RawModule
_arch = None          # a callable returning the GPU's compute capability (90), set by use_arch
ARCH_VARIABLE = "LENET_KERNEL_ARCH"   # Note [kernel architecture]
LOWEST_ARCH = 75      # the oldest generation our kernels are built and tested for (Turing; CUDA 13's lowest)
_write_lock = threading.Lock()   # held while a binary is written into the cache (hold_writes)
# (key, time.perf_counter() at its start and end, "nvrtc" or "cache") of each module this process
# built or read: what scripts/probes/train_timeline.py prints.
BUILT: list[tuple[str, float, float, str]] = []


class CompileError(RuntimeError):
    """NVRTC refused a module: the message names it and holds NVRTC's log."""


def use_arch(arch) -> None:
    """Compile for ``arch()`` (a callable returning a compute capability such as 90, which may wait
    for the driver to report it) instead of asking CuPy for the current device's: what lets a
    program start its compiles before CuPy is imported (lenet/startup.py)."""
    global _arch
    _arch = arch


def device_arch() -> int:
    """The GPU's compute capability (90 for sm_90): the driver's answer given to ``use_arch``, else
    CuPy's current device's."""
    return int(_arch()) if _arch is not None else _current_arch()


def requested_arch() -> int | None:
    """The compute capability LENET_KERNEL_ARCH asks our kernels to be compiled for (as PTX), or None
    where it is unset (Note [kernel architecture]). A one-line ValueError for a value that is not one
    this NVRTC compiles for from LOWEST_ARCH up; needs no GPU."""
    text = os.environ.get(ARCH_VARIABLE, "")
    if not text.strip():
        return None
    import re

    m = re.fullmatch(r"\s*(?:sm_|compute_)?(\d{1,2})\.?(\d)\s*", text)
    arch = 10 * int(m.group(1)) + int(m.group(2)) if m else None
    known = [a for a in nvrtc().archs if a >= LOWEST_ARCH]
    if arch not in known:
        raise ValueError(f"{ARCH_VARIABLE}={text!r} is not a compute capability our kernels compile for: give one "
                         f"of {', '.join(map(str, known))} (NVRTC {nvrtc().version[0]}.{nvrtc().version[1]}), or "
                         f"leave it unset for the GPU's own")
    return arch


def kernel_arch(device: int | None = None) -> int:
    """The compute capability our kernels are compiled for in this process: LENET_KERNEL_ARCH's where it
    is set (at most the GPU's, ``device``: PTX of a newer generation cannot load on an older one), else
    the GPU's own (Note [kernel architecture])."""
    device = device_arch() if device is None else int(device)
    want = requested_arch()
    if want is None:
        return device
    if want > device:
        raise ValueError(f"{ARCH_VARIABLE}={want}: this GPU is compute capability {device // 10}.{device % 10}, and "
                         f"code compiled for a newer generation cannot run on it; give at most {device}")
    return want


def cache_folder() -> Path | None:
    """$LENET_KERNEL_CACHE, else kernels/ in our cache folder; None where there is none (Note [cache
    folders] in lenet/files.py): each run then compiles into a temporary file of its own."""
    where = os.environ.get("LENET_KERNEL_CACHE")
    if where:
        return Path(where)
    from ..files import cache_path

    return cache_path("kernels")


def prefetch(key: str, source, options: tuple = ()) -> Future:
    """Start compiling (or reading from the cache) module ``key`` now, on a thread of its own, unless
    it was started before; ``source()`` returns its CUDA source. Returns the future of its
    cupy.RawModule: result() waits for it, and raises a compile error on the caller's thread."""
    with _lock:
        fut = _modules.get(key)
        if fut is None:
            fut = _modules[key] = Future()
            threading.Thread(target=_build, args=(fut, key, source, tuple(options), _arch), name=f"nvrtc-{key}",
                             daemon=True).start()
    return fut


def forget(key: str, built: Future) -> None:
    """Drop module ``key``'s build ``built`` (a module whose load failed): the next prefetch builds it again
    (Note [a version removed under us] in lenet/kernels/__init__.py). A newer build, which another thread
    whose load failed too may have started, stays: it is the one every caller then waits for."""
    with _lock:
        if _modules.get(key) is built:
            del _modules[key]


def hold_writes() -> None:
    """Wait for a binary being written into the cache, and keep any other from starting: what a
    program calls before it leaves through os._exit with compiles still running (lenet.cli.leave),
    so no temporary file is left in the cache."""
    _write_lock.acquire()


def _build(fut: Future, key: str, source, options: tuple, arch) -> None:
    try:
        device = int(arch()) if arch is not None else _current_arch()
        path = binary(key, source(), options, kernel_arch(device), ptx=requested_arch() is not None)
        import cupy

        fut.set_result(cupy.RawModule(path=str(path)))
    except BaseException as e:   # noqa: BLE001 (raised again on the thread that asks for the module)
        fut.set_exception(e)


def _current_arch() -> int:
    import cupy

    return int(cupy.cuda.Device().compute_capability)


# Note [kernels built with the package]: a first run compiles every module it launches (Note [first run]); with
# the model planned beside the data (lenet/train.py) its plans then waited for the longest compiles, and a first
# run with every module compiled took 0.35-0.5 s less (docs/performance.md, "The model made and planned beside
# the data"). So a wheel built on a machine with an NVIDIA GPU holds every module compiled for that GPU's
# architecture, named as in the cache (build_support/lenet_build.py runs ``build_into`` as `pip install` builds
# the wheel): a binary is looked for in the cache, then here, then compiled. A name holds NVRTC's version, so a
# later NVRTC compiles again (into the cache), as it would for the cache.
INSTALLED = Path(__file__).resolve().parent / "built"


def _name(key: str, source: str, options: tuple, arch: int, ptx: bool) -> tuple[str, str, tuple]:
    """(the file name of module ``key``'s binary, its stem, NVRTC's options) for compute capability ``arch``."""
    nv = nvrtc()
    target, ext = (f"compute_{arch}", "ptx") if ptx else nv.target(arch)
    opts = ("--device-as-default-execution-space", *nv.minimal, *options, f"-arch={target}")
    h = hashlib.blake2b(digest_size=10)
    for part in (source, "\0".join(opts), nv.version_string):
        h.update(part.encode() + b"\1")
    return f"{key}.{target}.{h.hexdigest()}.{ext}", f"{key}.{target}", opts


def binary(key: str, source: str, options: tuple, arch: int, ptx: bool = False) -> Path:
    """The path of module ``key`` compiled for compute capability ``arch`` (as PTX for it with ``ptx``:
    Note [kernel architecture]): from the cache, or as the package was built with it (Note [kernels built
    with the package]), or compiled now and stored in the cache (Note [first run]). Needs no GPU."""
    nv = nvrtc()
    name, stem, opts = _name(key, source, options, arch, ptx)
    ext = name.rsplit(".", 1)[1]
    folder = cache_folder()
    path = folder / name if folder is not None else None
    t0 = time.perf_counter()
    for where, how in ((path, "cache"), (INSTALLED / name, "installed")):
        try:
            if where is not None and _complete(where.read_bytes(), ext):
                BUILT.append((key, t0, time.perf_counter(), how))
                return where
        except OSError:
            pass
    data = nv.compile(source, f"{key}.cu", opts, ptx=ext == "ptx")
    BUILT.append((key, t0, time.perf_counter(), "nvrtc"))
    with _write_lock:
        return _store(folder, path, stem, ext, data)


def _store(folder: Path | None, path: Path | None, stem: str, ext: str, data: bytes) -> Path:
    """``data`` written as ``path`` in the cache (``_write``), or, where the folder cannot be written, into a
    temporary file of this run's own. Before the program's checks passed (Note [nothing written before the
    checks] in lenet/files.py: a module compiled at start-up, or by a model planned beside the checks), into
    a temporary file too, and into the cache once they passed (``_store_later``)."""
    from .. import files

    if folder is not None and not files.writes_allowed():
        files.write_later(_store_later, folder, path, stem, ext, data)
    elif folder is not None:
        try:
            return _write(folder, path, stem, ext, data)
        except OSError:   # a folder we cannot write
            pass
    fd, tmp = tempfile.mkstemp(prefix=f"lenet-{stem}.", suffix=f".{ext}")
    files.leftover(tmp)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return Path(tmp)


def _write(folder: Path, path: Path, stem: str, ext: str, data: bytes) -> Path:
    """``data`` written as ``path`` (atomically), and the module's earlier versions in ``folder`` removed."""
    from .. import files

    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = files.temporary(folder, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        mask = os.umask(0o022)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)   # as an ordinary file, not mkstemp's 0600
        os.replace(tmp, path)
    finally:
        files.finished(tmp)
    for old in folder.glob(f"{stem}.*.{ext}"):   # earlier versions of this module
        if old != path:
            old.unlink(missing_ok=True)
    return path


def _store_later(folder: Path, path: Path, stem: str, ext: str, data: bytes) -> None:
    """A binary compiled before the checks passed, stored in the cache now that they have (files.write_later);
    a folder that cannot be written costs the next run a compile, nothing else."""
    with _write_lock:
        try:
            _write(folder, path, stem, ext, data)
        except OSError:
            pass


def build_into(folder, arch: int, modules) -> list[str]:
    """Note [kernels built with the package]: each of ``modules`` ((key, source, options) triples) compiled for
    compute capability ``arch`` into ``folder`` as ``binary`` names it, on threads (NVRTC lets go of the GIL).
    Returns the files written; a module NVRTC refuses raises CompileError."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    nv = nvrtc()

    def one(module):
        key, source, options = module
        name, _, opts = _name(key, source, options, arch, False)   # PTX where this NVRTC has no cubin for it
        (folder / name).write_bytes(nv.compile(source, f"{key}.cu", opts, ptx=name.endswith(".ptx")))
        return name

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, min(len(modules), os.cpu_count() or 1))) as pool:
        return list(pool.map(one, modules))


def _complete(data: bytes, ext: str) -> bool:
    """Whether a cached file holds a whole binary: an ELF whose section headers end inside it (the
    ELF64 header's e_shoff, e_shentsize, e_shnum), or PTX text naming its target."""
    if ext == "ptx":
        return data.startswith(b"//") and b"\n.target " in data
    if len(data) < 64 or not data.startswith(b"\x7fELF\x02"):
        return False
    shoff = int.from_bytes(data[40:48], "little")
    shentsize, shnum = int.from_bytes(data[58:60], "little"), int.from_bytes(data[60:62], "little")
    return shnum > 0 and shoff + shentsize * shnum <= len(data)


class Nvrtc:
    """libnvrtc through ctypes (which lets go of the GIL during each call)."""

    def __init__(self, path: str):
        lib = self.lib = ctypes.CDLL(path)
        P, c_int, c_size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        sig = {"nvrtcVersion": [ctypes.POINTER(c_int)] * 2,
               "nvrtcCreateProgram": [ctypes.POINTER(P), ctypes.c_char_p, ctypes.c_char_p, c_int, P, P],
               "nvrtcCompileProgram": [P, c_int, ctypes.POINTER(ctypes.c_char_p)],
               "nvrtcGetCUBINSize": [P, ctypes.POINTER(c_size)], "nvrtcGetCUBIN": [P, ctypes.c_char_p],
               "nvrtcGetPTXSize": [P, ctypes.POINTER(c_size)], "nvrtcGetPTX": [P, ctypes.c_char_p],
               "nvrtcGetProgramLogSize": [P, ctypes.POINTER(c_size)], "nvrtcGetProgramLog": [P, ctypes.c_char_p],
               "nvrtcDestroyProgram": [ctypes.POINTER(P)],
               "nvrtcGetNumSupportedArchs": [ctypes.POINTER(c_int)],
               "nvrtcGetSupportedArchs": [ctypes.POINTER(c_int)]}
        for name, args in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, c_int
        lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [c_int], ctypes.c_char_p
        major, minor = c_int(), c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)
        self.version_string = f"nvrtc {major.value}.{minor.value} {os.path.basename(path)}"
        # NVRTC 12.4 and later can leave out the texture, device-runtime and CUDA API declarations
        # none of our modules uses: the same binaries, a compile 8% shorter (head.cu: 0.48 -> 0.44 s).
        self.minimal = ("--minimal",) if self.version >= (12, 4) else ()
        count = c_int()
        self._check(lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "nvrtcGetNumSupportedArchs")
        archs = (c_int * count.value)()
        self._check(lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
        self.archs = tuple(archs)

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise CompileError(f"{what}: {self.lib.nvrtcGetErrorString(status).decode()}")

    def target(self, arch: int) -> tuple[str, str]:
        """NVRTC's -arch for a GPU of compute capability ``arch``, and the binary's kind: a cubin for
        the GPU itself where this NVRTC knows it, else PTX of the newest architecture below it (the
        driver compiles that for the GPU when it loads it)."""
        if arch in self.archs:
            return f"sm_{arch}", "cubin"
        older = [a for a in self.archs if a < arch]
        if not older:
            raise CompileError(f"NVRTC {self.version[0]}.{self.version[1]} compiles for compute capability "
                               f"{min(self.archs)} and newer; this GPU is {arch}")
        return f"compute_{max(older)}", "ptx"

    def compile(self, source: str, name: str, options: tuple, ptx: bool = False) -> bytes:
        P = ctypes.c_void_p
        prog = P()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
                    "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            if status != 0:
                size = ctypes.c_size_t()
                self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value)
                self.lib.nvrtcGetProgramLog(prog, log)
                raise CompileError(f"NVRTC could not compile {name} ({' '.join(options)}):\n"
                                   f"{log.value.decode(errors='replace')}")
            get_size, get = ((self.lib.nvrtcGetPTXSize, self.lib.nvrtcGetPTX) if ptx else
                             (self.lib.nvrtcGetCUBINSize, self.lib.nvrtcGetCUBIN))
            size = ctypes.c_size_t()
            self._check(get_size(prog, ctypes.byref(size)), get_size.__name__)
            out = ctypes.create_string_buffer(size.value)
            self._check(get(prog, out), get.__name__)
            data = out.raw[:size.value]
            return data.rstrip(b"\0") if ptx else data
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


@functools.lru_cache(maxsize=None)
def nvrtc() -> Nvrtc:
    """libnvrtc, found as CuPy finds it (cuda.pathfinder: the nvidia-cuda-nvrtc wheel, else the CUDA
    toolkit's)."""
    from cuda.pathfinder import load_nvidia_dynamic_lib

    return Nvrtc(load_nvidia_dynamic_lib("nvrtc").abs_path)


@atexit.register
def _finish() -> None:
    """Compiles still running are waited for at exit: CuPy torn down under one crashed the process."""
    with _lock:
        pending = list(_modules.values())
    wait(pending)
