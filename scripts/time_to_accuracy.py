"""Seconds to accuracy: run recipes of python -m lenet.train (and the PyTorch reference trainer,
scripts/torch_train.py, on the same flags) for several seeds, and print one table row per
recipe: test accuracy per seed and the wall clock from command start to its final line.

    python3 scripts/time_to_accuracy.py --data-dir data/fashion-mnist --seeds 0 1 2 --torch \\
        --recipe recommended --recipe fast [--recipe 'name=--epochs 5 --lr 0.1'] [--json out.json]

The wall clock is measured around the whole command (interpreter start to exit), as a user
waits for it. Our runs write under --out (checkpoint, metrics, plot), as a user's would.

--validation N chooses recipes without the test split: the runs train on the first 60000 - N
training images and report their accuracy on the last N (a folder of IDX files written for it),
so a recipe is picked on those numbers and then run once on the test split as it is.

--record PATH writes the rows into a results file the README's time-to-accuracy table is rendered from
(docs/results/time_to_accuracy.json; scripts/readme_tables.py), each with the date, the GPU, cuDNN's
version and the commit:

    python3 scripts/time_to_accuracy.py --recipe fast --warm --torch --record docs/results/time_to_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import readme_tables

ROOT = Path(__file__).resolve().parents[1]

# The recipes the README reports. Fashion-MNIST, batch sizes and epochs fixed in advance, chosen
# with --validation 10000 (seeds 0, 1, 2 on 50000 training images, accuracy on the 10000 held
# out; docs/performance.md, "Recipes", has the sweeps), then run on the test split as they are.
# recommended: the best validation mean of `lenet sweep` (bash scripts/sweep_targets.sh recipe4: recipe3's winner
# at 500 and 800 epochs, EMA 0.999 and 0.9995, seeds 0-2, --validation 10000); recipe3's winner (500 epochs) is
# "shorter", recipe2's (100 epochs, no shift) "previous", and the one before it (60 epochs, batch 64) "earlier";
# fast: 16 epochs (the fewest whose validation accuracy was >= 91.2 on every seed), its learning rate and
# label smoothing the best 16-seed validation mean of their neighbours (bash scripts/sweep_targets.sh robust), at
# batch 150, which divides the 60,000 training images: no epoch ends in a smaller batch, whose plan a first run
# would search (BATCHES="120 125 128 150 160" bash scripts/sweep_targets.sh faster, then lone runs of seeds 0-7;
# docs/performance.md, "Recipes").
RECIPES = {
    "plain": "--epochs 30 --schedule cosine --lr 0.02",
    "recommended": "--epochs 800 --batch-size 32 --schedule cosine --lr 0.05 --nesterov --label-smoothing 0.1 "
                   "--warmup-epochs 1 --flip --shift 1 --tta --ema 0.999 --weight-decay 5e-4",
    "shorter": "--epochs 500 --batch-size 32 --schedule cosine --lr 0.05 --nesterov --label-smoothing 0.1 "
               "--warmup-epochs 1 --flip --shift 1 --tta --ema 0.999 --weight-decay 5e-4",
    "previous": "--epochs 100 --batch-size 32 --schedule cosine --lr 0.05 --nesterov --label-smoothing 0.1 "
                "--warmup-epochs 1 --flip --tta --ema 0.999 --weight-decay 5e-4",
    "earlier": "--epochs 60 --batch-size 64 --schedule cosine --lr 0.05 --nesterov --label-smoothing 0.1 "
                "--warmup-epochs 1 --flip --tta --ema 0.999 --weight-decay 1e-3",
    "fast": "--epochs 16 --batch-size 150 --schedule cosine --lr 0.15 --nesterov --label-smoothing 0.05 "
            "--warmup-epochs 1 --flip --tta",
}


def parse_recipe(text: str) -> tuple[str, str]:
    if text in RECIPES:
        return text, RECIPES[text]
    name, eq, flags = text.partition("=")
    if eq and name and not name.startswith("-"):
        return name, flags
    raise SystemExit(f"--recipe {text!r}: one of {', '.join(RECIPES)} or NAME='FLAGS'")


def run(cmd: list[str], env: dict, timeout: float) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return time.perf_counter() - t0, p.stdout + p.stderr, p.returncode


def final_accuracy(out: str) -> float | None:
    m = re.findall(r"final \| test accuracy ([\d.]+)%", out)
    return float(m[-1]) if m else None


def validation_folder(data_dir: str, n: int, where: Path) -> Path:
    """A dataset folder whose 'test' split is the last n training images of data_dir, and whose
    training split is the rest."""
    sys.path.insert(0, str(ROOT))
    from lenet import data

    root = data.find_dataset(data_dir)
    if root is None:
        raise SystemExit(data.not_found_message(data_dir))
    x, y = data.load_split(root, "train")
    if not 0 < n < len(x):
        raise SystemExit(f"--validation {n}: hold out 1..{len(x) - 1} of the {len(x)} training images")
    out = where / f"{data.dataset_name(root)}-validation-{n}"
    out.mkdir()
    for (img, lab), (xs, ys) in zip(data.SPLITS.values(), ((x[:-n], y[:-n]), (x[-n:], y[-n:]))):
        (out / img).write_bytes(data.idx_bytes(np.ascontiguousarray(xs)))
        (out / lab).write_bytes(data.idx_bytes(np.ascontiguousarray(ys)))
    return out


TRAINERS = {"ours": "ours", "torch": "PyTorch, CUDA graph", "torch eager": "PyTorch, eager"}


def run_kind(cold: bool, warm: bool) -> str:
    return "first (every cache empty)" if cold else "later (caches warm)" if warm else "as the caches were"


def gpu_facts(env: dict) -> dict:
    """The GPU's name and cuDNN's version, asked of a process of their own (this one never touches the GPU)."""
    code = ("import cupy, descriptors; print(cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()); "
            "print(descriptors.version_string())")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or len(lines) != 2:
        raise SystemExit(f"--record: could not ask for the GPU's name and cuDNN's version: {p.stderr.strip()[-300:]}")
    return {"gpu": lines[0], "cudnn": lines[1]}


def record_rows(rows: list[dict], run: str, facts: dict, command: str, seeds: list[int]) -> list[dict]:
    """The README's time-to-accuracy rows (scripts/readme_tables.py) of this run's table rows."""
    return [{"recipe": r["recipe"], "trainer": TRAINERS[r["who"]], "run": run, "seeds": list(seeds),
             "accuracy": r["accuracy"], "wall_s": [round(w, 2) for w in r["wall_s"]], **facts,
             **readme_tables.provenance(command)} for r in rows]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default="data/fashion-mnist")
    ap.add_argument("--recipe", action="append", default=[], help="a name from RECIPES or NAME='FLAGS'")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--torch", action="store_true",
                    help="also run scripts/torch_train.py --cuda-graph (PyTorch's fastest loop) on each recipe")
    ap.add_argument("--torch-only", action="store_true", help="run scripts/torch_train.py --cuda-graph only")
    ap.add_argument("--torch-eager", action="store_true", help="also run scripts/torch_train.py as a plain loop")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--warm", action="store_true",
                    help="run each recipe once per trainer, untimed, first: the timed runs find the plan cache and "
                         "the bytecode cache warm, as a user's second run does")
    ap.add_argument("--cold", action="store_true",
                    help="run each timed run as a first run on a fresh machine: every cache it reads (CuPy's kernel "
                         "cache, $XDG_CACHE_HOME with our kernels, plans, datasets and bytecode, CUDA's $CUDA_CACHE_PATH) "
                         "an empty folder of its own")
    ap.add_argument("--validation", type=int, metavar="N",
                    help="report accuracy on the last N training images, trained on the rest (choose recipes on "
                         "this, not on the test split)")
    ap.add_argument("--json")
    ap.add_argument("--record", metavar="PATH",
                    help="also write the rows, with the date, GPU, cuDNN and commit, into this results file (the "
                         "README's table: docs/results/time_to_accuracy.json, then python3 scripts/readme_tables.py), "
                         "replacing the rows of the same recipe, trainer and run")
    args = ap.parse_args(argv)
    if args.record and args.validation:
        raise SystemExit("--record: the README's table is test accuracy; --validation runs are not recorded")
    if args.record and Path(args.record).exists():
        try:   # a results file it cannot add to: refused before the runs
            readme_tables.load(Path(args.record), "time_to_accuracy")
        except readme_tables.ResultsError as e:
            raise SystemExit(f"--record: {e}") from None
    recipes = [parse_recipe(r) for r in (args.recipe or list(RECIPES))]
    if args.validation:
        held = tempfile.TemporaryDirectory()
        args.data_dir = str(validation_folder(args.data_dir, args.validation, Path(held.name)))
        print(f"validation: training on all but the last {args.validation} training images, accuracy on those "
              f"({args.data_dir})", flush=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows = []
    for name, flags in recipes:
        whos = ["torch"] if args.torch_only else ["ours", "torch"] if args.torch else ["ours"]
        whos += ["torch eager"] if args.torch_eager else []

        def command(who: str, tmp: str, seed: int) -> list[str]:
            base = ["--data-dir", args.data_dir, "--seed", str(seed), *shlex.split(flags)]
            if who == "ours":
                return [sys.executable, "-m", "lenet.train", "--quiet", "--out", tmp, *base]
            return [sys.executable, str(ROOT / "scripts" / "torch_train.py"), *base,
                    *(["--cuda-graph"] if who == "torch" else [])]

        for who in whos if args.warm else []:
            with tempfile.TemporaryDirectory() as tmp:
                run(command(who, tmp, args.seeds[0]) + ["--epochs", "1"], env, args.timeout)
        for who in whos:
            accs, walls, lines = [], [], []
            for seed in args.seeds:
                with tempfile.TemporaryDirectory() as tmp:
                    run_env = env
                    if args.cold:   # a first run on a fresh machine (scripts/probes/train_timeline.py --cold)
                        run_env = {k: v for k, v in env.items() if not k.startswith("LENET_")}
                        run_env.update(CUPY_CACHE_DIR=f"{tmp}/cache/cupy", XDG_CACHE_HOME=f"{tmp}/cache/xdg",
                                       CUDA_CACHE_PATH=f"{tmp}/cache/nv")
                    wall, out, rc = run(command(who, f"{tmp}/out", seed), run_env, args.timeout)
                if rc != 0:
                    print(f"{name} {who} seed {seed}: exit {rc}\n{out[-2000:]}", flush=True)
                    accs.append(None)
                    walls.append(wall)
                    continue
                acc = final_accuracy(out)
                accs.append(acc)
                walls.append(wall)
                breakdown = re.findall(r"^wall clock .*$", out, re.M)
                reached = re.findall(r"^target accuracy .* reached at (epoch \d+) .*?, ([\d.]+ s) after", out, re.M)
                lines.append((breakdown[-1] if breakdown else "")
                             + (f" | target reached at {reached[-1][0]}, {reached[-1][1]} from start" if reached else ""))
                print(f"{name} {who} seed {seed}: {acc}% in {wall:.2f} s | {lines[-1]}", flush=True)
            ok = [a for a in accs if a is not None]
            rows.append({"recipe": name, "flags": flags, "who": who, "accuracy": accs, "wall_s": walls,
                         "mean_accuracy": sum(ok) / len(ok) if ok else None, "breakdown": lines})
    print()
    split = f"validation ({args.validation} held-out training images)" if args.validation else "test"
    print(f"| recipe | trainer | {split} accuracy per seed (%) | mean | min | wall clock per seed (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ok = [a for a in r["accuracy"] if a is not None]
        accs = ", ".join("failed" if a is None else f"{a:.2f}" for a in r["accuracy"])
        walls = ", ".join(f"{w:.2f}" for w in r["wall_s"])
        mean = f"{r['mean_accuracy']:.2f}" if ok else "-"
        print(f"| {r['recipe']} | {r['who']} | {accs} | {mean} | {min(ok):.2f} | {walls} |" if ok else
              f"| {r['recipe']} | {r['who']} | {accs} | - | - | {walls} |")
    for name, flags in recipes:
        print(f"{name}: {flags}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.record:
        command = shlex.join(["python3", "scripts/time_to_accuracy.py", *(sys.argv[1:] if argv is None else argv)])
        readme_tables.record(Path(args.record), "time_to_accuracy",
                             record_rows(rows, run_kind(args.cold, args.warm), gpu_facts(env), command, args.seeds))
        print(f"recorded {len(rows)} rows in {args.record}: python3 scripts/readme_tables.py renders the README's table")


if __name__ == "__main__":
    main()
