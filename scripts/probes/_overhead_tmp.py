import sys, time; sys.path.insert(0, '.')
import cupy, descriptors as D
from descriptors.graph import ConvGraph
from descriptors.timing import time_launcher
h = D.Handle()
for n in (1, 64):
    g = ConvGraph(h, "fwd", (n, 6, 12, 12), (16, 6, 5, 5), fuse="bias_relu")
    rng = cupy.random.default_rng(0)
    a = {r: rng.standard_normal(g.shapes[r], dtype=cupy.float32) for r in g.roles}
    cupy.cuda.Device().synchronize()
    ws = D.Workspace(1 << 24)
    p = g.plans[0]
    pack = g.pack(a, h.device_id)
    f = lambda: g.run_packed(p, pack, ws, h)
    for _ in range(20): f()
    h.stream.synchronize()
    t = time.perf_counter()
    for _ in range(200): f()
    host = (time.perf_counter() - t) / 200 * 1e6
    h.stream.synchronize()
    lg = g._g._lowered_graph; cpp = g._g._plans[p.index].cpp_index
    from cudnn._handle import to_backend_handle
    bh = h.ptr
    f2 = lambda: lg._execute_plan_at_index(pack, ws.ptr, cpp, bh)
    f2(); h.stream.synchronize()
    t = time.perf_counter()
    for _ in range(200): f2()
    host2 = (time.perf_counter() - t) / 200 * 1e6
    h.stream.synchronize()
    print(f"n={n}: host per execute: public {host:.1f} us, lowered {host2:.1f} us; captured {time_launcher(f, h.stream)*1000:.1f} us, eager {time_launcher(f, h.stream, graph=False)*1000:.1f} us")
