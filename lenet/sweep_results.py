"""What a sweep records and writes (lenet sweep, lenet/sweep.py; its Optuna worker, lenet/study.py): one row
per model, the ranking, the winner (its weights, its test accuracy with a validation split, its checkpoint and
export), results.csv, summary.json and the curves. The test split is read here alone, by evaluate_on_test
(Note [the ranked split] in lenet/sweep.py)."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from pathlib import Path

import numpy as np

from . import checkpoint as ckpt
from . import data, files, startup
from .pack import Config, Result, config_from

SWEPT = ("lr", "momentum", "nesterov", "weight_decay", "label_smoothing", "schedule", "warmup_epochs", "ema",
         "shift", "flip", "cutout", "batch_size", "epochs", "seed")
# Swept axes added after sweeps and studies were made, each with the values an older one trained at: its
# stored grid is read with these filled in, so --resume and a study's workers continue it (older_grid).
GRID_BEFORE = {"cutout": [0]}


def older_grid(settings):
    """A stored sweep's or study's settings with the axes it was made before (GRID_BEFORE) filled in."""
    if isinstance(settings, dict) and isinstance(settings.get("grid"), dict):
        return {**settings, "grid": {**GRID_BEFORE, **settings["grid"]}}
    return settings


RESUME_KEYS = ("grid", "search", "trials", "validation", "train_size", "test_size", "data_fingerprint", "tta",
               "pack_size", "eval_batch_size", "study", "sampler", "prune")


def config_error(e: ValueError) -> str:
    """A configuration's error (lenet.pack.Config names its settings) as the flags of `lenet sweep` say it."""
    import re

    text = str(e)
    name = text.split(" ", 1)[0].rstrip(":")
    if name in SWEPT:
        text = ("--seeds" if name == "seed" else "--" + name.replace("_", "-")) + text[len(name):]
    return re.sub(r"\((\d+) epochs\)", r"(--epochs \1)", text).replace("nesterov needs a momentum > 0",
                                                                      "--nesterov on needs --momentum > 0")


def row_of(r: Result, trial, split: str) -> dict:
    status = "pruned" if r.pruned else ("complete" if all(map(math.isfinite, r.loss)) else "diverged")
    return {"trial": trial, "status": status, "config": r.config.as_dict(),
            "split": split, "accuracy": r.accuracy, "loss": r.loss, "train_loss": r.train_loss,
            "final": r.final, "epochs_run": len(r.accuracy), "seconds": round(r.seconds, 4)}


def write_csv(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["trial", "status", *SWEPT, "final", "epochs_run", "seconds", "accuracy_per_epoch", "test_accuracy"])
    for r in rows:
        c = r["config"]
        test = r.get("test_accuracy")
        w.writerow([r["trial"], r["status"], *("off" if c[k] is None else c[k] for k in SWEPT),
                    f"{r['final']:.6f}", r["epochs_run"], r["seconds"],
                    " ".join(f"{a:.4f}" for a in r["accuracy"]), "" if test is None else f"{test:.6f}"])
    files.write_atomic(path, buf.getvalue().encode())


def best_of(rows: list[dict]) -> dict | None:
    """The winner: the highest final accuracy on the ranked split of a complete run; ties go to the lower
    final loss. A row's test_accuracy (--test-every-model) is never read here."""
    done = [r for r in rows if r["status"] == "complete"]
    return max(done, key=lambda r: (r["final"], -(r.get("loss") or [0])[-1])) if done else None


def recipes(rows: list[dict]) -> list[dict]:
    """The configurations but their seed, each with its seeds' final accuracies and their mean, best mean first
    (a recipe is chosen on its mean over seeds, not on its luckiest seed); diverged or pruned runs count as 0."""
    groups: dict = {}
    for r in rows:
        key = json.dumps({k: v for k, v in r["config"].items() if k != "seed"}, sort_keys=True)
        g = groups.setdefault(key, {"config": {**r["config"], "seed": None}, "seeds": [], "finals": []})
        g["seeds"].append(r["config"]["seed"])
        g["finals"].append(r["final"] if r["status"] == "complete" else 0.0)
    out = [{**g, "mean": sum(g["finals"]) / len(g["finals"])} for g in groups.values()]
    return sorted(out, key=lambda g: -g["mean"])


def label_of(c: dict, seed: bool = True) -> str:
    """The settings of configuration ``c`` that differ from the fast recipe's (and its seed)."""
    base = Config()
    parts = [f"{k}={'off' if c[k] is None else c[k]}" for k in SWEPT
             if (k == "seed" and seed) or (k != "seed" and c[k] != getattr(base, k))]
    return " ".join(parts)


class Sweep:
    """One `lenet sweep` on one GPU: the data, the packs in turn (grid) or the study's trials (optuna),
    and what it writes."""

    def __init__(self, args, run: dict, policy, plotter):
        self.args, self.run_info, self.policy, self.plotter = args, run, policy, plotter
        self.out: Path | None = run["out"]
        self.split = "validation" if args.validation else "test"
        self.rows: list[dict] = list(run["done_rows"])
        self.trial_counter = max([r["trial"] for r in self.rows if isinstance(r["trial"], int)], default=-1) + 1
        self.best_weights = None   # (row, Result) of the best complete model of this process
        self._tester = None        # (model, test split on the GPU): evaluate_on_test's, made on first use
        self.bar = None
        self._data = None   # datasets(): made on first use

    def say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    # -- data

    def datasets(self):
        """(training split, ranked split) on the GPU, sent once for every pack of this sweep."""
        if self._data is None:
            import cupy

            stream = cupy.cuda.Stream(non_blocking=True)
            cfg = self.run_info
            self._data = tuple(data.GpuDataset(*split, cfg["mean"], cfg["std"], stream)
                               for split in (cfg["train"], cfg["evals"]))
        return self._data

    # -- a finished model

    def record(self, r: Result, trial) -> dict:
        row = row_of(r, trial, self.split)
        if self.args.test_every_model and self.args.validation and r.weights is not None \
                and row["status"] == "complete":   # reported apart, never ranked on (best_of)
            row["test_accuracy"], row["test_loss"] = self.evaluate_on_test(r.weights, self.policy)
        self.rows.append(row)
        if self.out is not None:
            files.append_line(self.out / "results.jsonl", json.dumps(row))
        if row["status"] == "complete":
            best = best_of(self.rows)
            if best is row:
                self.best_weights = (row, r)
                if self.out is not None:   # now, not at the end: a sweep stopped later keeps its winner
                    self.save_best(row, r)
        return row

    def save_best(self, row: dict, r: Result) -> None:
        """best/checkpoint.npz (what `lenet predict`, `lenet export` and --resume read) and its export."""
        out = self.out / "best"
        out.mkdir(exist_ok=True)
        cfg = r.config
        config = {"dataset": self.run_info["dataset"], "data_fingerprint": self.run_info["fingerprint"],
                  "train_size": self.run_info["train_size"], "mean": self.run_info["mean"],
                  "std": self.run_info["std"], **cfg.as_dict(), "tta": self.args.tta, "engine": self.args.engine}
        meta = {"epoch": len(r.accuracy), "step": 0, "iteration": 0, "running_loss": 0.0, "config": config,
                "history": [{"epoch": e + 1, f"{self.split}_accuracy": a} for e, a in enumerate(r.accuracy)],
                "sweep_row": row["trial"]}
        ckpt.save(out / "checkpoint.npz", r.params, r.velocity, meta, r.weights if cfg.ema is not None else None)
        from . import export
        from .params import unpack

        try:
            export.save(unpack(r.weights), out / "model.safetensors")
        except ValueError:   # no safetensors: NumPy's format
            export.save(unpack(r.weights), out / "model.npz")

    def progress(self, total_steps: int):
        if self.args.quiet:
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        self.bar = tqdm(total=total_steps, desc="sweep", unit="step", dynamic_ncols=True, file=sys.stderr)
        return self.bar

    def best_line(self) -> str:
        b = best_of(self.rows)
        return f"best {100 * b['final']:.2f}% on the {self.split} split ({label_of(b['config'])})" if b else "best -"

    # -- ending

    def finish(self, model_policy) -> int:
        """The table, the winner on the test split (with --validation), the files."""
        rows = sorted(self.rows, key=lambda r: -r["final"] if r["status"] == "complete" else 1.0)
        if not rows:
            self.say("no model finished")
            return 0
        best = best_of(self.rows)
        count = {k: sum(r["status"] == k for r in self.rows) for k in ("pruned", "diverged")}
        self.say(f"{len(self.rows)} models ({count['pruned']} pruned, {count['diverged']} diverged), ranked on the "
                 f"{self.split} split ({'the last %d training images, held out' % self.args.validation if self.args.validation else 'test'}):")
        tested = any("test_accuracy" in r for r in rows)
        for r in rows[:10]:
            apart = (f"  (test {100 * r['test_accuracy']:.2f}%, not ranked on)" if "test_accuracy" in r else
                     "  (test -)") if tested else ""
            self.say(f"  {100 * r['final']:6.2f}%  {r['status']:<8}  {label_of(r['config'])}{apart}")
        if len(rows) > 10:
            self.say(f"  ... {len(rows) - 10} more (results.csv)")
        summary = {"models": len(self.rows), "split": self.split, "best": best, "seconds": round(
            startup.process_seconds(), 3)}
        ranked = recipes(self.rows)
        if any(len(g["seeds"]) > 1 for g in ranked):
            self.say(f"configurations by their mean over seeds on the {self.split} split:")
            for g in ranked[:5]:
                self.say(f"  {100 * g['mean']:6.2f}%  ({' / '.join(f'{100 * f:.2f}' for f in g['finals'])}, seeds "
                         f"{' '.join(map(str, g['seeds']))})  {label_of(g['config'], seed=False) or 'the fast recipe'}")
            top = ranked[0]
            summary["best_recipe"] = top
            flags = config_from({**top["config"], "seed": 0}).train_flags(self.args.tta)
            summary["recipe_command"] = "lenet train " + " ".join(f for f in flags if not f.startswith("--seed"))
            self.say(f"the best recipe (mean {100 * top['mean']:.2f}% on the {self.split} split): "
                     f"{summary['recipe_command']}")
        if best is not None:
            cfg = config_from(best["config"])
            summary["train_command"] = "lenet train " + " ".join(cfg.train_flags(self.args.tta))
            test = self.evaluate_winner(best, model_policy)
            if test is not None:
                summary["test_accuracy"], summary["test_loss"] = test
                how = "read once by each model, ranked on by none" if tested else "seen now, once, by it alone"
                self.say(f"the winner on the test split ({how}): {100 * test[0]:.2f}%")
            elif self.args.rank_on_test:
                self.say(f"the winner was ranked on the test split (--rank-on-test): its "
                         f"{100 * best['final']:.2f}% is no estimate for unseen images")
            self.say(f"the winner alone: {summary['train_command']}")
        self.close_tester()
        if self.out is not None:
            self.write_outputs(summary, best)
        self.say(f"wall clock {startup.process_seconds():.2f} s from process start")
        return 0

    def evaluate_winner(self, best: dict, policy):
        """With a validation split: the winner's weights on the test split, once (its row's, where
        --test-every-model evaluated it already). None when there is no validation split or the winner's
        weights are not in this process (a resumed sweep's winner finished before: its checkpoint holds them)."""
        if not self.args.validation:
            return None
        if "test_accuracy" in best:
            return best["test_accuracy"], best["test_loss"]
        weights = self.winner_weights(best)
        if weights is None:
            return None
        return self.evaluate_on_test(weights[0], policy)

    def evaluate_on_test(self, weights: np.ndarray, policy) -> tuple[float, float]:
        """(accuracy, loss) of the flat ``weights`` on the test split: the one place a sweep reads it (Note
        [the ranked split] in lenet/sweep.py). One model for it, made on first use, closed by finish()."""
        if self._tester is None:
            from .model import LeNet

            test_x, test_y = self.run_info["test"]
            model = LeNet(max_batch=min(self.args.eval_batch_size, len(test_x)), policy=policy, cuda_graph=True)
            split = data.GpuDataset(test_x, test_y, self.run_info["mean"], self.run_info["std"], model.stream)
            self._tester = (model, split)
        model, split = self._tester
        model.load_flat(weights, np.zeros_like(weights))
        loss, acc = model.evaluate(split, batch=self.args.eval_batch_size, tta=self.args.tta)
        return float(acc), float(loss)

    def close_tester(self) -> None:
        if self._tester is not None:
            self._tester[0].close()
            self._tester = None

    def winner_weights(self, best: dict):
        if self.best_weights is not None and self.best_weights[0] is best:
            r = self.best_weights[1]
            return r.weights, r.params, r.velocity
        if self.out is not None and (self.out / "best" / "checkpoint.npz").exists():
            params, velocity, meta = ckpt.load(self.out / "best" / "checkpoint.npz")
            if meta.get("sweep_row") == best.get("trial"):
                return ckpt.weights(params, meta)[0], params, velocity
        return None

    def write_outputs(self, summary: dict, best: dict | None) -> None:
        """results.csv, summary.json and curves.png (the winner's checkpoint is written as it finishes)."""
        out = self.out
        write_csv(out / "results.csv", self.rows)
        files.write_atomic(out / "summary.json", (json.dumps(summary, indent=1, default=float) + "\n").encode())
        if self.plotter is not None:
            curves = [{"label": label_of(r["config"]), "accuracy": r["accuracy"], "best": r is best} for r in self.rows]
            self.plotter.path = out / "curves.png"
            self.plotter.draw_sweep(curves, self.split)
            err = self.plotter.close()
            if err:
                self.say(f"curves.png not drawn: {err}")
