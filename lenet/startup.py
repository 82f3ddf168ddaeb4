"""How a program starts: its compiled modules kept where Python would keep none (Note
[bytecode cache]), then its start-up threads: the CUDA driver and cuDNN's one-time set-up on
one, the GPU stack's imports on another, while the main thread imports, parses its flags and
reads its data (Note [overlapped start-up]). Imports nothing heavy at its own import, and none of the
programs (they import it): python -m lenet.train, and the lenet and lenet-train commands
(lenet/__main__.py), import it first of all. start_gpu() imports libcudnn's wrappers (descriptors)
and lenet.kernels on the main thread, to start the compiles: the flag parse would import them next.

Note [overlapped start-up]: a training run's start-up is CPU work that holds the GIL (the
imports of NumPy, CuPy, libcudnn's wrappers, cuBLAS's bindings, the graph API's frontend; the
frontend's calls, which keep the GIL in C++) beside work that can let go of it: reading the
dataset, cuInit plus the primary context (a quarter of a second), cuDNN's one-time set-up
when it is reached through ctypes (Note [cuDNN's first call]). None of it depends on the rest
until the model is built, so python -m lenet.train starts two threads before its own imports
(start_gpu):

- the driver's, through ctypes alone: cuInit and GPU 0's primary context, then cuDNN's
  one-time set-up (_driver_main);
- the imports' (preload): cuda.pathfinder and libcudnn's location, which it hands to the
  driver's thread; CuPy and the cuBLAS bindings; the CUDA runtime, once the context is up;
  then, told the engine after the flags are parsed (``starting``), libcudnn's wrappers
  (descriptors), lenet.model and the frontend, and a first tiny graph;
- the compiles' (``_start_compiles``), once the driver's thread has GPU 0's architecture: each of
  our kernels' modules compiling on a thread of its own (Note [first run] in
  lenet/kernels/nvrtc.py), those every program launches at once, the stage kernels once the
  program knows its engine and batch sizes; they need no CuPy, so they begin while CuPy is still
  being imported.

The main thread meanwhile does its own imports, parses the flags (which imports descriptors)
and reads the data. The two threads never import the same module of ours at the same time:
two threads importing one package whose modules import each other can meet Python's
import-deadlock guard, which hands one of them a partially initialized module (seen once:
"cannot import name 'Handle' from partially initialized module 'descriptors.handle'"; seen
again as "KeyError: 'descriptors'" when the preload thread imported descriptors while the flags
were parsed); the driver's thread imports nothing that way. Every failure on those threads is
swallowed: the program's own import, its require_gpu() and its first CUDA call raise it where
they always did, after the checks in the ``starting`` block, so a bad dataset is still
reported before a missing GPU. Building the model on the main thread while the preload
thread built its first graph gained nothing: the two wait for each other
(scripts/probes/train_timeline.py, which prints the phases ``mark`` records). Building it on the
preload thread after its first graph, while the main thread reads and checks the data, does gain:
``build_beside`` (Note [the model beside the data] in lenet/train.py).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import time

_IMPORTED = time.perf_counter()


def process_seconds() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere since lenet.startup was imported)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


# (label, time.perf_counter()) as each start-up thread finishes a phase: what
# scripts/probes/train_timeline.py prints beside its own timers (appending costs nothing).
MARKS: list[tuple[str, float]] = []


def mark(label: str) -> None:
    MARKS.append((label, time.perf_counter()))


def keep_bytecode() -> str | None:
    """When Python was told to write no bytecode (PYTHONDONTWRITEBYTECODE, ``-B``) and given no
    folder for it (PYTHONPYCACHEPREFIX), keep this process's compiled modules in a cache folder
    of our own instead, never beside the sources: $LENET_BYTECODE_CACHE, else
    $XDG_CACHE_HOME/lenet/bytecode, else ~/.cache/lenet/bytecode. LENET_BYTECODE_CACHE=off
    leaves Python's setting as it is. Returns the folder used, or None.

    Note [bytecode cache]: without bytecode on disk, every run compiles every module it imports
    from source. The GPU machine's environment sets PYTHONDONTWRITEBYTECODE=1 over packages
    installed without .pyc files, and compiling them cost python -m lenet.train_step a sixth of its
    wall clock (docs/performance.md, "Notes' numbers: start-up"). Python's own
    PYTHONPYCACHEPREFIX exists for this case (a source tree that must stay clean); this sets
    the same thing for the programs' own process, like the plan and dataset caches beside it.
    Python checks each cached file against its source's size and modification time, writes it
    atomically, and skips a folder it cannot write."""
    from ._early import KEPT, bytecode_setting

    if KEPT and sys.pycache_prefix == KEPT[0]:   # set on the program's first line (Note [bytecode from the first line])
        folder = KEPT[0]
    elif not sys.dont_write_bytecode or sys.pycache_prefix is not None:
        return None
    else:
        folder = _bytecode_folder(bytecode_setting())
        if folder is None:
            return None
    from .files import after_checks, write_later

    # Note [nothing written before the checks] in lenet/files.py: a folder that is there is used at once, as
    # Python uses __pycache__ (it writes what is missing or stale there); one that is not is made once the
    # program's checks passed, with the bytecode of the modules imported before then (a first run's only).
    if os.path.isdir(folder):
        sys.pycache_prefix, sys.dont_write_bytecode = folder, False
    else:
        after_checks(lambda: _write_bytecode(folder))
    if _prune_due(folder):
        write_later(prune_bytecode, folder)
    return folder


def _write_bytecode(folder: str) -> None:
    """Python writes this process's bytecode into ``folder`` from now on (made if need be), and the modules
    imported before then that have none there get theirs, on a thread (files.write_later): now, or as the
    preload thread stops importing (Note [no import in flight at the switch])."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return
    with _switching:   # Note [no import in flight at the switch]
        if _importing.acquire(blocking=False):
            try:
                _switch(folder)
            finally:
                _importing.release()
        else:
            from .files import write_later

            _pending_switch.append(folder)
            write_later(_bytecode_of_imported, folder)   # what was imported so far: now, not after the preload's work


def _switch(folder: str) -> None:
    from .files import write_later

    sys.pycache_prefix, sys.dont_write_bytecode = folder, False
    write_later(_bytecode_of_imported, folder)


def _let_go() -> None:
    """The preload thread's release of ``_importing``: the switch asked for meanwhile, made now."""
    with _switching:
        _importing.release()
        if _pending_switch:
            _switch(_pending_switch.pop())


# Note [no import in flight at the switch]: Python's loader names a module's bytecode file when it starts to
# import it and writes it, if writing is on, once compiled. A first run switches both settings while the
# preload thread may be importing (the checks pass as it works): a module begun before the switch then had its
# bytecode written beside its source (lenet/__pycache__/blas... in a checkout, whose environment said not to
# write any), which showed on a GPU shared with other processes, where each thread runs slower. So the preload
# thread holds ``_importing`` from its start to its end, but for its wait for the program's engine; a switch
# asked for meanwhile is left to it, made as it lets go (``_let_go``), and the thread that asked (the main
# one, as the checks pass) goes on without waiting. It covers the preload thread's imports and CuPy's on a
# compile's thread (lenet/kernels/nvrtc.py: the preload's own import of CuPy waits for that one, holding the
# lock); the plotting child is another process.
_importing = threading.Lock()
_switching = threading.Lock()
_pending_switch: list[str] = []


_compiling = threading.Lock()   # one child at a time: a later one lists only what an earlier one did not write


def _bytecode_of_imported(folder: str) -> None:
    """The bytecode of every module imported so far that has none in ``folder`` (made just now): what Python
    would have written there as it imported them, compiled by a child interpreter (Note [bytecode in a child]).
    Where the switch waits for the preload thread (Note [no import in flight at the switch]), once as the
    checks pass and again at the switch, for what was imported in between."""
    import subprocess

    with _compiling:
        jobs = _missing_bytecode(folder)
        if not jobs:
            return
        try:
            subprocess.run([sys.executable, *["-O"] * sys.flags.optimize, "-I", "-S", "-c", _COMPILE_CHILD],
                           input=b"\n".join(map(os.fsencode, jobs)),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600, check=False)
        except (OSError, subprocess.SubprocessError):   # a cache's entries: none written is only a slower next run
            pass


# Note [bytecode in a child]: a first run's bytecode of the modules imported before its cache folder was made
# (Note [bytecode cache]) is hundreds of compiles, and builtins.compile holds the GIL: on a thread they slowed
# the main thread's first plans several times over (docs/performance.md, "Notes' numbers: start-up"). A child
# interpreter compiles them on another core instead; this thread only waits for it. The list is read without
# touching a lazy module: CuPy keeps cupy.testing, cupyx and cupy.fft.config in sys.modules as proxies that
# import themselves on any attribute, and reading their __spec__ imported hundreds of modules (pytest, Optuna,
# SciPy among them) into the run, then compiled those too. The
# child ignores SIGINT, so a ^C (sent to the terminal's whole process group) leaves no half-written file: it
# ends its list in a second or so, and the program's end waits for this thread (files.write_later).
#
# Note [bytecode beside the source]: a package installed by pip has its bytecode beside its sources (__pycache__),
# which Python reads wherever it may not write any. Where it may not (PYTHONDONTWRITEBYTECODE, the GPU machine's
# setting), a first run still sends its imports to our folder (Note [bytecode cache]), which has nothing yet, so
# the child had compiled every module imported, NumPy's and CuPy's included, for a folder whose every entry but
# ours had a valid twin beside its source; and the program's end waited for it: 0.4-1.1 s of a first run's exit
# on an H200 machine (`train_timeline.py --cold`, the fast recipe, bytecode present beside every source). The
# child copies such a file instead (valid: this interpreter's magic number, and the source's mtime and size in its
# header, or the source's hash in a checked hash-based one) and compiles the rest, unchecked hash-based files
# among them: in our folder, the only one Python reads under a cache prefix, an unchecked file would be taken
# however its source changed later (a package installed with unchecked-hash bytecode, then edited).
_COMPILE_CHILD = """
import importlib.util, os, py_compile, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)   # a ^C at the terminal: each file's write finishes (then the run's end)

def beside(src):   # Note [bytecode beside the source]: that file's bytes, where Python would take them for src's
    try:
        with open(importlib.util.cache_from_source(src), "rb") as f:
            data = f.read()
        st = os.stat(src)
    except (OSError, ValueError, NotImplementedError):
        return None
    if len(data) < 16 or data[:4] != importlib.util.MAGIC_NUMBER:
        return None
    flags = int.from_bytes(data[4:8], "little")
    if flags & 1:   # hash-based: a checked one copied where it is its source's; an unchecked one compiled
        try:
            with open(src, "rb") as f:
                return data if flags == 3 and data[8:16] == importlib.util.source_hash(f.read()) else None
        except OSError:
            return None
    if flags or data[8:12] != (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") \\
            or data[12:16] != (st.st_size & 0xFFFFFFFF).to_bytes(4, "little"):
        return None
    return data

for line in sys.stdin.buffer.read().split(b"\\n"):
    src, _, cfile = line.partition(b"\\0")
    src, cfile = os.fsdecode(src), os.fsdecode(cfile)
    try:
        data = beside(src)
        if data is None:
            py_compile.compile(src, cfile=cfile, doraise=True)
            continue
        os.makedirs(os.path.dirname(cfile), exist_ok=True)
        part = f"{cfile}.{os.getpid()}.part"
        try:
            with open(part, "wb") as f:
                f.write(data)
            os.replace(part, cfile)
        finally:
            if os.path.exists(part):
                os.unlink(part)
    except Exception:
        pass
"""


def _missing_bytecode(folder: str) -> list[str]:
    """"SOURCE\\0CACHED" for every plain module imported so far whose bytecode ``folder`` lacks (the file names
    this interpreter's optimization level's, as the child's -O flags compile it). A module of any subclass of
    ModuleType is skipped, unread: the lazy ones import themselves on any attribute."""
    import importlib.util
    import types

    out = []
    for m in list(sys.modules.values()):
        if type(m) is not types.ModuleType:
            continue
        spec = m.__dict__.get("__spec__")
        src = getattr(spec, "origin", None)
        if not (isinstance(src, str) and src.endswith(".py") and "\0" not in src and "\n" not in src):
            continue
        try:   # the name Python gives it under ``folder`` as its prefix, whatever the prefix is now
            name = os.path.basename(importlib.util.cache_from_source(src))
        except (ValueError, NotImplementedError):
            continue
        cached = os.path.join(folder, os.path.dirname(os.path.abspath(src)).lstrip(os.sep), name)
        if not os.path.exists(cached) and os.path.isfile(src):
            out.append(f"{src}\0{cached}")
    return out


def _bytecode_folder(setting) -> str | None:
    keep, where = setting
    if not keep:
        return None
    if not where:
        from .files import cache_path

        folder = cache_path("bytecode")   # None: no cache folder (Note [cache folders] in lenet/files.py)
        if folder is None:
            return None
        where = str(folder)
    return where


BYTECODE_LIMIT = 128 << 20   # the bytecode cache keeps its most recently written files up to this size
PRUNE_EVERY_S = 24 * 3600    # looked over at most once a day: a walk of its files costs a start-up


def _prune_due(folder: str) -> bool:
    try:
        return time.time() - os.stat(os.path.join(folder, ".pruned")).st_mtime > PRUNE_EVERY_S
    except OSError:
        return os.path.isdir(folder)


def prune_bytecode(folder: str, limit: int = BYTECODE_LIMIT) -> None:
    """Keep the bytecode cache (Note [bytecode cache]) under ``limit`` bytes, the files written last kept:
    it holds one copy of the sources it compiled per checkout and environment (16 MB each for ours),
    which would otherwise grow with every checkout a machine ever ran."""
    entries = []
    for d, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(d, n)
            try:
                st = os.stat(p)
            except OSError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
    total = sum(s for _, s, _ in entries)
    for _, size, p in sorted(entries):
        if total <= limit:
            break
        try:
            os.unlink(p)
            total -= size
        except OSError:
            pass
    try:
        with open(os.path.join(folder, ".pruned"), "w"):
            pass
    except OSError:
        pass


def begin(then=None, reads=("train", "test")) -> None:
    """What python -m lenet.train and lenet.train_step run first, before their own imports: the
    bytecode cache (Note [bytecode cache]), the reads of the images of the splits ``reads`` (Note [the
    images read from the first line] in lenet/sources.py), then the GPU's start-up threads (start_gpu);
    ``then``, when given, runs with the command line once the threads are going, before the compiles'
    imports (lenet.train starts its plotting child there: Note [the plotting child's first run] in
    lenet/plot.py)."""
    from . import files, interrupt, sources

    interrupt.guard()   # Note [signals from the first line] in lenet/interrupt.py
    files.hold_writes()   # Note [nothing written before the checks] in lenet/files.py
    one_blas_thread()
    keep_bytecode()
    files.library_caches()   # before CuPy's import (the preload thread's): Note [cache folders] in lenet/files.py
    args = sys.argv[1:]
    if {"-h", "--help"} & set(args):   # help needs no GPU: it prints at once
        return
    if any(a == "--gpus" or a.startswith("--gpus=") for a in args):   # lenet sweep's workers' parent: no
        return   # CUDA context of its own, its workers each start theirs (lenet/workers.py)
    sources.read_early(args, reads)
    _start_preload()   # the driver's and the imports' threads first
    if then is not None:
        then(args)
    start_gpu()


# Note [one BLAS thread]: NumPy's import loads its OpenBLAS, which starts a thread for every CPU then and
# there: on a 16-CPU machine that doubled `import numpy`, on the main thread, holding the GIL the start-up
# threads need (docs/performance.md, "Notes' numbers: start-up"). Our GPU programs do no BLAS on the host (the host's
# products are predict's CPU path, which is not one of them), so they ask OpenBLAS for one thread unless the
# user chose (OPENBLAS_NUM_THREADS, or GOTO_NUM_THREADS or OMP_NUM_THREADS, which OpenBLAS also reads).
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


def one_blas_thread() -> bool:
    """Note [one BLAS thread]: OPENBLAS_NUM_THREADS=1 in this process's environment (its children inherit it)
    when no thread count was set and NumPy is not yet imported; True when it set it."""
    if "numpy" in sys.modules or any(os.environ.get(v) for v in BLAS_THREAD_VARIABLES):
        return False
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    return True


# ---------------------------------------------------------------- the driver's thread

_driver_thread: threading.Thread | None = None
_context_up = threading.Event()    # set once the driver's thread is past the context (made or not)
_cudnn_path: str | None = None   # libcudnn's path as cuda.pathfinder resolves it (None: not found)
_cudnn_found = threading.Event()  # set once the preload thread has looked


_gpu0: tuple | None = None   # GPU 0's (compute capability, SMs) as the driver reports them, once the context is up


def start_context() -> bool:
    """cuInit and GPU 0's primary context (the one CuPy's runtime will use), through ctypes
    alone, and GPU 0's compute capability and SM count (``_gpu0``: what our kernels compile for
    before CuPy is imported, Note [first run] in lenet/kernels/nvrtc.py); False when there is no
    driver or no GPU (require_gpu() says so, in its turn)."""
    import ctypes

    global _gpu0
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        if not (cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
                and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0):
            return False
        facts = []
        for attribute in (75, 76, 16):   # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _MINOR, MULTIPROCESSOR_COUNT
            v = ctypes.c_int()
            if cuda.cuDeviceGetAttribute(ctypes.byref(v), attribute, dev) != 0:
                return True   # the context is up; the compiles then start where CuPy sees the device
            facts.append(v.value)
        _gpu0 = (10 * facts[0] + facts[1], facts[2])
        return True
    except (OSError, AttributeError):
        return False


def _driver_main() -> None:
    try:
        up = start_context()
        if up:
            mark("driver thread: cuInit + primary context done")
    finally:
        _context_up.set()
    _cudnn_found.wait()
    if up and _cudnn_path is not None:
        try:
            if warm_cudnn(_cudnn_path):
                mark("driver thread: cuDNN's one-time set-up done")
        except (OSError, AttributeError):
            pass


def warm_cudnn(path: str) -> bool:
    """Pay cuDNN's one-time set-up now, through ctypes (which lets go of the GIL): a handle and
    the descriptor API's heuristic query for a 1x1 convolution, all destroyed again. True when
    the query ran; False when a call failed (no GPU: cudnnCreate fails), which the program's
    own calls then report.

    Note [cuDNN's first call]: a process's first cuDNN query that lists engines, whether the
    descriptor API's heuristic or the graph API's ``create_execution_plans``, takes a fifth of a
    second; later ones take milliseconds. Through the frontend that time holds the GIL
    (pybind11 keeps it in C++), so the preload thread's first graph stalled every other thread;
    building it on a thread of its own beside CuPy's import gained nothing. Through ctypes it
    does not: the same set-up paid here, beside CuPy's import, leaves the first graph's plans
    as cheap as a later graph's (docs/probes.md, warm_overlap.py). cuDNN guards the set-up
    itself: a frontend call that arrives meanwhile waits for it. The prototypes are declared
    here rather than taken from descriptors._lib: this thread must not import descriptors
    (Note [overlapped start-up]); ``path`` is the libcudnn that descriptors._lib loads too."""
    import ctypes

    lib = ctypes.CDLL(path)
    vp, i, ip, pvp = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p)

    def fn(name, *argtypes):
        f = getattr(lib, name)
        f.restype, f.argtypes = ctypes.c_int, list(argtypes)
        return f

    handle, x, y, w, conv = vp(), vp(), vp(), vp(), vp()
    made = []
    try:
        for create, obj in (("cudnnCreate", handle), ("cudnnCreateTensorDescriptor", x),
                            ("cudnnCreateTensorDescriptor", y), ("cudnnCreateFilterDescriptor", w),
                            ("cudnnCreateConvolutionDescriptor", conv)):
            if fn(create, pvp)(ctypes.byref(obj)) != 0:
                return False
            made.append((create.replace("Create", "Destroy"), obj))
        nchw, f32, cross_correlation = 0, 0, 1   # CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, CUDNN_CROSS_CORRELATION
        set4d = fn("cudnnSetTensor4dDescriptor", vp, i, i, i, i, i, i)
        if (set4d(x, nchw, f32, 1, 1, 4, 4) or set4d(y, nchw, f32, 1, 1, 4, 4)
                or fn("cudnnSetFilter4dDescriptor", vp, i, i, i, i, i, i)(w, f32, nchw, 1, 1, 1, 1)
                or fn("cudnnSetConvolution2dDescriptor", vp, *[i] * 8)(conv, 0, 0, 1, 1, 1, 1, cross_correlation, f32)):
            return False
        returned = ctypes.c_int()
        perf = ctypes.create_string_buffer(64 * 8)   # 8 cudnnConvolutionFwdAlgoPerf_t (48 bytes each)
        return fn("cudnnGetConvolutionForwardAlgorithm_v7", vp, vp, vp, vp, vp, i, ip, vp)(
            handle, x, w, conv, y, 8, ctypes.byref(returned), perf) == 0 and returned.value > 0
    finally:
        for destroy, obj in reversed(made):
            fn(destroy, vp)(obj)


def start_gpu_driver() -> threading.Thread:
    """Start CUDA's driver, create GPU 0's primary context and pay cuDNN's one-time set-up on a
    thread, once per process (Note [overlapped start-up]); returns that thread. ctypes releases
    the GIL for the driver's and cuDNN's calls, so the imports and the dataset's reading go on
    meanwhile. cuDNN's part waits for the preload thread to locate libcudnn."""
    global _driver_thread
    if _driver_thread is None:
        _driver_thread = threading.Thread(target=_driver_main, name="lenet-cuda-init", daemon=True)
        _driver_thread.start()
    return _driver_thread


# ---------------------------------------------------------------- the imports' thread

def preload(engine, driver: threading.Thread | None = None, policy=lambda: None) -> None:
    """In order: locate libcudnn through cuda.pathfinder and hand its path to the driver's
    thread; import CuPy and the cuBLAS and cuBLASLt bindings; once the driver's thread has the
    context, start the CUDA runtime; then call ``engine()``, which waits until the program has
    parsed its flags and returns the engine's name (``policy()``: the flags' Policy then, where the program
    gave one). Only then import our libcudnn wrappers
    (descriptors) and lenet.model: the flag parse imports descriptors on the main thread. Then
    record the GPU's status (require_gpu() finds it cached) and, where the engine may use the graph
    API, import its frontend, wait for cuDNN's one-time set-up on the driver's thread (Note [cuDNN's
    first call]) and build and drop one tiny graph with one plan."""
    _preload_stack(driver)
    name = engine()
    import descriptors.graph  # noqa: F401 (here, before lenet.model, as ever: _first_graph finds it imported)
    from descriptors.handle import gpu_status

    from .engines import uses_frontend

    importlib.import_module(f"{__package__}.model")   # here, so the program's own import finds it done
    mark("preload thread: descriptors, lenet.model imported")
    up = driver is not None and gpu_status()[0]
    if uses_frontend(name):
        _first_graph(name, up, driver, policy())


def _preload_stack(driver: threading.Thread | None) -> None:
    """The preload's part before the engine is known: libcudnn located, CuPy and the cuBLAS bindings
    imported, the CUDA runtime started once the driver's thread has the context."""
    global _cudnn_path
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        _cudnn_path = load_nvidia_dynamic_lib("cudnn").abs_path
    except Exception:   # noqa: BLE001 (descriptors._lib says what is missing, in its turn)
        pass
    finally:
        _cudnn_found.set()
    recorded = open_recorded_libraries()   # Note [opening cuBLASLt without the GIL]
    if not os.path.isdir(os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")):
        from .files import wait_for_checks

        wait_for_checks()   # CuPy's import makes its cache folder: not before the checks (where no folder of this
                            # run's own stands in for it: Note [CuPy's cache folder after the checks] in lenet/files.py)
    import cupy

    from . import blas

    blas.binding("cublas")
    blas.binding("cublasLt")
    mark("preload thread: CuPy, cuBLAS bindings imported")
    record_libraries(recorded)
    if driver is not None:
        _context_up.wait()
        try:
            cupy.cuda.runtime.free(0)
            mark("preload thread: CUDA runtime started")
        except cupy.cuda.runtime.CUDARuntimeError:   # no GPU: require_gpu() says so, in its turn
            pass


def _first_graph(name: str, up: bool, driver: threading.Thread | None, policy=None) -> None:
    """The frontend imported and, with a GPU up, one tiny graph built and dropped (unless no stored choice
    of --engine auto runs cuDNN, nor would its search under ``policy``)."""
    from descriptors import Handle
    from descriptors.graph import ConvGraph, available

    if up and name == "auto" and not _cudnn_stored(policy):   # before the frontend's import, which costs too
        mark("preload thread: no first cuDNN graph (no choice stored or searched runs cuDNN)")   # nor the frontend
        return
    if not available()[0]:   # imports the frontend (once: cached)
        return
    mark("preload thread: frontend imported")
    if up:
        driver.join()   # a frontend call holds the GIL while it waits for cuDNN's set-up
        h = Handle()
        ConvGraph(h, "fwd", (1, 1, 4, 4), (1, 1, 1, 1), only=0).close()
        h.close()
        mark("preload thread: first cuDNN graph built")


def _cudnn_stored(policy=None) -> bool:
    """Note [a first graph only where one runs]: the preload's first tiny graph pays the frontend's own
    first-graph costs (on top of cuDNN's set-up: Note [cuDNN's first call]; docs/performance.md)
    ahead of the model, and the main thread waits for it. A later run of --engine auto whose stored
    choices are all of our kernels and cuBLASLt (the plan cache: lenet/plancache.py) builds no graph,
    so the preload builds none where the store names no cuDNN stage. Where it is wrong (a choice not
    stored yet, whose search then times cuDNN's graphs) the first graph is built by the search, on the
    main thread, as a run with no plan cache builds it. Where the store cannot be read: built. Where it holds
    no choice (a first run), built unless the search under the flags' ``policy`` takes, untimed, an engine
    that runs no cuDNN stage on this GPU (Note [the heuristic's engine] in lenet/engines/registry.py)."""
    try:
        from .engines import cudnn_stages, registry
        from .kernels import nvrtc
        from .plancache import stored_engines

        engines = stored_engines()
        if engines is None:
            if policy is None or _gpu0 is None:
                return True
            return registry.heuristic_runs_cudnn_stage("auto", policy, nvrtc.kernel_arch(_gpu0[0]))
    except Exception:   # noqa: BLE001 (the program reads the store itself, and says what is wrong)
        return True
    return cudnn_stages(engines)


# Note [opening cuBLASLt without the GIL]: CuPy's import opens libcublasLt (cuda.pathfinder loads it as
# a dependency of cuTENSOR, which CuPy tries to preload), a long dlopen (thousands of static constructors),
# through ctypes, which holds the GIL through dlopen: every other thread's Python
# stopped meanwhile. dlopen called as a foreign function (libc's, through ctypes) lets go of the GIL, so
# the preload thread opens the library that way before CuPy's import, and the main thread's imports go
# on; CuPy's then finds it loaded. Only the file cuda.pathfinder chose in an earlier run in the same
# environment (recorded in the cache folder: libraries.json, with the file's size and modification
# time, the interpreter, its path and the variables the search reads), RTLD_LOCAL, so that a record
# the search would no longer choose puts no symbols into the process's global scope. Other threads' dlopen
# waits for this one (the loader's lock), holding the GIL: it gains where the others run Python meanwhile.
# Skipping cuDNN's one-time set-up on the driver's thread (where the stored choices run no cuDNN stage)
# lost: its libraries then load later, on the way to the model (docs/performance.md, "Notes' numbers:
# start-up", has both measurements).
LIBRARIES = ("cublasLt",)   # opened this way, in this order


def _library_environment() -> list:
    """What decides which files cuda.pathfinder finds: the interpreter, its search path, and the variables it reads."""
    return [sys.executable, sys.prefix, *sys.path,
            *(f"{k}={os.environ.get(k, '')}" for k in ("LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "CONDA_PREFIX"))]


def _libraries_file(make: bool = False):
    """<cache root>/libraries.json; reading it makes no folder (``make``: files.cache_root's, which may)."""
    if make:
        from .files import cache_root

        root = cache_root()
        return None if root is None else root / "libraries.json"
    from ._early import cache_base

    base = cache_base()
    return None if base is None else os.path.join(base, "lenet", "libraries.json")


def open_recorded_libraries() -> dict:
    """Open the libraries an earlier run recorded (Note [opening cuBLASLt without the GIL]) through libc's
    dlopen, which lets go of the GIL; returns the record as read ({} when there is none or it does not
    apply here)."""
    import ctypes
    import json

    from .files import json_of, read_input

    try:
        record = json_of(read_input(_libraries_file(), limit=1 << 20).decode())   # a pipe there is never read
        if record.get("environment") != _library_environment():
            return {}
        libc = ctypes.CDLL(None)
        dlopen = libc.dlopen
        dlopen.restype, dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
    except (OSError, ValueError, AttributeError, TypeError):
        return {}
    for name in LIBRARIES:
        path, size, mtime = (record.get(name) or [None, None, None])[:3]
        try:
            st = os.stat(path)
        except (OSError, TypeError):
            continue
        if (st.st_size, st.st_mtime_ns) == (size, mtime) and dlopen(os.fsencode(path), os.RTLD_NOW | os.RTLD_LOCAL):
            mark(f"preload thread: lib{name} opened")
    return record


def record_libraries(recorded: dict) -> None:
    """Record where cuda.pathfinder found LIBRARIES in this run, for the next (unless recorded already)."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        record = {"environment": _library_environment()}
        for name in LIBRARIES:
            path = load_nvidia_dynamic_lib(name).abs_path   # loaded already: the search's own memory
            st = os.stat(path)
            record[name] = [path, st.st_size, st.st_mtime_ns]
        where = _libraries_file(make=True)
    except Exception:   # noqa: BLE001 (a run without the record is only slower)
        return
    if where is not None and record != recorded:
        import json

        from .files import write_later

        write_later(_write_record, where, json.dumps(record).encode())


def _write_record(where, data: bytes) -> None:
    from .files import OutputError, write_atomic

    try:
        write_atomic(where, data)
    except OutputError:
        pass


class _Preload:
    """The thread running ``preload``, and the engine it waits for."""

    def __init__(self):
        self.engine: str | None = None
        self.batches: tuple = ()   # the batch sizes the program will plan, when it knows them
        self.policy = None         # the flags' Policy, when the program gives it
        self.engine_known = threading.Event()
        self.build = None          # (key, fn) handed by build_beside: Note [the model beside the data]
        self.built = None          # (key, what fn returned), once it returned
        self.last_call = threading.Event()   # set by build_beside, or as the ``starting`` block ends
        self.thread = threading.Thread(target=self._run, name="lenet-imports", daemon=True)

    def _engine(self) -> str:
        if not self.engine_known.is_set():
            _let_go()   # waiting, not importing (Note [no import in flight at the switch])
            try:
                self.engine_known.wait()
            finally:
                _importing.acquire()
        return self.engine

    def _run(self) -> None:
        _importing.acquire()
        try:
            preload(self._engine, driver=start_gpu_driver(), policy=lambda: self.policy)
            if not self.last_call.is_set():
                _let_go()   # waiting, not importing
                try:
                    self.last_call.wait()
                finally:
                    _importing.acquire()
            if self.build is not None:
                key, fn = self.build
                self.built = (key, fn())
        except Exception:   # noqa: BLE001 (raised again where the program does this itself)
            return
        finally:
            _let_go()


_preload: _Preload | None = None
_started_early = False


def _start_preload() -> _Preload:
    global _preload
    start_gpu_driver()
    if _preload is None:
        _preload = _Preload()
        _preload.thread.start()
    return _preload


def build_beside(key, fn) -> None:
    """Note [the model beside the data]: ``fn()`` called on the preload thread once its own work is done,
    while the ``starting`` block goes on; ``built(key)`` then returns what it returned. Once per process, from
    inside the block (later, or where no start-up thread runs, it is never called)."""
    pre = _preload
    if pre is None or pre.last_call.is_set():
        return
    pre.build = (key, fn)
    pre.last_call.set()


def built(key):
    """What the ``fn`` handed to build_beside with this ``key`` returned, else None: it was handed another
    key, or none, or raised (the program then does the same work itself, and meets the error where it always
    did). Call it after the ``starting`` block, which waits for the preload thread; once: what was made for
    another key is dropped."""
    pre = _preload
    done = None if pre is None or pre.thread.is_alive() else pre.built
    if done is None:
        return None
    pre.built = None   # taken, or dropped with what it holds (a model for other sizes: its GPU memory)
    if done[0] == key:
        return done[1]
    del done
    if key is not None:   # a model is made next: the dropped one's memory back in CuPy's pool before its check
        import gc         # counts that free (lenet/model.py), where a reference cycle holds some of it

        gc.collect()
    return None


def start_gpu() -> None:
    """What a program runs first, before its own imports: the driver's thread, and the thread
    that imports the GPU stack and starts the CUDA runtime (Note [overlapped start-up]). Once
    per process; ``starting`` then tells it the engine, after the flags are parsed. From here
    on, the program's parser leaves without the interpreter's teardown (--help, a bad flag):
    these threads may be inside an import or a CUDA call. Then the compiles of the modules every
    program launches (``_start_compiles``)."""
    global _started_early
    from . import cli

    _started_early = True
    cli.leave_without_teardown()
    _start_preload()
    _start_compiles(None)


def started_early() -> bool:
    """Whether start_gpu() ran in this process."""
    return _started_early


def _start_compiles(engine: str | None, batches: tuple = (), pack: bool = False, policy=None) -> None:
    """Start our kernels' compiles (or their reads from the kernel cache) on threads, as soon as the
    driver's thread has GPU 0's architecture (Note [first run] in lenet/kernels/nvrtc.py): with no
    ``engine`` (start_gpu, before the program's own imports), the modules every program launches
    whatever its flags (lenet.kernels.COMMON_MODULES, the head's among them, one of the longest);
    with the engine and the batch sizes (``starting``, once the flags are parsed), the search's and
    the stage kernels the engine runs at those sizes (``pack``: the program trains packs of models;
    ``policy``: the flags', lenet.engines.Policy, where the program has it). The
    modules that list them are imported here, on the main thread, before the preload thread is told the
    engine: the two threads never import one module at once (Note [overlapped start-up])."""
    from . import kernels
    from .kernels import nvrtc

    if engine is None:
        def names():
            kernels.prefetch(kernels.COMMON_MODULES)
    else:
        from . import engines

        def names():
            kernels.prefetch(kernels.COMMON_MODULES)   # started already, unless start_gpu() was not run
            engines.warm(engine, batches or None, pack, policy)
            mark("compiles' thread: every module started")

    def run():
        try:   # NVRTC's libraries loaded (read from disk, on a fresh machine) while cuInit runs
            nvrtc.nvrtc()
        except Exception:   # noqa: BLE001 (a compile raises it again, on the thread that waits for it)
            pass
        _context_up.wait()
        if _gpu0 is None:   # no GPU, or no facts from the driver: the model compiles what it plans
            return
        arch, sms = _gpu0
        nvrtc.use_arch(lambda: arch)
        kernels.use_sm_count(sms)
        try:
            names()
        except Exception:   # noqa: BLE001 (a bad LENET_KERNEL_ARCH, a GPU too old: the model says so, in one line)
            pass

    start_gpu_driver()
    threading.Thread(target=run, name="lenet-compiles", daemon=True).start()


@contextlib.contextmanager
def starting(engine: str, batches=(), pack: bool = False, policy=None):
    """``with starting(args.engine): ...``: start the GPU's driver and context and cuDNN's set-up,
    and import what a model planned for ``engine`` loads (``preload``), on threads while the
    block runs (reading and checking a dataset, say), unless start_gpu() started them already;
    wait for both when the block ends. A ValueError from the block in a program that called
    start_gpu() (a bad --data-dir, say) goes to cli.run without waiting: it reports the error in
    one line and leaves through os._exit, threads and all. ``batches``: the batch sizes the
    program will plan (a training step's, an evaluation's), so the stage kernels the heuristic
    runs at them compile first (Note [first run] in lenet/kernels/nvrtc.py); ``pack``: its steps train packs
    of models (lenet sweep), which no whole step runs; ``policy``: the flags' (lenet.engines.Policy), whose
    rules may let no whole step run either."""
    pre = _start_preload()
    pre.engine, pre.batches, pre.policy = engine, tuple(batches), policy
    _start_compiles(engine, pre.batches, pack, policy)
    pre.engine_known.set()
    wait, failed = True, True
    try:
        yield
        from .files import checks_passed

        checks_passed()   # the block held the program's last checks that need no GPU (lenet/files.py)
        failed = False
    except BaseException:   # a bad dataset or value (data.DataError too): cli.run says so in one line
        wait = not _started_early   # and leaves through os._exit, so a program started early need not wait
        raise
    finally:
        from .files import writes_allowed

        pre.last_call.set()   # no build_beside from now on: the preload thread ends once its own work is done
        if wait and writes_allowed():   # else the preload may wait for the checks (CuPy's import): never joined
            pre.thread.join()
            start_gpu_driver().join()
            if failed:
                pre.built = None   # made for a run that stops here: dropped, with what it holds
