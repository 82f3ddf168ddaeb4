"""Where a training epoch's time goes at a small batch: the loop of python -m lenet.train (the gather of
the batch, then the step's CUDA graph, one after the other from Python) against its parts alone, on the
real training split. GPU time of an epoch (events), and the host's time, per step, us.

    python3 scripts/probes/loop_step.py [--batch 128 64] [--epochs 3] [--data-dir DIR]

Variants: loop (load_from + step, as lenet.train does), graph (step only: the captured step replayed on
the batch already there), gather (load_from only), host (the loop's Python with no GPU call: sched.at,
the checks), sync-loop (the loop, and the stream synchronized every 8 steps: the host then cannot run
ahead, so its time per step shows when it is the longer).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[128])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--data-dir", default=os.environ.get("LENET_DATA"))
    args = ap.parse_args()

    from lenet import data

    root = data.find_dataset(args.data_dir)
    (tx, ty), = data.load_splits(root, ("train",), cache=data.cache_dir())
    mean, std = data.pixel_stats(tx)
    for B in args.batch:
        measure(B, tx, ty, mean, std, args.epochs)


def measure(B, tx, ty, mean, std, epochs) -> None:
    import cupy

    from lenet import data
    from lenet.engines import Policy
    from lenet.kernels import Augment
    from lenet.model import LeNet
    from lenet.schedule import Schedule

    m = LeNet(max_batch=B, policy=Policy.parse("heuristic", engine="auto"), nesterov=True, momentum=0.9,
              label_smoothing=0.05, cuda_graph=True)
    train = data.GpuDataset(tx, ty, mean, std, m.stream)
    steps = math.ceil(train.size / B)
    sched = Schedule("cosine", 0.15, warmup=steps)
    augment = Augment(0, True, 0)
    m.plan(B)
    m.plan(train.size - (steps - 1) * B)
    ev0, ev1 = cupy.cuda.Event(), cupy.cuda.Event()

    def epoch(kind: str, e: int):
        order = train.order(0, e)
        t0 = time.perf_counter()
        ev0.record(m.stream)
        for s in range(steps):
            n = min(B, train.size - s * B)
            lr = sched.at(e * steps + s, steps, steps * 10)
            if kind == "host":
                if not 1 <= n <= m.max_batch or not (math.isfinite(lr) and lr >= 0):
                    raise ValueError
                continue
            if kind != "graph":
                m.load_from(train, order, s * B, n, lr=lr, augment=augment, epoch=e)
            if kind != "gather":
                m.step(n if kind != "graph" else B)
            if kind == "sync-loop" and s % 8 == 7:
                m.stream.synchronize()
        launched = time.perf_counter() - t0
        ev1.record(m.stream)
        ev1.synchronize()
        return cupy.cuda.get_elapsed_time(ev0, ev1) * 1e3 / steps, launched * 1e6 / steps

    m.load_from(train, train.order(0, 0), 0, B, lr=0.1, augment=augment)
    epoch("loop", 0)   # captures, warms
    print(f"batch {B}, {steps} steps an epoch; us per step (GPU by events; host: its clock until the last "
          f"launch, which waits when the GPU's queue is full):")
    for kind in ("loop", "graph", "gather", "host", "sync-loop", "loop"):
        rows = [epoch(kind, e) for e in range(1, epochs + 1)]
        gpu, host = min(r[0] for r in rows), min(r[1] for r in rows)
        print(f"{kind:<10s} GPU {gpu:7.2f}  host {host:7.2f}")


if __name__ == "__main__":
    main()
