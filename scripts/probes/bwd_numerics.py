"""Probe (GPU): each candidate's share of the step's distance from float64, at the step's own decisions
(tests/numerics.py's measure): stage 2's backward pinned to each shape (HEURISTIC's conv2 backward row,
as heuristic_rows.py pins it) under --engine ours, then the searches (auto, heuristic and exhaustive) with
what they chose. Prints conv2's weight and bias distances (relative L2, max-elementwise) and the worst of
the other tensors.

    python3 scripts/probes/bwd_numerics.py --batch 8192 65536 --shapes fused-bwd-v7-g2 fused-bwd-v8-g3
    python3 scripts/probes/bwd_numerics.py --define none S2R_FRESH=1 --searches   # a compile-time variant

--define compiles our kernels with those macros for the pinned runs (as stage_kernels.py does).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))   # the judge: tests/numerics.py
sys.path.insert(0, str(ROOT / "scripts" / "probes"))


def row(name: str, r: dict) -> str:
    same = r["same"]
    rest = max((v[0], k) for k, v in same.items() if not k.startswith("conv2"))
    return (f"{name:<34} conv2.weight {same['conv2.weight'][0]:.2e} ({same['conv2.weight'][1]:.1e})  "
            f"conv2.bias {same['conv2.bias'][0]:.2e}  worst other {rest[1]} {rest[0]:.2e}  "
            f"decisions differ {r['windows']} {r['relu']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[8192, 65536])
    ap.add_argument("--shapes", nargs="+", default=["fused-bwd-v7-g2", "fused-bwd-v7-g4", "fused-bwd-v8-g2",
                                                     "fused-bwd-v8-g3", "fused-bwd-v8-g4"])
    ap.add_argument("--define", nargs="+", default=["none"],
                    help="one variant of the pinned runs per value: none, or macros NAME[=VALUE] joined by commas")
    ap.add_argument("--searches", nargs="*", default=["auto:heuristic", "auto:exhaustive"],
                    help="ENGINE:ALGO runs after the pinned ones")
    args = ap.parse_args()
    import numpy as np
    from numerics import measure
    from stage_kernels import variant_kernel

    from lenet.engines import Policy
    from lenet.kernels import stages
    from lenet.model import LeNet
    from lenet.params import init_host

    live = stages.table()   # the rows of the generation our kernels are compiled for
    table, orig = dict(live), stages.kernel
    for n in args.batch:
        rng = np.random.default_rng(n)   # the numerics test's batch
        x = rng.standard_normal((n, 1, 28, 28)).astype(np.float32)
        y = rng.integers(0, 10, n).astype(np.int32)
        state = init_host(n)
        for define, shape in itertools.product(args.define, args.shapes):
            live[("conv2", "backward")] = ((stages.INF, shape),)
            extra = tuple(f"-D{d}" for d in define.split(",") if define != "none")
            stages.kernel = functools.partial(variant_kernel, extra, {}) if extra else orig
            model = LeNet(max_batch=n, policy=Policy(engine="ours"), seed=0)
            print(f"n={n:<6} " + row(f"{shape} {define}", measure(model, state, x, y)), flush=True)
            model.close()
        stages.kernel = orig
        live.clear()
        live.update(table)
        for search in args.searches:
            engine, algo = search.split(":")
            model = LeNet(max_batch=n, policy=Policy.parse(algo, engine=engine), seed=0)
            r = measure(model, state, x, y)
            chose = [f"{d.get('layer')}/{d.get('op')}={d.get('engine')}:{d.get('algo')}" for d in model.describe(n)
                     if str(d.get("layer", "")).startswith("conv2")]
            print(f"n={n:<6} " + row(search, r) + "  chose " + " ".join(chose), flush=True)
            model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
