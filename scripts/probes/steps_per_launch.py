"""Probe (GPU): a small step's time when one graph launch runs several steps. ``model.step`` replays one
captured step a launch; here K steps of the same batch are captured as one graph (the model's runner, as
its own step's), replayed, and timed with CUDA events, us a step, beside K = 1. The steps are the same
the model runs (the planner's choice, the whole-step kernel where it wins): their parameters after K
steps of one launch are checked bit for bit against K launches of one step from the same start.

    python3 scripts/probes/steps_per_launch.py [--batch 1 8 64] [--k 1 4 16 64] [--replays 2000]

Note [steps per launch]: a graph replay of one step took the GPU about 20 us at 1 image (an H200,
loop_step.py) where the planner's steps back to back in one graph took 16.4 (an H100), and the host's
launch costs about 3 us: was the rest each launch's own? On an H200 (2026-11-28, defaults), us a step at
K = 1 / 4 / 16 / 64 steps a launch: 1 image 20.13 / 18.95 / 18.47 / 18.40; 8 images 18.56 / 20.96 / 21.71 /
21.82; 64 images 28.57 / 29.02 / 29.28 / 29.28; every K bit for bit the same as K launches. A launch costs
about 1.7 us at one image and nothing at 64 (at 8 steps in one graph lose, not yet explained: the
planner chose the step at 8 images timing one step a launch); the step itself is 18.4 us at one image on that GPU. A step of 12 us needed a
shorter step, not fewer launches: the whole step of four barriers (lenet/kernels/step_cluster.cu), K = 1 / 16: 1 image
11.76 / 10.11, 8 images 13.02 / 13.64, 16 images 15.98 / 14.43 (the loss at 8 is still there).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LR = 0.05


def model(batch: int):
    from lenet.model import LeNet
    from lenet.engines import Policy

    m = LeNet(max_batch=batch, policy=Policy.parse("heuristic"), seed=0, cuda_graph=True, momentum=0.9)
    rng = np.random.default_rng(0)
    m.load_batch(rng.standard_normal((batch, 1, 28, 28)).astype(np.float32),
                 rng.integers(0, 10, batch).astype(np.int32))
    m.inputs.take_lr(LR)
    m.plan(batch)
    return m


def launch(m, batch: int, k: int) -> None:
    step = m.plan(batch)
    m.runner.run(("probe-train", batch, k), lambda: [m._train(step) for _ in range(k)], True)


def us_per_step(m, batch: int, k: int, replays: int) -> float:
    import cupy

    launch(m, batch, k)   # captured on first use
    m.stream.synchronize()
    s, e = cupy.cuda.Event(), cupy.cuda.Event()
    s.record(m.stream)
    for _ in range(replays):
        launch(m, batch, k)
    e.record(m.stream)
    e.synchronize()
    return cupy.cuda.get_elapsed_time(s, e) * 1000 / (replays * k)


def same_as_one_at_a_time(batch: int, k: int) -> bool:
    a, b = model(batch), model(batch)
    launch(a, batch, k)
    for _ in range(k):
        launch(b, batch, 1)
    a.stream.synchronize(), b.stream.synchronize()
    same = np.array_equal(a.params.get(), b.params.get())
    a.close(), b.close()
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--replays", type=int, default=2000, help="launches timed for K = 1 (fewer for larger K)")
    args = ap.parse_args()
    print("batch | " + " | ".join(f"K={k} us a step" for k in args.k) + " | K steps of one launch = K launches")
    for batch in args.batch:
        m = model(batch)
        times = [us_per_step(m, batch, k, max(20, args.replays // k)) for k in args.k]
        m.close()
        same = same_as_one_at_a_time(batch, max(args.k))
        print(f"{batch} | " + " | ".join(f"{t:.2f}" for t in times) + f" | {'bit for bit' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
