"""2x2/2 max pooling on cuDNN's descriptor API (the graph API's Python frontend 1.28 has no
pooling), planned per batch size in chunks chosen by timing, like the convolutions.

Note [pooling batch limit]: cuDNN's max-pooling forward kernel puts the batch in the grid's
z dimension, which CUDA caps at 65535: at N = 65536 cudnnPoolingForward answers
NOT_SUPPORTED (seen on an H100, cuDNN 9.19). Chunk sizes above POOL_LIMIT are therefore not
candidates; below it the chunk size is timed like a convolution's (see Note [chunks] in
descriptors/search.py): the whole batch's time, calls of the chunk and the remainder call,
and kept in the same persistent store (Note [stored choices] there). A single size is not timed.
"""

from __future__ import annotations

from descriptors import TensorDescriptor
from descriptors.search import choose_chunk, chunk_sizes
from descriptors.timing import time_launcher

POOL_LIMIT = 32768


def _time_at(search, handle, pool, chw: tuple, c: int, captured: bool) -> float | None:
    """ms of forward + backward on c random images (kept in the search's memo); None above POOL_LIMIT."""
    if c > POOL_LIMIT:
        return None
    mode = pool.read()["mode"]
    key = ("pool", handle.device_id, chw, c, mode, captured)
    memo = search.memo
    if key not in memo:
        import cupy

        ch, hh, ww = chw
        xd, yd = TensorDescriptor((c, ch, hh, ww)), TensorDescriptor((c, ch, hh // 2, ww // 2))
        rng = cupy.random.default_rng(0)
        x, dy = rng.standard_normal(xd.shape, dtype=cupy.float32), rng.standard_normal(yd.shape, dtype=cupy.float32)
        y, dx = cupy.empty(yd.shape, cupy.float32), cupy.empty(xd.shape, cupy.float32)
        cupy.cuda.get_current_stream().synchronize()

        def run():
            pool.forward(handle, xd, x, yd, y)
            pool.backward(handle, yd, y, yd, dy, xd, x, xd, dx)
        memo[key] = time_launcher(run, handle.stream, graph=captured)
    return memo[key]


def _choose(search, handle, pool, chw: tuple, n: int, sizes: list, captured: bool) -> tuple[int, float | None]:
    """(chunk, estimated ms for the whole batch, None when not timed)."""
    if len(sizes) == 1:
        return sizes[0], None
    store, op = search.store, {"pool": list(chw), "n": n, "sizes": list(sizes), "mode": pool.read()["mode"],
                              "captured": captured}
    hit = store.get(op) if store is not None else None
    if hit is not None and hit.get("chunk") in sizes:
        return int(hit["chunk"]), hit.get("ms")

    def cost(c):
        full = _time_at(search, handle, pool, chw, c, captured)
        rest = _time_at(search, handle, pool, chw, n % c, captured) if n % c else 0.0
        return None if full is None or rest is None else (n // c) * full + rest
    chunk, ms = choose_chunk(n, sizes, cost)
    if store is not None:
        store.put(op, {"chunk": chunk, "ms": ms})
    return chunk, ms


class PlannedPool:
    """y = maxpool2x2(x) at batch n over the batch's rows of x (N, C, H, W) and y, and its backward
    dx from dy, in chunks chosen by timing."""

    def __init__(self, ctx, name: str, n: int, *, x, y, dx, dy):
        self.name, self.n = name, n
        h, pool, pol = ctx.handle, ctx.pool, ctx.policy
        self.mode = pool.read()["mode"]
        chw = tuple(x.shape[1:])
        sizes = chunk_sizes(n, pol.chunk, pol.deterministic and pol.fwd == "heuristic")
        if min(sizes) > POOL_LIMIT:       # a forced chunk above the limit: the largest that runs
            sizes = [POOL_LIMIT]
        self.chunk, self.ms = _choose(ctx.search, h, pool, chw, n, sizes, ctx.captured)
        descs = {}
        self._fwd, self._bwd = [], []
        for start in range(0, n, self.chunk):
            k = min(self.chunk, n - start)
            if k not in descs:
                descs[k] = (TensorDescriptor((k, *chw)), TensorDescriptor((k, chw[0], chw[1] // 2, chw[2] // 2)))
            xd, yd = descs[k]
            s = slice(start, start + k)
            xs, ys, dxs, dys = x[s], y[s], dx[s], dy[s]
            self._fwd.append(lambda xd=xd, yd=yd, xs=xs, ys=ys: pool.forward(h, xd, xs, yd, ys))
            self._bwd.append(lambda xd=xd, yd=yd, xs=xs, ys=ys, dxs=dxs, dys=dys:
                             pool.backward(h, yd, ys, yd, dys, xd, xs, xd, dxs))
        self._descs = descs   # the descriptors live as long as the plan

    def forward(self) -> None:
        for f in self._fwd:
            f()

    def backward(self) -> None:
        for f in self._bwd:
            f()

    workspace_bytes = 0

    def describe(self) -> list[dict]:
        return [{"layer": self.name, "op": "pool fwd+bwd", "engine": "legacy", "algo": self.mode,
                 "chunk": self.chunk, "chunks": -(-self.n // self.chunk), "time_ms": self.ms, "workspace_bytes": 0}]
