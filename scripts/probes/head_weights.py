"""Probe (GPU): the head's weight gradients (head_weights.cu) on whole steps. Each variant, KERNEL/PLACE,
rebuilds our kernels with that kernel and times the captured step of a LeNet of ``--engine ours`` under the
heuristic, back to back as training runs (heuristic_rows.time_steps), in a process of its own:

    KERNEL  tree        head_weights.cu as it is
            aN          the same with N images' loads in flight a chunk (head_weight_sums<N, ...>), e.g. a16
            PATH        another source of the whole file (e.g. `git show REV:lenet/kernels/head_weights.cu`)
    PLACE   side        where the model puts it (the side stream where its grid fits: Note [side stream])
            main        on the main stream, between the head's data gradients and the stages' backwards
            rN          ranges of N images (several partial rows, then stage_reduce; on the main stream
                        where the grid does not fit beside)

    python3 scripts/probes/head_weights.py --batch 128 150 256 --variants tree/side a16/side tree/main

Note [the weights' loads in flight] in head_weights.cu has what it measured; docs/kernels.md, "head_weights.cu".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def kernel_text(kernel: str, tree: str) -> str:
    """head_weights.cu's text under KERNEL (see the docstring)."""
    if kernel == "tree":
        return tree
    if kernel[0] == "a" and kernel[1:].isdigit():
        return tree.replace("head_weight_sums<8,", f"head_weight_sums<{int(kernel[1:])},")
    return Path(kernel).read_text()


def child(variant: str, batches: list[int], steps: int) -> None:
    import numpy as np

    import lenet.kernels as K
    from heuristic_rows import time_steps
    from lenet.engines import Policy
    from lenet.engines.context import SideStream
    from lenet.kernels import head as H
    from lenet.model import LeNet

    kernel, place = variant.rsplit("/", 1)
    tree = (K.FOLDER / "head_weights.cu").read_text()
    text, source = kernel_text(kernel, tree), K.source
    K.source = lambda name: source(name).replace(tree, text) if name.removesuffix("__pack") == "head_weights" \
        else source(name)
    if place == "main":   # the head's grids are 120 blocks a range; the stages' reductions are not multiples of it
        SideStream.fits = staticmethod(lambda blocks: blocks <= K.sm_count() and blocks % 120 != 0)
    elif place.startswith("r"):
        H.HEAD_PER = (int(place[1:]),) + H.HEAD_PER
    elif place != "side":
        raise SystemExit(f"unknown place {place!r}: side, main or rN")
    rng = np.random.default_rng(0)
    for n in batches:
        x = rng.standard_normal((n, 1, 28, 28)).astype(np.float32)
        y = rng.integers(0, 10, n).astype(np.int32)
        model = LeNet(max_batch=n, policy=Policy(engine="ours"), cuda_graph=True)
        ahead, _, _ = time_steps(model, x, y, steps)
        model.close()
        print(json.dumps({"variant": variant, "n": n, "ahead": ahead}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[128, 150, 256])
    ap.add_argument("--variants", nargs="+", default=["tree/side", "a16/side", "a4/side", "tree/main", "tree/r32"])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=2, help="runs of the variant list, one after another")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.batch, args.steps)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for i, v in enumerate(args.variants):   # a plan cache each: a stored head shape outlives ranges
                env = dict(os.environ, LENET_PLAN_CACHE=str(Path(tmp) / f"{i}.json"))
                r = subprocess.run([sys.executable, __file__, "--child", v, "--steps", str(args.steps), "--batch",
                                    *map(str, args.batch)], env=env, capture_output=True, text=True)
                got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
                if r.returncode != 0 or not got:
                    print(f"{v}: failed (rc {r.returncode}): {r.stderr.strip().splitlines()[-1:]}", flush=True)
                    continue
                print(f"{v:<24} " + "  ".join(f"n={g['n']} {g['ahead']:6.1f} us" for g in got), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
