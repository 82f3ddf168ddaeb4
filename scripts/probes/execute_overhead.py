"""Probe: host time of one graph-API execute, through the frontend's public execute_plan_at_index
and through the lowered graph's own execute (see Note [graph execute] in descriptors/graph.py).

    python3 scripts/probes/execute_overhead.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402

import descriptors as D  # noqa: E402
from descriptors.graph import ConvGraph  # noqa: E402
from lenet.timing import time_launcher  # noqa: E402


def host_us(fn, stream, k=200):
    for _ in range(20):
        fn()
    stream.synchronize()
    t = time.perf_counter()
    for _ in range(k):
        fn()
    us = (time.perf_counter() - t) / k * 1e6
    stream.synchronize()
    return us


def main():
    h = D.Handle()
    for n in (1, 64):
        g = ConvGraph(h, "fwd", (n, 6, 12, 12), (16, 6, 5, 5), fuse="bias_relu")
        rng = cupy.random.default_rng(0)
        a = {r: rng.standard_normal(g.shapes[r], dtype=cupy.float32) for r in g.roles}
        cupy.cuda.Device().synchronize()
        ws = D.Workspace(1 << 24)
        p = g.plans[0]
        pack = g.pack(a, h.device_id)
        from descriptors.graph import _frontend_handle
        public = host_us(lambda: g._g.execute_plan_at_index(pack, ws.ptr, p.index, handle=_frontend_handle(h)),
                         h.stream)
        lowered = host_us(lambda: g.run_packed(p, pack, ws, h), h.stream)
        captured = time_launcher(lambda: g.run_packed(p, pack, ws, h), h.stream) * 1000
        print(f"n={n}: host per execute: public {public:.1f} us, lowered {lowered:.1f} us | GPU {captured:.1f} us")


if __name__ == "__main__":
    main()
