"""Timing a launcher the same way for every engine: CUDA events around calls replayed from a
CUDA graph.

Note [timing candidates]: a graph-API execute costs more host time than a whole convolution
at batch 64 (docs/probes.md, execute_overhead.py), so timing eager calls would measure the
host. Each candidate is therefore called twice eagerly (warm-up: lazy loading, first-call
costs; the second call gives a rough time t0), then k calls (k chosen for about
``budget_ms`` of work) are captured in a CUDA graph and the graph is replayed ``repeats``
times; the time is the fastest replay divided by k. The same method times descriptor-API
algorithms, graph-API plans and our own kernels, so their numbers compare. A candidate
whose t0 is already over ``cutoff_ms`` and over CUTOFF_FLOOR_MS is not replayed: t0 is its
time (it lost). The floor matters: below ~1 ms an eager t0 is mostly host time (a graph-API
plan's eager call costs more than its kernel), so only slow candidates are cut short. With
``graph=False`` the k calls are timed as eager launches instead: how a step that is not
captured will run them, host time included.
"""

from __future__ import annotations

import math

CUTOFF_FLOOR_MS = 1.0


def time_launcher(fn, stream, *, budget_ms: float = 1.0, repeats: int = 3, max_calls: int = 50,
                  cutoff_ms: float | None = None, graph: bool = True) -> float:
    """Milliseconds per call of ``fn`` (which launches on ``stream``)."""
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    fn()
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    t0 = cupy.cuda.get_elapsed_time(start, end)
    if cutoff_ms is not None and t0 > max(cutoff_ms, CUTOFF_FLOOR_MS):
        return t0
    k = int(min(max_calls, max(1, math.floor(budget_ms / max(t0, 1e-3)))))
    if not graph:
        best = math.inf
        for _ in range(repeats):
            start.record(stream)
            for _ in range(k):
                fn()
            end.record(stream)
            end.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(start, end) / k)
        return best
    stream.begin_capture()
    try:
        for _ in range(k):
            fn()
    finally:
        graph = stream.end_capture()
    graph.upload(stream)
    best = math.inf
    for _ in range(repeats):
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, end) / k)
    return best


def time_forward_backward(forward, backward, stream, *, graph: bool = True) -> tuple[float, float]:
    """(ms of ``forward``, ms of ``backward``) per call, each timed as ``time_launcher`` does; the
    backward after a forward has run, since it reads what the forward leaves."""
    forward()
    return time_launcher(forward, stream, graph=graph), time_launcher(backward, stream, graph=graph)
