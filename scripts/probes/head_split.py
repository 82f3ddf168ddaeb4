"""Probe (GPU): our head's forms (head.cu's one block per image group, head_split.cu's fc1 over 15
blocks a slice and the data gradients over 8: Note [head split] in lenet/kernels/head_split.cu; from
TAIL_MIN_BATCH images the tail, fc1's products on cuBLASLt: Note [head tail] in head_tail.cu) timed as
a whole step runs them. For each batch, the head is pinned to each shape in turn (head.cu's with the
heuristic's group, the split one at every slice size that fits), a LeNet of ``--engine ours`` plans
under the heuristic otherwise, and its captured step is timed back to back (as training runs) and one
step at a time, each waited for (as lenet.train_step reports it).

    python3 scripts/probes/head_split.py --batch 1 8 64 128 256 512 1024

Prints one line per (batch, shape), fastest back-to-back first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from heuristic_rows import time_steps  # noqa: E402  (this folder: the step timing both probes use)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 128, 256, 512, 1024])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    import numpy as np

    from lenet.engines import Policy
    from lenet.kernels import head, sm_count
    from lenet.model import LeNet

    shapes = head.shapes
    rng = np.random.default_rng(0)
    for n in args.batch:
        x = rng.standard_normal((n, 1, 28, 28)).astype(np.float32)
        y = rng.integers(0, 10, n).astype(np.int32)
        g1 = next((g for g in head.HEAD_GROUPS if -(-n // g) <= sm_count()), head.HEAD_GROUPS[-1])
        per = next(s.per for s in shapes(n, True) if s.form != "tail")
        pins = [head.HeadShape("block", g1, per)]
        pins += [head.HeadShape("split", g, per) for g in head.SPLIT_GROUPS if head.split_fits(n, g)]
        pins += [head.HeadShape("tail", g, 0) for g in head.TAIL_BLOCKS_PER_SM] if n >= head.TAIL_MIN_BATCH else []
        rows = []
        for shape in pins:
            head.shapes = lambda n, heuristic, models=1, s=shape: [s]
            model = LeNet(max_batch=n, policy=Policy(engine="ours"), cuda_graph=True)
            ahead, waited, _ = time_steps(model, x, y, args.steps)
            rows.append((ahead, float(np.median(waited)), shape.name))
            model.close()
        head.shapes = shapes
        for ahead, waited, name in sorted(rows):
            print(f"n={n:<6} back-to-back {ahead:7.1f} us  waited (median) {waited:7.1f} us  {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
