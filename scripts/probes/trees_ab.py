"""Two checkouts' python -m lenet.train on one machine, in turn: the wall clock from process start to its
exit (as scripts/time_to_accuracy.py measures it) and the program's own split, so that a change to the
start-up or the end of a run is judged on one machine (machines differ by more than most changes: the
fast recipe's start-up took 0.60-0.70 s on one H100 machine and 0.77-0.91 s on another).

    python3 scripts/probes/trees_ab.py --trees OLD_CHECKOUT . [--rounds 6] [-- TRAIN FLAGS]

Without train flags: the fast recipe of scripts/time_to_accuracy.py, with --out (a folder per run) and
--data-dir $LENET_DATA. One untimed run of each tree first (their bytecode, plan and dataset caches
warm, as a user's second run finds them); seeds 0, 1, 2 in turn.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs=2, required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("train_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    from time_to_accuracy import RECIPES

    flags = [a for a in args.train_args if a != "--"] or RECIPES["fast"].split()
    if "--data-dir" not in flags and os.environ.get("LENET_DATA"):
        flags += ["--data-dir", os.environ["LENET_DATA"]]
    trees = [str(Path(t).resolve()) for t in args.trees]
    out = Path(tempfile.mkdtemp(prefix="trees-ab-"))
    rows = {t: [] for t in trees}
    for r in range(-1, args.rounds):
        for i, tree in enumerate(trees):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (tree, os.environ.get("PYTHONPATH")))))
            cmd = [sys.executable, "-m", "lenet.train", *flags, "--quiet", "--seed", str(max(r, 0) % 3),
                   "--out", str(out / f"{i}-{r}")]
            t = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
            wall = time.perf_counter() - t
            if p.returncode:
                raise SystemExit(f"{tree}: exit {p.returncode}: {p.stderr[-800:]}")
            if r >= 0:
                split = [ln for ln in p.stdout.splitlines() if ln.startswith("wall clock")]
                acc = [ln for ln in p.stdout.splitlines() if ln.startswith("final")]
                rows[tree].append((wall, (split or ["?"])[-1], (acc or ["?"])[-1]))
    for tree, got in rows.items():
        walls = [w for w, _, _ in got]
        print(f"{tree}\n  to exit, s: {' '.join(f'{w:.2f}' for w in walls)} (median {statistics.median(walls):.3f}, "
              f"min {min(walls):.2f}, max {max(walls):.2f})")
        for _, split, acc in got:
            print(f"    {split} | {acc}")


if __name__ == "__main__":
    main()
