"""Probe (GPU): where a small step's time goes along its chain of kernels, measured on the captured step
itself rather than kernel by kernel (ncu serializes kernels and so misses what programmatic launch
overlaps). Each variant rebuilds our kernels from their sources with one change and times the step of a
LeNet of ``--engine ours`` under the heuristic:

    base              the kernels as they are
    empty             every kernel of ours returns right after griddep_entry(): the chain's floor
                      (launches, programmatic-launch hand-offs, the side stream's join)
    empty:MODULE      that module's kernels return right after griddep_entry() (its share of the chain)
    empty:MODULE:K    only kernel K of that module
    A+B               both (empty:head_split+empty:head_weights: the head's share of the step)

The step's numbers are wrong in every variant but base (the check against cuDNN is switched off, the
plan cache is a temporary file): only its time means anything. Each variant runs in a process of its own
(the kernel cache keys binaries by source, so each variant compiles once).

    python3 scripts/probes/chain.py --batch 1 64 --variants base empty empty:head_split
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

CALL = "griddep_entry();"
EMPTY = "{ griddep_entry(); return; }"


def patch(variant: str, module: str, text: str) -> str:
    """The source of ``module`` under ``variant`` (variants joined by + apply one after another)."""
    if "+" in variant:
        for v in variant.split("+"):
            text = patch(v, module, text)
        return text
    base = module.removesuffix("__pack")
    if variant == "empty":
        return text.replace(CALL, EMPTY)
    if variant.startswith("empty:"):
        parts = variant.split(":")
        if parts[1] != base:
            return text
        if len(parts) == 2:
            return text.replace(CALL, EMPTY)
        at = text.index(parts[2] + "(")
        i = text.index(CALL, at)
        return text[:i] + EMPTY + text[i + len(CALL):]
    return text


def child(variant: str, batches: list[int], steps: int) -> None:
    import numpy as np

    import lenet.kernels as K
    from lenet.engines import Policy
    from lenet.engines.base import Check
    from lenet.engines.ours import Ours
    from lenet.model import LeNet
    from heuristic_rows import time_steps

    source = K.source
    K.source = lambda name: patch(variant, name, source(name))
    if variant != "base":
        Ours.check_stage = lambda self, *a, **k: Check(0.0, 0)
    rng = np.random.default_rng(0)
    for n in batches:
        x = rng.standard_normal((n, 1, 28, 28)).astype(np.float32)
        y = rng.integers(0, 10, n).astype(np.int32)
        model = LeNet(max_batch=n, policy=Policy(engine="ours"), cuda_graph=True)
        ahead, waited, host = time_steps(model, x, y, steps)
        model.close()
        print(json.dumps({"variant": variant, "n": n, "ahead": ahead, "waited": float(np.median(waited)),
                          "host": host}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--variants", nargs="+", default=["base", "empty"])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=1, help="runs of the variant list, one after another")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.batch, args.steps)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, LENET_PLAN_CACHE=str(Path(tmp) / "plans.json"))
        for _ in range(args.repeat):
            for v in args.variants:
                r = subprocess.run([sys.executable, __file__, "--child", v, "--steps", str(args.steps), "--batch",
                                    *map(str, args.batch)], env=env, capture_output=True, text=True)
                got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
                if r.returncode != 0 or not got:
                    print(f"{v}: failed (rc {r.returncode}): {r.stderr.strip().splitlines()[-1:]}", flush=True)
                for g in got:
                    print(f"n={g['n']:<5} {v:<40} back-to-back {g['ahead']:6.1f} us  waited {g['waited']:6.1f} us  "
                          f"host {g['host']:6.1f} us", flush=True)
                rows += got
    return 0


if __name__ == "__main__":
    sys.exit(main())
