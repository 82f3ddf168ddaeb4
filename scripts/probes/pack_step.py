"""Probe: a pack of K LeNets at 128 images each, one captured step replayed (random batches, no gather):
us per step and images/s over all models, beside K = 1, and each operation's engine and planned time.
Usage: python scripts/probes/pack_step.py [K ...] [--exhaustive]

# Note (H100, 2026-11-24): with the heuristic ranking our launch shapes by the images per model (128: the
# small-batch versions), K = 16 ran 251.5 us (8.14 M img/s) and K = 64 882.6 us (9.28 M); ranked by the
# images of the whole pack (K n, what the SMs see) 227.1 us (9.02 M) and 776.3 us (10.55 M), so the heuristic
# ranks by K n (lenet/engines/ours.py). The exhaustive search: 214.3 us (9.55 M) and 715.7 us (11.45 M),
# choosing conv2's tiled forward (v2, 8 or 4 images a block, 16 blocks per SM) and 8 to 16 backward blocks
# per SM; at K = 64 stage 2's backward is 327 of the 716 us. `lenet sweep` therefore searches by default
# (--algo exhaustive) and keeps the choice in the plan cache."""
import sys
import time

import numpy as np

from lenet.engines import Policy
from lenet.model import LeNet

ALGO = "exhaustive" if "--exhaustive" in sys.argv else "heuristic"
for K in [int(k) for k in sys.argv[1:] if k.isdigit()] or [1, 4, 16, 64]:
    B = 128
    model = LeNet(max_batch=B, models=K, seed=list(range(K)), momentum=0.9, nesterov=True, label_smoothing=0.1,
                  cuda_graph=True, policy=Policy(fwd=ALGO, bwd_data=ALGO, bwd_filter=ALGO))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((K, B, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, (K, B))
    model.load_batch(*((x, y) if K > 1 else (x[0], y[0])))
    model.set_lr([0.01] * K if K > 1 else 0.01)
    for _ in range(20):
        model.step(B)
    model.stream.synchronize()
    t = time.perf_counter()
    steps = 200
    for _ in range(steps):
        model.step(B)
    model.stream.synchronize()
    us = (time.perf_counter() - t) / steps * 1e6
    rows = model.describe(B)
    print(f"K={K:3d}: {us:8.1f} us/step | {K * B / us:6.2f} M img/s | "
          + " | ".join(f"{r['layer']} {r['engine']} {r.get('algo')} {r.get('time_ms') or 0:.4f}" for r in rows), flush=True)
    model.close()
