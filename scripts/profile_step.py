"""Run training steps of our LeNet (and optionally PyTorch's) for a profiler to look at.

    ncu --clock-control none --print-summary per-kernel python3 scripts/profile_step.py --batch 64

Warm-up steps run first, then --steps more: profile those (ncu's --launch-skip).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from descriptors import AlgoPolicy  # noqa: E402
from lenet.model import LeNet  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--algo", default="exhaustive")
    ap.add_argument("--graph", action="store_true", help="replay the step from a CUDA graph")
    ap.add_argument("--fused", action="store_true", help="the fused step (if the model has one)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, args.batch).astype(np.int32)
    kw = {"fused": True} if args.fused else {}
    m = LeNet(max_batch=args.batch, policy=AlgoPolicy.parse(args.algo), cuda_graph=args.graph, **kw)
    m.load_batch(x, y)
    for _ in range(5):
        m.step(args.batch, 0.01)
    m.stream.synchronize()
    for _ in range(args.steps):
        m.step(args.batch, 0.01)
    m.stream.synchronize()
    print(f"loss {m.loss():.4f}")


if __name__ == "__main__":
    main()
