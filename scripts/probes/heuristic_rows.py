"""Probe (GPU): the heuristic's stage shapes timed as a whole step runs them, not kernel by kernel.
For each batch and each combination of launch shapes (both forwards' images per block, stage 1's and
stage 2's backward), lenet/kernels/stages.py's HEURISTIC is replaced by that one row, a LeNet of
``--engine ours`` plans under the heuristic, and its captured step is timed two ways: one step at a
time, each waited for (as lenet.train_step reports it), and 300 steps back to back (as training runs).

    python3 scripts/probes/heuristic_rows.py --batch 8 64 128

Prints one line per (batch, combination), fastest back-to-back first.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FORWARDS = ("fused-fwd-v1-i1-g8", "fused-fwd-v1-i2-g8")
STAGE1_BACKWARDS = ("fused-bwd-v2-g2",)
STAGE2_BACKWARDS = ("fused-bwd-v7-g2", "fused-bwd-v7-g4", "fused-bwd-v8-g3")


def time_steps(model, x, y, steps: int) -> tuple[float, list[float], float]:
    """A LeNet's captured step on (x, y), after 5 untimed: (us a step back to back, as training runs; us of
    each step run alone and waited for, as lenet.train_step reports it; the host's us a step back to back)."""
    import cupy

    n = len(x)
    model.load_batch(x, y)
    for _ in range(5):
        model.step(n, 0.0)
    stream, start, end = model.stream, cupy.cuda.Event(), cupy.cuda.Event()
    waited = []
    for _ in range(steps):
        start.record(stream)
        model.step(n, 0.0)
        end.record(stream)
        end.synchronize()
        waited.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
    stream.synchronize()
    t = time.perf_counter()
    start.record(stream)
    for _ in range(steps):
        model.step(n, 0.0)
    end.record(stream)
    end.synchronize()
    wall = (time.perf_counter() - t) / steps
    return cupy.cuda.get_elapsed_time(start, end) / steps * 1e3, waited, wall * 1e6


def ours_steps(batches, steps: int):
    """For each batch n: (n, time_steps' three numbers, and the plan: each operation's engine and kernel or
    plan) of a fresh LeNet of ``--engine ours`` under the heuristic, on random images (seed 0), closed after."""
    import numpy as np

    from lenet.engines import Policy
    from lenet.model import LeNet

    rng = np.random.default_rng(0)
    for n in batches:
        x = rng.standard_normal((n, 1, 28, 28)).astype(np.float32)
        y = rng.integers(0, 10, n).astype(np.int32)
        model = LeNet(max_batch=n, policy=Policy(engine="ours"), cuda_graph=True)
        try:
            timed = time_steps(model, x, y, steps)
            plan = "; ".join(f"{r['layer']}: {r['engine']} {r['algo']}" for r in model.describe(n))
            yield (n, *timed, plan)
        finally:
            model.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64, 128])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--forward", nargs="+", default=FORWARDS, help="both forwards' launch shapes tried")
    ap.add_argument("--conv1-backward", nargs="+", default=STAGE1_BACKWARDS, help="stage 1's backward shapes tried")
    ap.add_argument("--conv2-backward", nargs="+", default=STAGE2_BACKWARDS, help="stage 2's backward shapes tried")
    args = ap.parse_args()
    import numpy as np

    from lenet.engines import Policy
    from lenet.kernels import stages
    from lenet.model import LeNet

    live = stages.table()   # the rows of the generation our kernels are compiled for (LENET_KERNEL_ARCH)
    table, inf = dict(live), stages.INF
    rng = np.random.default_rng(0)
    for n in args.batch:
        x = rng.standard_normal((n, 1, 28, 28)).astype(np.float32)
        y = rng.integers(0, 10, n).astype(np.int32)
        rows = []
        for fwd, b1, b2 in itertools.product(args.forward, args.conv1_backward, args.conv2_backward):
            live.update({("conv1", "forward"): ((inf, fwd),), ("conv2", "forward"): ((inf, fwd),),
                         ("conv1", "backward"): ((inf, b1),), ("conv2", "backward"): ((inf, b2),)})
            model = LeNet(max_batch=n, policy=Policy(engine="ours"), cuda_graph=True)
            ahead, waited, wall = time_steps(model, x, y, args.steps)
            rows.append((ahead, float(np.mean(waited)), wall, fwd, b1, b2))
            model.close()
        for ahead, waited, wall, fwd, b1, b2 in sorted(rows):
            print(f"n={n:<6} back-to-back {ahead:7.1f} us  waited {waited:7.1f} us  host {wall:7.1f} us  "
                  f"fwd {fwd:<20} conv1 bwd {b1:<16} conv2 bwd {b2}", flush=True)
    live.clear()
    live.update(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
