"""CUDA modules compiled by NVRTC through CuPy (its kernel cache keeps them for later runs), each
on a thread of its own, started before they are needed: lenet's kernels (lenet/kernels/) and the
search's distance kernel (descriptors/search.py) use it.

Note [first run]: on a program's first run on a machine (CuPy's kernel cache, $CUPY_CACHE_DIR or
~/.cupy/kernel_cache, empty), NVRTC compiles every module it launches. Measured on an H100 machine
(scripts/probes/train_timeline.py --cold): our stage kernels in one module took 4.9 s and the
head's 1.9 s, one after the other on the way to the first step, and CuPy's own kernels the search
and the model used (fills, copies, and reductions through CUB, whose templates took 2-2.5 s a
module) 10 s more. So: no generic CuPy kernel on the way to a step (uploads, memset and device
copies instead, and the search's distances in a kernel of our own), and our kernels as small
modules whose compiles start on threads as soon as CuPy is imported and the context is up
(lenet/startup.py). NVRTC lets go of the GIL while it compiles, so they run beside the rest of the
start-up and each other; a caller then waits only for the module it asks for, if it is not ready
yet. A first run waits for the longest compile, not for the sum. (A compile thread still running
at the interpreter's exit is waited for, at exit: CuPy torn down under it crashed the process.)
"""

from __future__ import annotations

import atexit
import threading
from concurrent.futures import Future, wait

_lock = threading.Lock()
_modules: dict = {}   # key -> concurrent.futures.Future of its compiled cupy.RawModule


def prefetch(key: str, source, options: tuple = ()) -> Future:
    """Start compiling (or loading from CuPy's cache) module ``key`` now, on a thread of its own, for
    the current device, unless it was started before; ``source()`` returns its CUDA source. Returns
    the future of the cupy.RawModule: its result() waits for it, and raises a compile error on the
    caller's thread."""
    with _lock:
        fut = _modules.get(key)
        if fut is None:
            import cupy

            fut = _modules[key] = Future()
            device = cupy.cuda.runtime.getDevice()
            threading.Thread(target=_build, args=(fut, source, tuple(options), device), name=f"nvrtc-{key}",
                             daemon=True).start()
    return fut


def _build(fut: Future, source, options: tuple, device: int) -> None:
    try:
        import cupy

        with cupy.cuda.Device(device):
            mod = cupy.RawModule(code=source(), options=options)
            mod.compile()
        fut.set_result(mod)
    except BaseException as e:   # noqa: BLE001 (raised again on the thread that asks for the module)
        fut.set_exception(e)


@atexit.register
def _finish() -> None:
    with _lock:
        pending = list(_modules.values())
    wait(pending)
