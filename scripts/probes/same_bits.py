"""Probe (GPU): whether two checkouts compute the same numbers to the bit. In each tree a LeNet of ``--engine
ours`` under the heuristic takes 3 steps on fixed data (images with exact zeros, as real data has): one model
at several batch sizes, a pack of two, and the head's weight gradients over ranges of 32 images (several
partial rows, then stage_reduce); every weight and gradient after them is compared byte for byte. For a
change meant to keep every sum's order (Note [the weights' loads in flight] in head_weights.cu).

    python3 scripts/probes/same_bits.py --trees OLD_CHECKOUT .

Each tree runs in a process of its own, importing that tree's package and this file's copy of the steps. At 1
and 8 images the plan times the whole step's kernel against the chain of kernels (lenet/steps.py), which sum
in different orders: there two trees can differ by their timing alone.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BATCHES = (1, 8, 100, 128, 150, 200, 256)


def child(out: str) -> None:
    sys.path.insert(0, os.getcwd())   # the tree the process runs in
    import numpy as np

    from lenet.engines import Policy
    from lenet.kernels import head as H
    from lenet.model import LeNet

    arrays = {}

    def run(tag: str, n: int, models: int = 1) -> None:
        rng = np.random.default_rng(n + 1000 * models)
        shape = (models, n) if models > 1 else (n,)
        x = np.maximum(rng.standard_normal(shape + (1, 28, 28)), 0).astype(np.float32)
        y = rng.integers(0, 10, shape).astype(np.int32)
        kw = dict(models=models, seed=list(range(models))) if models > 1 else {}
        m = LeNet(max_batch=n, policy=Policy(engine="ours"), cuda_graph=True, momentum=0.9, **kw)
        m.load_batch(x, y)
        for _ in range(3):
            m.step(n, 0.05)
        m.stream.synchronize()
        for i in range(models):
            which = i if models > 1 else None
            for kind, d in (("grad", m.grad_dict(which)), ("w", m.state_dict(which))):
                for k, v in d.items():
                    arrays[f"{tag}{n}m{i}/{kind}/{k}"] = v
        m.close()

    for n in BATCHES:
        run("one", n)
    run("pack", 100, models=2)
    H.HEAD_PER = (32,) + H.HEAD_PER
    for n in (128, 150, 256):
        run("r32-", n)
    np.savez(out, **arrays)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"), required=True)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return 0
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        got = []
        for i, tree in enumerate(args.trees):
            out = str(Path(tmp) / f"{i}.npz")
            r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--trees", *args.trees, "--child", out],
                               cwd=tree, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{tree}: failed (rc {r.returncode}): {r.stderr.strip().splitlines()[-3:]}")
                return 1
            got.append(np.load(out))
        a, b = got
        differ = [k for k in a.files if k not in b.files or a[k].tobytes() != b[k].tobytes()]
        print(f"{len(a.files)} arrays compared, {len(differ)} differ" + (f": {', '.join(differ[:8])}" if differ else ""))
        return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
