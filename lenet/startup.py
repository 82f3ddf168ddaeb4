"""What a program's start-up thread does while its main thread imports, parses its flags and
reads its data (Note [overlapped start-up] in lenet/cli.py, which runs it)."""

from __future__ import annotations

import importlib

from .cli import mark


def preload(engine, gpu=None) -> None:
    """In order: import CuPy and the cuBLAS and cuBLASLt bindings; once the thread ``gpu``
    (cli.start_gpu_driver's) has started the driver, start the CUDA runtime (0.1 s); then call
    ``engine()``, which waits until the program has parsed its flags and returns the engine's
    name. Only then import our libcudnn wrappers (descriptors) and lenet.model: the flag parse
    imports descriptors on the main thread, and two threads importing one package at once meet
    Python's import-deadlock guard. Then record the GPU's status (require_gpu() finds it
    cached) and, unless the engine is legacy, import the graph API's frontend and build and
    drop one tiny graph with one plan: a process's first cuDNN graph pays ~0.2 s of one-time
    set-up, later ones ~12 ms (scripts/probes/first_graph.py)."""
    import cupy

    from . import blas

    blas.binding("cublas")
    blas.binding("cublasLt")
    mark("preload thread: CuPy, cuBLAS bindings imported")
    if gpu is not None:
        gpu.join()
        try:
            cupy.cuda.runtime.free(0)
            mark("preload thread: CUDA runtime started")
        except cupy.cuda.runtime.CUDARuntimeError:   # no GPU: require_gpu() says so, in its turn
            pass
    name = engine()
    from descriptors import Handle
    from descriptors.graph import ConvGraph, available
    from descriptors.handle import gpu_status

    importlib.import_module(f"{__package__}.model")   # here, so the program's own import finds it done

    mark("preload thread: descriptors, lenet.model imported")
    up = gpu is not None and gpu_status()[0]
    if name == "legacy" or not available()[0]:   # imports the frontend (once: cached)
        return
    mark("preload thread: frontend imported")
    if up:
        h = Handle()
        ConvGraph(h, "fwd", (1, 1, 4, 4), (1, 1, 1, 1), only=0).close()
        h.close()
        mark("preload thread: first cuDNN graph built")
