"""Where a large-batch step spends its time, eager against graph on one model (diagnostic)."""
import sys, numpy as np, cupy
sys.path.insert(0, '.')
from descriptors import AlgoPolicy
from lenet.model import LeNet
n = 65536
m = LeNet(max_batch=n, policy=AlgoPolicy.parse("exhaustive"), momentum=0.9)
rng = np.random.default_rng(0)
m.load_batch(rng.standard_normal((n, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, n).astype(np.int32))
pl = m.plan(n)
print({f"{k[0]} {k[1]}": v.name for k, v in pl.algos.items()}, pl.fused_ms, pl.lt is not None)
def t(k=5):
    s, e = cupy.cuda.Event(), cupy.cuda.Event()
    m.step(n, 0.01); s.record(m.stream)
    for _ in range(k): m.step(n, 0.01)
    e.record(m.stream); e.synchronize(); return cupy.cuda.get_elapsed_time(s, e) / k
for graph in (False, True, False, True):
    m.cuda_graph = graph
    print("graph" if graph else "eager", f"{t():.2f} ms")
# per-phase eager timing
s, e = cupy.cuda.Event(), cupy.cuda.Event()
for name, fn in (("forward", lambda: m._forward(pl, grad=True)), ("backward", lambda: m._backward(pl)), ("sgd", m._sgd)):
    fn(); s.record(m.stream); fn(); e.record(m.stream); e.synchronize(); print(name, f"{cupy.cuda.get_elapsed_time(s, e):.2f} ms")
