"""The whole step's numerics against float64, judged per decision: every pooling and ReLU decision of one
training step of ours against a float64 recomputation's (PyTorch, float64, same parameters and batch);
every gradient of the images whose decisions all agree, and each decision that differs with its margin;
beside them the distances at the step's own decisions and at float64's, and PyTorch's float32 step's.

    python3 scripts/numerics.py       # batch 1 64 8192 65536, Fashion-MNIST and standard normals, every engine
    python3 scripts/numerics.py --batch 20000 --engine legacy --algo heuristic exhaustive --json n.json

The judge and its Notes ([judging per decision], [step numerics]) are in tests/numerics.py, which the GPU
tests share.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))   # before this folder: the judge's module is tests/numerics.py

from numerics import MARGIN, MIN_AGREE, RTOL_AGREE, RTOL_L2, judge, measure  # noqa: E402


def fashion_batch(n: int, seed: int):
    """n images of Fashion-MNIST's training split (a seeded draw, with replacement above 60,000), normalized
    as the programs normalize them, and their labels; None where the dataset is not found."""
    from lenet import data

    root = data.find_dataset(None)
    if root is None:
        return None
    images, labels = data.load_split(root, "train", None, [])
    mean, std = data.pixel_stats(images)
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(images))[:n] if n <= len(images) else rng.integers(0, len(images), n)
    x = ((images[idx].astype(np.float32) / 255.0 - mean) / std).reshape(n, 1, 28, 28).astype(np.float32)
    return x, labels[idx].astype(np.int32)


def describe(model, n: int) -> str:
    rows = model.describe(n)
    conv = [r for r in rows if r.get("layer") in ("conv1", "conv2")]
    head = next((r for r in rows if r.get("layer") == "fc1+fc2"), {})
    return ", ".join(f"{r['layer']} {r['op'].split('+')[0]} {r['engine']}:{r['algo']}" for r in conv) + \
        f", head {head.get('engine')}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 8192, 65536])
    ap.add_argument("--engine", nargs="+", default=["auto", "ours", "legacy", "graph"])
    ap.add_argument("--algo", nargs="+", default=["heuristic"])
    ap.add_argument("--data", nargs="+", default=["fashion", "random"], choices=["fashion", "random"],
                    help="Fashion-MNIST's training images (found as the programs find them) and/or standard normals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args()
    import torch

    from lenet.engines import Policy
    from lenet.model import LeNet
    from lenet.params import init_host

    print(f"GPU {torch.cuda.get_device_name()} | float32 step against float64, judged per decision (Note [judging "
          f"per decision]): the images whose decisions all agree within {RTOL_AGREE:g} in relative L2; each decision "
          f"that differs within {MARGIN:g} of its layer's scale of a tie; beside them, every gradient at the step's "
          f"own decisions (bar {RTOL_L2:g}) and at float64's, and PyTorch float32 at float64's")
    print(f"{'batch':>6} | {'data':<7} | {'engine':<6} | {'algo':<10} | {'images agreeing':>17} | "
          f"{'agreeing: rel L2 (tensor)':<30} | decisions that differ: margin / scale | {'own decisions':>13} | "
          f"{'f64 decisions':>13} | {'torch f32':>9}")
    results, failed = [], 0
    for n in args.batch:
        for kind in args.data:
            rng = np.random.default_rng(args.seed)
            batch = fashion_batch(n, args.seed) if kind == "fashion" else None
            if kind == "fashion" and batch is None:
                print(f"{n:>6} | fashion | Fashion-MNIST not found: skipped")
                continue
            x, y = batch or (rng.standard_normal((n, 1, 28, 28)).astype(np.float32),
                             rng.integers(0, 10, n).astype(np.int32))
            state = init_host(args.seed)
            for engine in args.engine:
                for algo in args.algo:
                    model = LeNet(max_batch=n, policy=Policy.parse(algo, engine=engine), seed=args.seed)
                    j = judge(model, state, x, y)
                    r = measure(model, state, x, y)
                    r.update(j, batch=n, data=kind, engine=engine, algo=algo, plan=describe(model, n))
                    model.close()
                    del model
                    results.append(r)
                    failed += not r["ok"]
                    worst = max(r["agree"], key=lambda k: r["agree"][k][0]) if r["agree"] else None
                    agree = f"{r['agree'][worst][0]:.2e} ({worst})" if worst else "-"
                    differ = ", ".join(f"{k} {w} {m:.1e}" for k, w, m in r["decisions"][:4]) or "none"
                    if len(r["decisions"]) > 4:
                        differ += f" (+{len(r['decisions']) - 4}, the widest {r['worst_margin']:.1e})"
                    own = max(v[0] for v in r["same"].values())
                    f64 = max(v[0] for v in r["ours"].values())
                    tf = max(v[0] for v in r["torch"].values())
                    print(f"{n:>6} | {kind:<7} | {engine:<6} | {algo:<10} | {r['kept']:>7} of {n:<7} | {agree:<30} | "
                          f"{differ}{'' if r['ok'] else '  FAILS'} | {own:13.2e} | {f64:13.2e} | {tf:9.2e}", flush=True)
                    if not r["ok"]:
                        print(f"{'':>6}   fails: {r['why']}")
                    print(f"{'':>6}   plan: {r['plan']}")
    print(f"{len(results) - failed} of {len(results)} configurations with at least {MIN_AGREE:.0%} of the images "
          f"agreeing, within {RTOL_AGREE:g} on them, every differing decision within {MARGIN:g} of a tie")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
