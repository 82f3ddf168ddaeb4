"""lenet sweep: many LeNet trainings at once, packed K to a step on one GPU (lenet/pack.py).

    lenet sweep --lr 0.05 0.1 0.2 --label-smoothing 0 0.1 --seeds 0-15 --validation 10000 --out runs/sweep
    lenet sweep --search optuna --trials 64 --lr 0.02:0.5 --weight-decay 0:2e-3 --storage runs/study.log

A grid is every combination of the values given (each training flag of `lenet train` takes a list here;
the defaults are the README's fast Fashion-MNIST recipe), packed into as few packs as the batch sizes and
epoch counts allow. ``--search optuna`` lets an Optuna study choose the configurations instead
(lenet/study.py): its storage (--storage) may be shared by one worker per GPU, on any machine.

Note [the ranked split]: every model is evaluated after each epoch on the split it is ranked by, and that
split is what Optuna's objective and pruner see. A sweep of more than one model holds out a validation
split by default (the last sixth of the training images, 10,000 of Fashion-MNIST's 60,000; ``--validation
N`` the last N; the pixel statistics are the remaining training images'), so the test split is read once,
at the end, by the winner alone (with ``--test-every-model`` by every finished model too, once each,
reported apart, never ranked on). The test split is ranked on only when told (``--rank-on-test``), and
every line that names a best then says so; a sweep of one model holds nothing out.

Under --out: results.csv and results.jsonl (one row per model: its configuration, accuracy per epoch,
final accuracy, seconds), curves.png (every curve, the best drawn out), best/checkpoint.npz and
best/model.safetensors (the winner, readable by `lenet predict` and `lenet export`), summary.json, and
sweep.json (the sweep's settings, which --resume checks).

Note [stopping a sweep]: the first SIGINT or SIGTERM stops after the step in flight. A grid then writes
the pack in flight (its models' weights, momentum, averages, histories and the step it stopped at) to
pack.npz; `--resume` skips every model results.jsonl holds and continues that pack at that step, so the
resumed sweep ends as an uninterrupted one would have. An Optuna worker marks its running trials failed
and asks the study to run them again (their configurations enqueued): completed trials are the study's.
"""

from __future__ import annotations

if __name__ == "__main__":   # python -m lenet.sweep: the GPU's start-up threads begin before the imports below
    from lenet import plot, startup

    startup.begin(then=plot.start_early)

import dataclasses
import itertools
import json
import math
import signal
import time
import zipfile
from pathlib import Path

import numpy as np

from . import cli, data, files, startup
from .pack import MAX_PACK, Config, packs
from .schedule import SCHEDULES
from .sweep_results import RESUME_KEYS, SWEPT, Sweep, config_error, older_grid
from .train import Signals, StoppedAtOnce, resume_args, start_plotter

FAST = Config()   # the defaults: the README's fast recipe
OUT_FILES = ("results.csv", "results.jsonl", "curves.png", "summary.json", "sweep.json", "pack.npz", "best")


# ---------------------------------------------------------------------- values of the flags

def on_off(text: str) -> bool:
    t = text.strip().lower()
    if t in ("on", "yes", "true", "1"):
        return True
    if t in ("off", "no", "false", "0"):
        return False
    import argparse

    raise argparse.ArgumentTypeError(f"invalid value {text!r}: use on or off")


def ema_value(text: str):
    """A decay in (0, 1), a range of two (--search optuna), or off."""
    import argparse

    if text.strip().lower() in ("off", "none", "no"):
        return None
    try:
        return ranged(cli.open_unit_interval)(text)
    except argparse.ArgumentTypeError as e:
        if ":" in text:   # a range's own words
            raise
        raise argparse.ArgumentTypeError(f"{e}, or off") from None


# Every list a flag expands is bounded before it is built: a seed range of a hundred million took 4.7 GB
# and a MemoryError; a grid is counted before its combinations are made.
MAX_SEEDS = 10000      # seeds of one --seeds value
MAX_GRID = 100000      # configurations of one grid


def seeds(text: str) -> list[int]:
    """'0-15', '3', '0-3,8,10-11' -> the seeds; a range must not run backwards; at most MAX_SEEDS of them,
    counted before any is listed."""
    import argparse

    parts, count = [], 0
    for part in text.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid seeds {text!r}: use integers >= 0 and ranges A-B, e.g. "
                                             f"0-15 or 0-3,8") from None
        if a < 0 or b < a:
            raise argparse.ArgumentTypeError(f"invalid seed range {part!r}: from A to B needs 0 <= A <= B")
        if b > 2**32 - 1:
            raise argparse.ArgumentTypeError(f"invalid seed range {part!r}: seeds go up to {2**32 - 1}")
        count += b - a + 1
        if count > MAX_SEEDS:
            raise argparse.ArgumentTypeError(f"invalid seeds {text!r}: {count:,} seeds or more; a sweep takes at "
                                             f"most {MAX_SEEDS:,} (one model each)")
        parts.append((a, b))
    return [s for a, b in parts for s in range(a, b + 1)]


def ranged(kind):
    """A flag's value: one value of ``kind``, or (for --search optuna) a range LOW:HIGH of two."""
    import argparse

    def parse(text: str):
        if ":" in text:
            lo, _, hi = text.partition(":")
            if ":" in hi:
                raise argparse.ArgumentTypeError(f"invalid range {text!r}: a range is LOW:HIGH, two values")
            try:
                a, b = kind(lo), kind(hi)
            except argparse.ArgumentTypeError as e:
                why = str(e).split(": ", 1)[-1]
                raise argparse.ArgumentTypeError(f"invalid range {text!r}: LOW:HIGH, each {why}") from None
            if not (isinstance(a, (int, float)) and isinstance(b, (int, float)) and a < b):
                raise argparse.ArgumentTypeError(f"invalid range {text!r}: LOW:HIGH with LOW < HIGH")
            return (a, b)
        return kind(text)
    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


# The swept flags: dest -> (parse one value, help). Each takes one or more values.
FLAG_TYPES = {
    "lr": (ranged(cli.nonneg_float), "learning rates"),
    "momentum": (ranged(cli.unit_interval), "momenta, in [0, 1)"),
    "nesterov": (on_off, "Nesterov momentum: on, off"),
    "weight_decay": (ranged(cli.nonneg_float), "weight decays"),
    "label_smoothing": (ranged(cli.unit_interval), "label smoothings, in [0, 1)"),
    "schedule": (str, f"learning-rate schedules: {', '.join(SCHEDULES)}"),
    "warmup_epochs": (ranged(cli.nonneg_float), "warm-up epochs"),
    "ema": (ema_value, "moving averages of the weights: a decay in (0, 1), or off (a range for --search optuna)"),
    "shift": (ranged(cli.nonneg_int), "augmentation shifts in pixels, 0..13"),
    "flip": (on_off, "left-right mirror augmentation: on, off"),
    "cutout": (ranged(cli.nonneg_int), f"cutout augmentation: a square's side in pixels, 0..{data.CUTOUT_MAX}"),
    "batch_size": (cli.batch_size, "batch sizes (one pack per batch size and epoch count)"),
    "epochs": (cli.positive_int, "epoch counts"),
}


SWITCHES = [d for d, (kind, _) in FLAG_TYPES.items() if kind is on_off]   # lenet train's switches: bare is on


class _Parser(cli.Parser):
    """--algo's default follows --deterministic (its help says how)."""

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        for dest in SWITCHES:   # a bare --flip or --nesterov, as lenet train takes it: on
            if getattr(ns, dest, None) == []:
                setattr(ns, dest, [True])
        if getattr(ns, "algo", "") is None:   # small packs take the heuristic once the GPU is known: main()
            ns.algo, ns.algo_default = ("heuristic" if ns.deterministic else "exhaustive"), True
        return ns, rest


def parser() -> cli.Parser:
    p = _Parser(prog=cli.prog("sweep"), allow_abbrev=False,   # --gpus is taken out of a worker's flags by name
                   description="Train many LeNet-5 configurations at once, K models in one step on one GPU: a grid "
                               "of the values given, or an Optuna study (--search optuna). Each training flag takes "
                               "one or more values; the defaults are the README's fast Fashion-MNIST recipe.")
    p.add_argument("--data-dir", metavar="DIR", help="folder with the four IDX files (default: $LENET_DATA, "
                   "./data/<name>, /usr/share/datasets/fashion-mnist)")
    p.add_argument("--validation", type=cli.nonneg_int, default=None, metavar="N",
                   help="hold out the last N training images: rank the models on them, and evaluate only the "
                        "winner on the test split, once (default: a sixth of the training images, 10,000 of "
                        "Fashion-MNIST's 60,000, for a sweep of more than one model; none for one)")
    p.add_argument("--rank-on-test", action="store_true",
                   help="hold nothing out: rank the models on the test split, as every line that names a best "
                        "then says (its accuracy is then no estimate for unseen images)")
    p.add_argument("--test-every-model", action="store_true",
                   help="also evaluate every finished model on the test split, once, at its end: reported apart "
                        "(test_accuracy in its row), never ranked on")
    cli.add_split_flags(p)
    _grid_flags(p)
    _search_flags(p)
    _output_flags(p)
    return p


def _grid_flags(p) -> None:
    g = p.add_argument_group("the grid (every flag takes one or more values; ranges LOW:HIGH for --search optuna)")
    for dest, (kind, what) in FLAG_TYPES.items():
        default = getattr(FAST, dest)
        shown = "off" if default is None else ("on" if default is True else "off" if default is False else default)
        g.add_argument("--" + dest.replace("_", "-"), dest=dest, type=kind, nargs="*" if dest in SWITCHES else "+",
                       default=[default], metavar="V",
                       help=f"{what}{'; alone, on' if dest in SWITCHES else ''} (default: {shown})")
    g.add_argument("--seeds", type=seeds, nargs="+", default=[[0]], metavar="SPEC",
                   help="seeds of the init and data order: integers and ranges, e.g. 0-15 or 0-3,8 (default: 0)")
    g.add_argument("--tta", action=__import__("argparse").BooleanOptionalAction, default=True,
                   help="score each evaluated image on the mean of its logits and its mirror's (default: on, "
                        "as the fast recipe)")


def _search_flags(p) -> None:
    """The search, the engines and the speed flags, and the workers (--gpus)."""
    from .engines import FLAGS, Policy

    s = p.add_argument_group("search")
    s.add_argument("--search", choices=("grid", "optuna"), default="grid",
                   help="grid: every combination; optuna: an Optuna study picks --trials configurations from the "
                        "values and ranges given, pruning the worst after each epoch (needs the extra: pip "
                        "install '.[sweep]') (default: grid)")
    s.add_argument("--trials", type=cli.positive_int, default=None, metavar="N",
                   help="--search optuna: trials in the whole study, over every worker")
    s.add_argument("--storage", metavar="URL", default=None,
                   help="--search optuna: the study's storage, shared by every worker: a database URL "
                        "(sqlite:///study.db, postgresql://...) or a journal file path (default: in memory, one "
                        "worker)")
    s.add_argument("--study", default="lenet-sweep", metavar="NAME", help="the study's name (default: lenet-sweep)")
    s.add_argument("--sampler", choices=("tpe", "random", "grid"), default="tpe",
                   help="--search optuna: how trials are chosen: tpe (Optuna's default), random, or grid (every "
                        "combination of the values given once, over every worker; no ranges) (default: tpe)")
    s.add_argument("--no-prune", dest="prune", action="store_false",
                   help="--search optuna: let every trial run all its epochs (default: prune with Optuna's "
                        "median pruner)")
    s.add_argument("--pack-size", type=cli.positive_int, default=None, metavar="K",
                   help=f"models trained together in one step (default: as many as the grid has, up to {MAX_PACK})")
    cli.add_algorithm_flags(p, FLAGS, Policy.parse, None,
                            "exhaustive, a pack's plan searched once and kept in the plan cache; where every pack "
                            "holds at most 4 images per SM, heuristic, so that each model chooses and sums as its "
                            "lone `lenet train` run does; with --deterministic, heuristic, so that timing decides "
                            "nothing and each model is its lone `lenet train --deterministic` run, bit for bit")
    cli.add_speed_flags(p)
    s.add_argument("--gpus", type=_gpus, default=None, metavar="all|I,J",
                   help="--search optuna: one worker per GPU (all, or indices such as 0,2) over one study, its "
                        "storage a journal file under --out unless --storage names one; the workers' results "
                        "merged under --out (default: this process alone, on GPU 0)")


def _output_flags(p) -> None:
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="DIR", help="write the results, curves, the best model and its export here "
                                              "(default: none: print the table only)")
    o.add_argument("--resume", action="store_true", help="continue the sweep in --out where it stopped")
    o.add_argument("--overwrite", action="store_true", help="replace an earlier sweep in --out")
    o.add_argument("--quiet", action="store_true", help="plain log lines, no progress bar")


def grid(args) -> list[Config]:
    """Every combination of the swept flags' values (seeds innermost), each configuration once; one-line
    ValueErrors for an empty grid, a range outside --search optuna, or a configuration that cannot train."""
    values = {d: list(dict.fromkeys(getattr(args, d))) for d in FLAG_TYPES}
    values["seed"] = list(dict.fromkeys(s for spec in args.seeds for s in spec))
    for d, vs in values.items():
        if not vs:
            raise ValueError(f"--{d.replace('_', '-')} has no values: the grid is empty")
        ranges = [v for v in vs if isinstance(v, tuple)]
        if ranges and args.search != "optuna":
            raise ValueError(f"--{d.replace('_', '-')} {ranges[0][0]:g}:{ranges[0][1]:g} is a range; ranges are for "
                             f"--search optuna, a grid takes values")
    if args.search == "optuna":
        return []
    bad = [s for s in values["schedule"] if s not in SCHEDULES]
    if bad:
        raise ValueError(f"--schedule {files.show(bad[0])}: use one of {', '.join(SCHEDULES)}")
    size = math.prod(len(values[d]) for d in SWEPT)   # counted before any is made
    if size > MAX_GRID:
        raise ValueError(f"the grid has {size:,} combinations of the values given; a sweep trains at most "
                         f"{MAX_GRID:,} (give fewer values, or --search optuna --trials N)")
    out = []
    for combo in itertools.product(*(values[d] for d in SWEPT)):
        kw = dict(zip(SWEPT, combo))
        if kw["nesterov"] and kw["momentum"] == 0:
            continue   # Nesterov needs momentum: the combination does not exist
        try:
            out.append(Config(**kw))
        except ValueError as e:   # named as the flags say it
            raise ValueError(config_error(e)) from None
    if not out:
        raise ValueError("the grid is empty: every combination has --nesterov on with --momentum 0")
    return out


def check_flags(args) -> None:
    """The flags' own checks, before anything is read."""
    if args.search == "optuna":
        if args.trials is None:
            raise ValueError("--search optuna needs --trials N, the trials of the whole study")
        if args.pack_size == 1:
            raise ValueError("--search optuna needs --pack-size >= 2: a pruned trial's slot takes the next trial")
    else:
        for flag, v in (("--trials", args.trials), ("--storage", args.storage)):
            if v is not None:
                raise ValueError(f"{flag} is for --search optuna; a grid runs every combination once")
    if args.out == "":
        raise files.OutputError("--out is empty: give a folder, or leave --out out to write nothing")
    if args.out is None and (args.resume or args.overwrite):
        raise ValueError(f"{'--resume' if args.resume else '--overwrite'} needs --out DIR")
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the sweep in --out and --overwrite replaces it: give one")
    if args.rank_on_test and args.validation:
        raise ValueError(f"--rank-on-test ranks on the test split and --validation {args.validation} on held-out "
                         f"training images: give one")
    if args.rank_on_test and args.test_every_model:
        raise ValueError("--test-every-model is for a validation split: with --rank-on-test every model is "
                         "evaluated on the test split already")


class GridSweep(Sweep):
    """Every configuration of the grid, pack after pack (Note [stopping a sweep])."""

    def __init__(self, args, run, policy, plotter, configs: list[Config]):
        super().__init__(args, run, policy, plotter)
        done = {json.dumps(r["config"], sort_keys=True) for r in self.rows}
        self.todo = [c for c in configs if json.dumps(c.as_dict(), sort_keys=True) not in done]
        self.packs = packs(self.todo, args.pack_size or MAX_PACK)

    def run(self) -> int:
        if not self.packs:
            self.say(f"nothing to do: every one of the grid's models is in {files.show(self.out / 'results.jsonl')}"
                     if self.rows else "nothing to do")
            return self.finish(self.policy)
        steps = sum(math.ceil(self.run_info["train_size"] / min(p[0].batch_size, self.run_info["train_size"]))
                    * p[0].epochs for p in self.packs)
        self.say(f"{len(self.todo)} models in {len(self.packs)} pack{'s' * (len(self.packs) > 1)} "
                 f"({', '.join(str(len(p)) for p in self.packs)}), ranked on the {self.split} split"
                 + (f"; {len(self.rows)} done before" if self.rows else ""))
        self.progress(steps)
        with Signals() as sig:
            try:
                for i, configs in enumerate(self.packs):
                    code = self.one_pack(configs, sig, resume=self.run_info.get("pack_state") if i == 0 else None)
                    if code is not None:
                        return code
            except StoppedAtOnce as e:
                self.close_bar()
                print(f"stopped at once by a second {Signals.NAMES.get(e.signum, e.signum)}; the models finished "
                      f"are in results.jsonl", flush=True)
                return 128 + e.signum
        self.close_bar()
        return self.finish(self.policy)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def one_pack(self, configs: list[Config], sig, resume=None) -> int | None:
        from .pack import Pack

        t_start = time.perf_counter()
        pack = Pack(configs, *self.datasets(), policy=self.policy, plan_cache=self.args.plan_cache,
                    eval_batch=self.args.eval_batch_size, tta=self.args.tta, cuda_graph=self.args.cuda_graph)
        first = 0
        if resume is not None and resume["configs"] != [c.as_dict() for c in configs]:
            self.say("pack.npz holds another pack than the next one to run: it is left aside, and the pack runs "
                     "from its start")
            resume = None
        if resume is not None:
            first = self.restore(pack, resume)
        stop = (lambda: sig.signum is not None)
        while pack.active:
            t = time.perf_counter()
            orders = pack.begin_epoch()
            if first:
                pack.model.reset_running_loss(resume["running"])
            at = pack.steps_of(orders, first, stop)
            if self.bar is not None:
                self.bar.update(at - first)
            first = 0
            if at < pack.steps:
                return self.stopped(pack, at, sig)
            for r in pack.end_epoch(time.perf_counter() - t):
                self.record(r, self.trial_counter)
                self.trial_counter += 1
                pack.release(r.slot)
            if self.bar is not None:
                self.bar.set_postfix_str(self.best_line(), refresh=False)
        if self.out is not None:
            (self.out / "pack.npz").unlink(missing_ok=True)
        self.say(f"pack of {len(configs)} models: {time.perf_counter() - t_start:.2f} s; {self.best_line()}")
        pack.close()
        return None

    def stopped(self, pack, at: int, sig) -> int:
        """Note [stopping a sweep]: the pack in flight to pack.npz; the exit status."""
        self.close_bar()
        m = pack.model
        if self.out is not None:
            params, velocity, ema = m.flat_state()   # after the step in flight
            ema = params if ema is None else ema
            state = {"configs": [r.config.as_dict() for r in pack.results],
                     "history": [{"accuracy": r.accuracy, "loss": r.loss, "train_loss": r.train_loss,
                                  "seconds": r.seconds} for r in pack.results],
                     "done": [r.done for r in pack.results], "step": at,
                     "running": m.running_loss.get(stream=pack.stream).tolist()}
            files.save_npz(self.out / "pack.npz", {"params": params, "velocity": velocity, "ema": ema,
                                                  "state": np.array(json.dumps(state))})
            where = f"pack.npz holds the pack in flight (step {at} of its epoch)"
        else:
            where = "no --out, nothing was saved"
        print(f"stopped by {sig.name}: {len(self.rows)} models finished; {where}"
              + (f"; continue with: {cli.prog('sweep')} {' '.join(resume_args(None))} --resume" if self.out else ""),
              flush=True)
        return 130 if sig.signum == signal.SIGINT else 143

    def restore(self, pack, state: dict) -> int:
        pack.model.load_flat(state["params"], state["velocity"], state["ema"])
        for r, h in zip(pack.results, state["history"]):
            r.accuracy, r.loss, r.train_loss, r.seconds = h["accuracy"], h["loss"], h["train_loss"], h["seconds"]
        self.say(f"resumed the pack in flight at epoch {len(pack.results[0].accuracy) + 1}, step {state['step']}")
        return int(state["step"])


# ---------------------------------------------------------------------- before the GPU

def settings_of(args, fingerprint: str | None, train_size: int, test_size: int) -> dict:
    return {"grid": {d: [v if not isinstance(v, tuple) else list(v) for v in getattr(args, d)] for d in FLAG_TYPES}
            | {"seed": sorted({s for spec in args.seeds for s in spec})},
            "search": args.search, "trials": args.trials, "validation": args.validation, "train_size": train_size,
            "test_size": test_size, "data_fingerprint": fingerprint, "tta": args.tta, "pack_size": args.pack_size,
            "eval_batch_size": args.eval_batch_size, "study": args.study, "sampler": args.sampler,
            "prune": args.prune}


def prepare(args) -> dict:
    """Every check that needs no GPU: the flags, the grid, the dataset, --out and --resume. One-line
    errors (exit 2), nothing written."""
    check_flags(args)
    configs = grid(args)
    if args.search == "optuna":
        from . import study

        study.check(args)   # the extra installed, the storage opens, the space is one
    root, (train_x, train_y), (test_x, test_y), cache, pending = cli.run_splits(args)
    args.validation = validation_size(args, len(train_x), len(configs) if args.search != "optuna" else args.trials)
    if args.validation:
        if args.validation >= len(train_x):
            raise ValueError(f"--validation {args.validation} leaves no training image: the training split has "
                             f"{len(train_x)}; hold out fewer")
        evals = (train_x[-args.validation:], train_y[-args.validation:])
        train_x, train_y = train_x[: -args.validation], train_y[: -args.validation]
    else:
        evals = (test_x, test_y)
    mean, std = data.pixel_stats(train_x)
    if pending:
        files.write_later(data.commit, pending, cache)
    fingerprint = data.fingerprint(root, cache)
    settings = settings_of(args, fingerprint, len(train_x), len(test_x))
    out = Path(args.out) if args.out else None
    done_rows, pack_state = _check_out(out, args, settings)
    if args.search == "optuna":   # read, not made: a study made with other flags is refused before the GPU
        from .study import check_study

        check_study(args, settings)
    return {"study": None, "root": root, "dataset": data.dataset_name(root), "fingerprint": fingerprint, "train": (train_x, train_y),
            "evals": evals, "test": (test_x, test_y), "mean": mean, "std": std, "train_size": len(train_x),
            "out": out, "configs": configs, "settings": settings, "done_rows": done_rows, "pack_state": pack_state}


VALIDATION_SHARE = 6   # the default validation split: the last sixth of the training images


def validation_size(args, train_size: int, models: int) -> int:
    """The training images held out to rank on (Note [the ranked split]): --validation N; else, for a sweep
    of more than one model, the last sixth; 0 (the test split) for one model or with --rank-on-test. A
    sweep of several models ranks on the test split only when told so (--rank-on-test)."""
    if args.rank_on_test:
        return 0
    if args.validation is not None:
        if args.validation == 0 and models > 1:
            raise ValueError("--validation 0 ranks the models on the test split: say so with --rank-on-test, or "
                             "hold out N > 0 training images")
        return args.validation
    if models <= 1:
        return 0
    held = train_size // VALIDATION_SHARE
    if held < 1:
        raise ValueError(f"the training split has {train_size} images, too few to hold out a sixth to rank "
                         f"{models} models on: give --validation N, or rank on the test split with --rank-on-test")
    return held


def _check_out(out: Path | None, args, settings: dict):
    """--out a folder this sweep may write; with --resume, the earlier sweep's rows and pack in flight, each
    file checked whole before any of it is used."""
    if out is None:
        return [], None
    files.check_output_dir(out, "--out")
    files.check_files_in(out, [n + "/" if n == "best" else n for n in OUT_FILES], "--out")
    earlier = [n for n in OUT_FILES if files.what_is(out / n)[0] != "missing"]
    if args.resume:
        made = out / "sweep.json"
        if files.what_is(made)[0] == "missing":
            raise ValueError(f"--resume: {files.show(out)} holds no sweep (no sweep.json); start one without --resume")
        before = older_grid(_settings_file(made, settings))
        diff = [k for k in RESUME_KEYS if before.get(k) != settings.get(k)]
        if diff:
            k, theirs, ours = diff[0], before.get(diff[0]), settings.get(diff[0])
            if k == "grid" and isinstance(theirs, dict):   # the axis that differs, as a flag
                d = next(d for d in list(ours) + list(theirs) if theirs.get(d) != ours.get(d))
                k, theirs, ours = ("--seeds" if d == "seed" else "--" + d.replace("_", "-")), theirs.get(d), ours.get(d)
            raise ValueError(f"--resume: the sweep in {files.show(out)} was made with {k}="
                             f"{_short(theirs)}, this one has {_short(ours)}; resume with the same flags")
        rows = _rows_file(out / "results.jsonl") if files.what_is(out / "results.jsonl")[0] != "missing" else []
        state = _pack_file(out / "pack.npz") if files.what_is(out / "pack.npz")[0] != "missing" else None
        return rows, state
    if earlier and not args.overwrite:
        raise files.OutputError(f"--out {files.show(out)} holds an earlier sweep ({', '.join(earlier)}); continue it "
                                f"with --resume, write to a new folder, or replace it with --overwrite")
    return [], None


def _short(v) -> str:
    r = files.escaped(repr(v))
    return r if len(r) <= 80 else r[:77] + "..."


def _settings_file(path: Path, settings: dict) -> dict:
    """sweep.json: an object holding every setting --resume compares, each of the type this sweep's has."""
    bad = ValueError(f"--resume: {files.show(path)} is not a sweep's settings file (an object of "
                     f"{', '.join(RESUME_KEYS)})")
    try:
        before = files.json_of(files.read_input(path, "--resume", "sweep's settings file", limit=64 << 20).decode())
    except files.InputError:
        raise
    except ValueError:   # not UTF-8, not JSON
        raise bad from None
    if not isinstance(before, dict) or any(k not in before for k in RESUME_KEYS):
        raise bad
    for k in RESUME_KEYS:
        mine, theirs = settings.get(k), before[k]
        if theirs is not None and mine is not None and type(theirs) is not type(mine) \
                and not (isinstance(mine, float) and type(theirs) is int):
            raise bad
    return before


_STATUSES = ("complete", "pruned", "diverged")


def _row_problem(row) -> str | None:
    """Why a line of results.jsonl is not a model's row (lenet.sweep_results.row_of), or None."""
    from .pack import config_from

    def numbers(v):
        return isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
    if not isinstance(row, dict):
        return "not an object"
    if row.get("status") not in _STATUSES:
        return f"status {_short(row.get('status'))} is none of {', '.join(_STATUSES)}"
    if not (row.get("trial") is None or (isinstance(row.get("trial"), int) and not isinstance(row["trial"], bool))):
        return "no trial number"
    if not (numbers(row.get("accuracy")) and numbers(row.get("loss")) and isinstance(row.get("final"), (int, float))
            and not isinstance(row.get("final"), bool)):
        return "no accuracies, losses and final accuracy"
    if not isinstance(row.get("config"), dict):
        return "no configuration"
    try:
        config_from(row["config"])
    except (ValueError, TypeError) as e:
        return f"its configuration is not one ({files.escaped(str(e))})"
    return None


def _rows_file(path: Path) -> list[dict]:
    """results.jsonl's rows, each checked; a last line without its end (cut by a kill) is left out: that model
    runs again."""
    from .pack import config_from

    raw = files.read_input(path, "--resume", "results file", limit=1 << 30)
    lines = raw.split(b"\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = files.json_of(line.decode())
        except ValueError:
            if i == len(lines) - 1:   # unfinished: a line cut by a kill
                continue
            row = None
        why = "not JSON" if row is None else _row_problem(row)
        if why:
            raise ValueError(f"--resume: {files.show(path)} line {i + 1} is not a model's row ({why}); remove that "
                             f"line to run its model again")
        row["config"] = config_from(row["config"]).as_dict()   # a row written before a setting existed: its default
        rows.append(row)
    return rows


def _pack_file(path: Path) -> dict:
    """pack.npz: the pack in flight, checked whole: its configurations, histories, flags, step and running
    losses, one per model, and its arrays of that many models' finite numbers."""
    from . import params as P
    from .pack import config_from

    bad = f"--resume: {files.show(path)} is not the state of a pack in flight"
    fix = "remove it to run that pack again from its start"
    try:
        with files.open_input(path, "--resume", "pack state") as f, np.load(f, allow_pickle=False) as z:
            files.check_npz(z, bad, {k: 8 * P.TOTAL * MAX_PACK * 64 for k in ("params", "velocity", "ema")}
                            | {"state": 256 << 20}, ValueError)
            arrays = {k: z[k] for k in ("params", "velocity", "ema")}
            state = files.json_of(str(z["state"]))
    except files.InputError:
        raise
    except (OSError, KeyError, ValueError, TypeError, EOFError, AttributeError, zipfile.BadZipFile):
        raise ValueError(f"{bad}; {fix}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{bad} (its state is not an object); {fix}")
    configs, history, done = state.get("configs"), state.get("history"), state.get("done")
    step, running = state.get("step"), state.get("running")
    k = len(configs) if isinstance(configs, list) else 0
    if not (k and isinstance(history, list) and isinstance(done, list) and isinstance(running, list)
            and len(history) == len(done) == len(running) == k):
        raise ValueError(f"{bad} (its configurations, histories, flags and running losses are not one per model); "
                         f"{fix}")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        raise ValueError(f"{bad} (no step count); {fix}")
    try:
        for c in configs:
            config_from(c)
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"{bad} (a configuration is not one); {fix}") from None
    keys = ("accuracy", "loss", "train_loss", "seconds")
    if not all(isinstance(h, dict) and all(x in h for x in keys) for h in history) \
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in running):
        raise ValueError(f"{bad} (a history or running loss is not one); {fix}")
    for name, a in arrays.items():
        if a.dtype.kind != "f" or a.shape != (k * P.TOTAL,) or not np.all(np.isfinite(a)):
            raise ValueError(f"{bad} (its {name} are not {k * P.TOTAL} finite numbers, {P.TOTAL} for each of its "
                             f"{k} model{'s' * (k > 1)}); {fix}")
    return arrays | state


def open_out(out: Path | None, overwrite: bool, settings: dict, resume: bool) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        import shutil

        for name in OUT_FILES:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
    if not resume:
        files.write_atomic(out / "sweep.json", (json.dumps(settings, indent=1) + "\n").encode())


def _gpus(text: str) -> str:
    import argparse

    from .workers import parse_gpus

    try:
        return parse_gpus(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None) -> int:
    import sys

    args = parser().parse_args(argv)
    from .engines import Policy

    policy = cli.policy_from(args, Policy)
    if args.gpus is not None:   # one worker per GPU: lenet/workers.py
        from . import workers

        workers.require_study(args)
        check_flags(args)
        grid(args)
        from . import study

        study.check(args)
        root = cli.run_splits(args)[0]   # the dataset, checked here once (each worker reads it again)
        return workers.run(args, list(sys.argv[1:] if argv is None else argv), start_plotter(args), root)
    from .checks import check_pack

    check_pack(policy, 2)   # an engine for every operation of a pack, before anything is read
    plotter = start_plotter(args)
    with startup.starting(args.engine, (max(args.batch_size), args.eval_batch_size), pack=True):   # evaluations' too
        run = prepare(args)
    from descriptors import require_gpu

    gpu = require_gpu()
    if args.search == "optuna":   # made (or loaded) once the GPU is there too (Note [a storage checked, then made])
        from .study import open_study

        run["study"] = open_study(args, run["settings"])
    check_pack_memory(args, run, policy)   # may set the packs' size: before the policy that depends on it
    policy = default_algo(args, run, policy)
    print(f"GPU {gpu} | dataset {run['dataset']} ({run['train_size']} train, {len(run['evals'][0])} "
          f"{'validation' if args.validation else 'test'}) | policy {policy}", flush=True)
    open_out(run["out"], args.overwrite, run["settings"], args.resume)
    if args.search == "optuna":
        from .study import StudySweep

        return StudySweep(args, run, policy, plotter).run()
    return GridSweep(args, run, policy, plotter, run["configs"]).run()


def pack_shapes(args, run) -> list[tuple[int, int]]:
    """(models, images per model) of every pack the sweep will train (a study's packs: its pack size at
    each batch size it may draw)."""
    if run["configs"]:
        return [(len(p), p[0].batch_size) for p in packs(run["configs"], args.pack_size or MAX_PACK)]
    return [(max(min(args.trials, args.pack_size or MAX_PACK), 2), b) for b in args.batch_size]


def default_algo(args, run, policy):
    """--algo's default once the GPU is known: the heuristic where every pack sums as its lone runs
    (sums_as_lone in lenet/engines/base.py: at most 4 images per SM), so that each model chooses and sums
    as its lone `lenet train` run does (Note [a pack and a lone run] in lenet/pack.py); else a search."""
    from .engines.base import sums_as_lone

    if not getattr(args, "algo_default", False) or policy.deterministic:
        return policy
    if all(sums_as_lone(k, n, policy) for k, n in pack_shapes(args, run)):
        return dataclasses.replace(policy, fwd="heuristic", bwd_data="heuristic", bwd_filter="heuristic")
    return policy


def check_pack_memory(args, run, policy) -> None:
    """More models in a pack than the GPU holds: without --pack-size, packs of as many as fit (a line says so);
    with it, one line naming how many fit, before any allocation."""
    from descriptors.algorithms import free_memory

    from .checks import check_memory, models_that_fit

    sizes = [k for k, _ in pack_shapes(args, run)]
    batch = max(max(args.batch_size), min(args.eval_batch_size, len(run["evals"][0])))
    free, total = free_memory()
    fit = models_that_fit(batch, free, policy)
    if args.pack_size is None and 2 <= fit < max(sizes):
        args.pack_size = fit
        print(f"packs of at most {fit} models: what fits the GPU's {free / (1 << 30):.1f} GB free at {batch:,} images "
              f"a model (--pack-size K sets it)", flush=True)
        sizes = [k for k, _ in pack_shapes(args, run)]
    check_memory(batch, free, total, policy, max(sizes))


def run() -> None:
    cli.run(main, cli.prog("sweep"))


if __name__ == "__main__":
    run()
