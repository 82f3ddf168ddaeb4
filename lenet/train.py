"""python -m lenet.train: train LeNet-5 on a real IDX dataset and evaluate it every epoch.

The datasets go to the GPU once, as uint8; each batch is gathered and normalized
there from a per-epoch permutation that depends only on (seed, epoch), so the host
never waits inside the step loop and a resumed run sees the batches an
uninterrupted one would; augmentation (--shift, --flip) happens in the same gather kernel.
Evaluation replays a CUDA graph of the whole test split and waits once. Under --out:
metrics.jsonl, curves.png, checkpoint.npz (written atomically, off the loop's thread: after
every epoch, every --checkpoint-every steps, and when a signal stops the run, see Note
[background writes] in lenet/background.py; the plot every PLOT_SECONDS and at the end, by a
child process, see Note [plotting in a child] in lenet/plot.py).

Everything that needs no GPU is checked first: the flags, the dataset's files, --out,
--resume's checkpoint. Only then is the GPU used (its driver and context start on a thread
meanwhile: Note [overlapped start-up] in lenet/startup.py).

Note [stopping]: the first SIGINT or SIGTERM asks the loop to stop after the step in flight;
it then writes a checkpoint that records the position inside the epoch (epoch, step, the
epoch's running loss), prints one line saying where it stopped and how to resume, and exits
130 (SIGINT) or 143 (SIGTERM). A second signal stops at once: a checkpoint being written is
abandoned (its temporary file removed), so the last good checkpoint stays as it was.
--resume continues from the recorded step; with --deterministic, a run stopped at any step
and resumed ends bit-identical to an uninterrupted one.
"""

from __future__ import annotations

if __name__ == "__main__":   # python -m lenet.train: the GPU's start-up threads begin before the imports below
    from lenet import plot, startup   # (Notes [bytecode cache], [overlapped start-up] in lenet/startup.py)

    startup.begin(then=plot.start_early)

import json
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import checkpoint as ckpt
from . import cli, data, files, interrupt, startup
from .background import Background
from .plot import Plotter, can_plot, take_early
from .schedule import SCHEDULES, Schedule, batch_sizes

_NEW = object()   # a setting every checkpoint records


@dataclass(frozen=True)
class Setting:
    """A flag that is part of a run: stored in its checkpoint's configuration. ``resume``: must match
    for --resume to continue the run rather than start another; ``before``: its value in checkpoints
    written before the flag existed (what those runs trained with)."""

    resume: bool = True
    before: object = _NEW


# The one table of a run's settings (each a flag's dest): the stored configuration (config_of), the
# resume check (RESUME_KEYS) and the older checkpoints' defaults (RECIPE_OFF) derive from it, and a
# test holds the parser to it. The dataset is identified by its files' content (data.fingerprint), or
# by its folder's name for a checkpoint written before fingerprints were kept.
RUN_SETTINGS = {
    "batch_size": Setting(), "seed": Setting(), "lr": Setting(), "momentum": Setting(), "weight_decay": Setting(),
    "schedule": Setting(), "gamma": Setting(), "power": Setting(), "step_size": Setting(), "step_gamma": Setting(),
    "algo": Setting(), "workspace_limit": Setting(), "deterministic": Setting(), "allow_winograd": Setting(),
    "allow_tf32": Setting(), "engine": Setting(), "chunk": Setting(), "epochs": Setting(),
    "cuda_graph": Setting(resume=False), "fused": Setting(resume=False),
    "nesterov": Setting(before=False), "label_smoothing": Setting(before=0.0), "warmup_epochs": Setting(before=0.0),
    "ema": Setting(before=None), "shift": Setting(before=0), "flip": Setting(before=False), "tta": Setting(before=False),
    "cutout": Setting(before=0),
}
# Flags that are not part of a run (where it reads and writes, how it reports): never stored.
NOT_RUN_SETTINGS = ("data_dir", "train_size", "test_size", "eval_batch_size", "data_cache", "target_accuracy",
                    "plan_cache", "out", "resume", "overwrite", "checkpoint_every", "quiet", "help", "version")
RESUME_KEYS = ("dataset", "train_size", *(k for k, v in RUN_SETTINGS.items() if v.resume))
RECIPE_OFF = {k: v.before for k, v in RUN_SETTINGS.items() if v.before is not _NEW}
RUN_FILES = ("checkpoint.npz", "metrics.jsonl", "curves.png")
CHECKPOINT_EVERY = 10000   # steps: a few checkpoints an epoch at batch 1, none mid-epoch at 64 (938 steps)
PLOT_SECONDS = 30.0        # curves.png at most this often while training, and always at the end


class TrainingDiverged(RuntimeError):
    pass


class StoppedAtOnce(BaseException):
    """A second signal: leave now (see Note [stopping])."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Signals:
    """SIGINT and SIGTERM while training: the first is recorded for the loop to act on after the
    step in flight, the second raises StoppedAtOnce (see Note [stopping])."""

    NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}

    def __init__(self):
        self.signum = None
        self._old = {}

    def _handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            return
        raise StoppedAtOnce(signum)

    def __enter__(self):
        for s in self.NAMES:
            self._old[s] = signal.signal(s, self._handle)
        interrupt.hand_over(True)   # the first signal is ours; a second still ends the process (lenet/interrupt.py)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
        interrupt.hand_over(False)

    @property
    def name(self) -> str:
        return self.NAMES.get(self.signum, str(self.signum))


def parser() -> cli.Parser:
    p = cli.Parser(prog=cli.prog("train"),
                   description="Train LeNet-5 on an IDX dataset (MNIST, Fashion-MNIST, KMNIST, EMNIST) with SGD, "
                               "evaluating on the test split after every epoch.")
    p.add_argument("--data-dir", metavar="DIR", help="folder with the four IDX files (default: $LENET_DATA, "
                   "./data/<name>, /usr/share/datasets/fashion-mnist)")
    p.add_argument("--epochs", type=cli.positive_int, default=20, help="epochs to train (default: 20)")
    p.add_argument("--batch-size", type=cli.batch_size, default=64, metavar="N", help="(default: 64)")
    p.add_argument("--lr", type=cli.nonneg_float, default=0.01, help="base learning rate (default: 0.01)")
    p.add_argument("--momentum", type=cli.unit_interval, default=0.9, help="in [0, 1) (default: 0.9)")
    p.add_argument("--weight-decay", type=cli.nonneg_float, default=5e-4, help="(default: 5e-4)")
    p.add_argument("--schedule", choices=SCHEDULES, default="inv",
                   help="learning-rate schedule: constant, step, cosine, inv (Caffe's: lr*(1+gamma*it)^-power; "
                        "default: inv)")
    p.add_argument("--gamma", type=cli.nonneg_float, default=1e-4, help="inv schedule's gamma (default: 1e-4)")
    p.add_argument("--power", type=cli.nonneg_float, default=0.75, help="inv schedule's power (default: 0.75)")
    p.add_argument("--step-size", type=cli.positive_int, default=10, metavar="EPOCHS",
                   help="step schedule: epochs between decays (default: 10)")
    p.add_argument("--step-gamma", type=cli.nonneg_float, default=0.1, help="step schedule's factor (default: 0.1)")
    p.add_argument("--seed", type=cli.nonneg_int, default=0,
                   help="seed of the init and the batch order, an integer >= 0 (default: 0)")
    cli.add_split_flags(p)
    _recipe_flags(p.add_argument_group("recipe"))
    from .engines import FLAGS, Policy

    cli.add_algorithm_flags(p, FLAGS, Policy.parse)
    cli.add_speed_flags(p)
    _output_flags(p)
    return p


def _recipe_flags(r) -> None:
    """The recipe's pieces, each checked against PyTorch's own (tests/test_recipe_gpu.py)."""
    r.add_argument("--nesterov", action="store_true", help="Nesterov momentum (PyTorch's SGD(nesterov=True))")
    r.add_argument("--label-smoothing", type=cli.unit_interval, default=0.0, metavar="EPS",
                   help="smooth the targets: (1 - EPS) * one-hot + EPS / 10, as PyTorch's "
                        "cross_entropy(label_smoothing=EPS); the reported test loss stays plain (default: 0)")
    r.add_argument("--warmup-epochs", type=cli.nonneg_float, default=0.0, metavar="E",
                   help="ramp the learning rate linearly from lr/W to the schedule over the first E epochs "
                        "(W = their steps), in front of any schedule (default: 0)")
    r.add_argument("--ema", type=cli.open_unit_interval, default=None, metavar="DECAY",
                   help="keep an exponential moving average of the weights, ema += (1 - DECAY) * (w - ema) "
                        "after every step, and evaluate and export it (e.g. 0.999; default: off)")
    r.add_argument("--shift", type=cli.int_from_to(0, 13, " pixels"), default=0, metavar="K",
                   help="augment: translate each training image by up to K pixels each way, a zero border "
                        "filling in (0..13; default: 0)")
    r.add_argument("--flip", action="store_true",
                   help="augment: mirror half the training images left-right (right for clothes, wrong for "
                        "digits, so never guessed from the dataset)")
    r.add_argument("--cutout", type=cli.int_from_to(0, data.CUTOUT_MAX, " pixels"), default=0, metavar="K",
                   help="augment: clear a KxK square of each training image to the background, its centre "
                        "anywhere in the image (cutout; 0..28; default: 0)")
    r.add_argument("--tta", action="store_true",
                   help="test-time augmentation: score each test image on the mean of its logits and its "
                        "left-right mirror's (goes with --flip; python -m lenet.predict does the same for its "
                        "checkpoint)")
    r.add_argument("--target-accuracy", type=cli.accuracy, default=None, metavar="A",
                   help="stop after the first epoch whose test accuracy reaches A (0.91 or 91%%) and report the "
                        "wall clock from program start to there (default: off: every epoch runs)")


def _output_flags(p) -> None:
    """Where the run writes, and how it resumes."""
    p.add_argument("--out", metavar="DIR", help="write metrics.jsonl, curves.png and checkpoint.npz here (default: "
                                              "none: the run prints its progress and writes no file, so it "
                                              "cannot be resumed)")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="CHECKPOINT",
                   help="continue a run from its checkpoint, mid-epoch if it stopped there (default: "
                        "DIR/checkpoint.npz of --out)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in an --out folder that holds an earlier one, replacing its files")
    p.add_argument("--checkpoint-every", type=cli.nonneg_int, default=None, metavar="STEPS",
                   help=f"also write the checkpoint every STEPS steps inside an epoch; 0: at epoch ends only "
                        f"(default: {CHECKPOINT_EVERY})")
    p.add_argument("--quiet", action="store_true", help="plain log lines, no progress bar")


def config_of(args, root: Path, train_size: int, fingerprint: str | None = None) -> dict:
    """The run's stored configuration: every setting of RUN_SETTINGS, and what the data gives."""
    return {"dataset": data.dataset_name(root), "data_fingerprint": fingerprint, "data_dir": str(root),
            "train_size": train_size, **{k: getattr(args, k) for k in RUN_SETTINGS}}


class Progress:
    """tqdm when it is installed and wanted; plain lines otherwise."""

    def __init__(self, total: int, epoch: int, epochs: int, quiet: bool):
        self.bar = None
        self.desc = f"epoch {epoch}/{epochs}"
        if not quiet:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=self.desc, unit="img", unit_scale=True, leave=True,
                                dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                pass

    def update(self, images: int, loss: float, ips: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f} | {ips / 1e6:.2f} M img/s", refresh=False)
            self.bar.update(images)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _resume_path(args, out: Path | None) -> Path | None:
    if args.resume is None:
        return None
    if args.resume:
        return Path(args.resume)
    if out is None:
        raise ValueError("--resume needs a checkpoint path or --out DIR holding checkpoint.npz")
    return out / "checkpoint.npz"


def _check_flags(args) -> None:
    """The flags' own checks, before anything is read."""
    if args.out == "":
        raise files.OutputError("--out is empty: give a folder, or leave --out out to write nothing")
    if args.out is None:
        given = [f for f, v in (("--overwrite", args.overwrite), ("--checkpoint-every", args.checkpoint_every))
                 if v not in (None, False)]
        if given:
            raise ValueError(f"{' and '.join(given)} {'need' if len(given) > 1 else 'needs'} --out DIR: "
                             f"without it the run writes nothing")


def _check_out(out: Path | None, resume: Path | None, args) -> None:
    """--out must be a folder this run may write: no earlier run there unless it is the one resumed (or
    --overwrite replaces it)."""
    if out is None:
        return
    files.check_output_dir(out, "--out")
    files.check_files_in(out, RUN_FILES, "--out")
    earlier = [n for n in RUN_FILES if files.what_is(out / n)[0] != "missing"]
    if not earlier or args.overwrite:
        return
    if resume is None:
        raise files.OutputError(f"--out {files.show(out)} holds an earlier run ({', '.join(earlier)}); continue it "
                                f"with --resume, write to a new folder, or replace it with --overwrite")
    own = out / "checkpoint.npz"
    if not files.same_place(resume, own):
        raise files.OutputError(f"--out {files.show(out)} holds another run ({', '.join(earlier)}); resuming "
                                f"{files.show(resume)} there would write over it: resume into "
                                f"{files.show(resume.parent)}, pick a new --out, or replace it with --overwrite")


def prepare(args, beside=None) -> dict:
    """Every check that needs no GPU, in the order a user fixes them: the dataset, --out,
    --resume. Returns what the run needs; one-line errors (exit 2) otherwise. ``beside()``, where
    given, is called once the flags' own checks passed, before the data is read (build_beside)."""
    _check_flags(args)
    out = Path(args.out) if args.out else None
    resume = _resume_path(args, out)   # a flag error: before anything is read
    if args.nesterov and args.momentum == 0:
        raise ValueError("--nesterov needs --momentum > 0")
    if args.warmup_epochs > args.epochs:
        raise ValueError(f"--warmup-epochs {args.warmup_epochs:g} is longer than the run (--epochs {args.epochs}); "
                         f"give at most {args.epochs}")
    if beside is not None:
        beside()
    root, (train_x, train_y), (test_x, test_y), cache, pending = cli.run_splits(args)
    mean, std = data.pixel_stats(train_x)
    if pending:
        files.write_later(data.commit, pending, cache)   # Note [dataset cache] in lenet/data.py
    config = {**config_of(args, root, len(train_x), data.fingerprint(root, cache)), "mean": mean, "std": std}
    _check_out(out, resume, args)
    meta = params_flat = velocity_flat = None
    if resume is not None:
        params_flat, velocity_flat, meta = ckpt.load(resume, "--resume")
        ckpt.check_meta(resume, meta, resuming=True)
        made_fp = meta["config"].get("data_fingerprint")
        if made_fp and made_fp != config["data_fingerprint"]:
            raise ValueError(f"--resume {files.show(resume)} was trained on other data than {files.show(root)} (the "
                             f"dataset's files differ); resume with the dataset it was trained on")
        # More epochs may be asked for, except under cosine, whose curve depends on the total.
        diff = [k for k in RESUME_KEYS if (k != "epochs" or args.schedule == "cosine")
                and not (k == "dataset" and made_fp)   # the content decided, whatever the folder's name
                and meta["config"].get(k, RECIPE_OFF.get(k)) != config.get(k)]
        if diff:
            k = diff[0]
            made = meta["config"].get(k, RECIPE_OFF.get(k))
            raise ValueError(f"--resume {files.show(resume)} was made with {k}={made!r}, this run has "
                             f"{k}={config.get(k)!r}; resume with the same settings")
        config["mean"], config["std"] = meta["config"]["mean"], meta["config"]["std"]
    done = meta is not None and meta["epoch"] >= args.epochs and not meta.get("step")
    return {"root": root, "train": (train_x, train_y), "test": (test_x, test_y), "config": config, "out": out,
            "resume": resume, "meta": meta, "params": params_flat, "velocity": velocity_flat, "done": done}


class Outputs:
    """What a run writes under --out (RUN_FILES): the checkpoint and the metrics lines on the writer thread,
    the curves by the plotting child; the seconds spent writing go to ``clock["writing"]``. Without --out,
    nothing."""

    def __init__(self, out: Path | None, model, clock: dict):
        self.out, self.model, self.clock = out, model, clock
        self.written: set = set()
        self.checkpoint_path = out / "checkpoint.npz" if out else None
        self.plotter = self.writer = None
        self.last_plot = 0.0   # set when the loop begins

    def open(self, plotter: Plotter | None, overwrite: bool) -> None:
        """The output folder (emptied of an earlier run when ``overwrite``) and the writer thread; the
        plotting child, started with the program (``start_plotter``), draws into it from now on."""
        out = self.out
        if out:
            out.mkdir(parents=True, exist_ok=True)
            if overwrite:
                for name in RUN_FILES:
                    (out / name).unlink(missing_ok=True)
            self.plotter = plotter
            self.writer = Background()

    def checkpoint(self, m: dict, now: bool = False) -> None:
        """The checkpoint (``m``: where the run stands, its configuration), on the writer thread, or written
        before returning (``now``)."""
        if self.out is None:
            return
        t = time.perf_counter()
        params_flat, velocity_flat, ema_flat = self.model.flat_state()   # waits for the step in flight
        path = self.checkpoint_path
        job = (lambda: ckpt.save(path, params_flat, velocity_flat, m, ema_flat))
        if now:
            self.writer.wait()
            job()
        else:
            self.writer.submit("checkpoint", job)
        self.written.add("checkpoint.npz")
        self.clock["writing"] += time.perf_counter() - t

    def has_checkpoint(self) -> bool:
        """Whether a checkpoint stands under --out (this run's, once its writes are done, or one before it)."""
        if self.writer is not None:
            self.writer.wait()
        return bool("checkpoint.npz" in self.written or (self.out and (self.out / "checkpoint.npz").exists()))

    def metrics(self, rec: dict, history: list, epochs: int, last: bool) -> None:
        """An epoch's metrics line and (at most every PLOT_SECONDS, and last) the plot."""
        t = time.perf_counter()
        line, out = json.dumps(rec), self.out
        self.writer.submit(f"metrics {rec['epoch']}", lambda: files.append_line(out / "metrics.jsonl", line))
        self.written.add("metrics.jsonl")
        if self.plotter is not None:   # every epoch, written at most every PLOT_SECONDS and at the end
            write = last or time.perf_counter() - self.last_plot >= PLOT_SECONDS
            self.plotter.draw(history, epochs=epochs, write=write)
            if write:
                self.last_plot = time.perf_counter()
        self.clock["writing"] += time.perf_counter() - t

    def close(self) -> str | None:
        """Wait for the writes and the plots asked for; a note for the last line when curves.png was not written."""
        if self.writer is not None:
            t = time.perf_counter()
            self.writer.close()
            self.clock["writing"] += time.perf_counter() - t
        if self.plotter is None:
            return " (curves.png skipped: Pillow 10.1 or later is not installed)" if self.out else None
        t = time.perf_counter()
        err = self.plotter.close()
        self.clock["writing"] += time.perf_counter() - t
        if err is None and (self.out / "curves.png").exists():
            self.written.add("curves.png")
            return None
        return f" (curves.png not written: {err or 'no epoch finished'})"

    def stopped_at_once(self) -> str:
        """After a second signal: a write in flight finishes (atomic either way); where the last checkpoint is."""
        if self.writer is not None:
            self.writer.close(timeout=5.0)
        path = self.checkpoint_path
        return f"the last good checkpoint is {path}" if self.out and path.exists() else "no checkpoint was written"

    def wrote(self) -> str | None:
        """The files this run wrote, in RUN_FILES' order (None: none)."""
        return ", ".join(str(self.out / n) for n in RUN_FILES if n in self.written) if self.written else None


class Trainer:
    """One training run on the GPU, after prepare(): the model and the data on the GPU, the schedule,
    and what the run writes under --out (``Outputs``). ``run()`` trains epoch by epoch (``epoch``), evaluates
    after each (``evaluate``), writes the checkpoint (``save_checkpoint``), the metrics line and the plot
    (``record``), and ends with the report (``report``); each returns or raises what main turns into
    an exit status."""

    def __init__(self, args, run: dict, policy, argv):
        from .kernels import Augment

        self.args, self.argv, self.policy = args, argv, policy
        self.config, self.out, self.meta = run["config"], run["out"], run["meta"]
        B = self.B = args.batch_size
        shape = run_shape(args, len(run["train"][0]), len(run["test"][0]))
        made = startup.built(early_key(args, shape))   # Note [the model beside the data]: this run's, or None
        self.model = made if made is not None else build_model(args, policy, shape)
        self.start_epoch, self.start_step, self.iteration, self.history, self.running = 0, 0, 0, [], 0.0
        if self.meta is not None:
            meta = self.meta
            self.model.load_flat(run["params"], run["velocity"], meta.get("ema"))
            self.start_epoch, self.iteration, self.history = meta["epoch"], meta["iteration"], meta["history"]
            self.start_step, self.running = meta.get("step", 0), meta.get("running_loss", 0.0)
        cfg, stream = self.config, self.model.stream
        self.train = data.GpuDataset(*run["train"], cfg["mean"], cfg["std"], stream)
        self.test = data.GpuDataset(*run["test"], cfg["mean"], cfg["std"], stream)
        self.augment = Augment(args.shift, args.flip, args.seed, cutout=args.cutout)
        self.steps = math.ceil(self.train.size / B)
        self.total_iters = self.steps * args.epochs
        self.sched = Schedule(args.schedule, args.lr, args.gamma, args.power, args.step_size, args.step_gamma,
                              warmup=round(args.warmup_epochs * self.steps))
        self.clock = {"start-up": 0.0, "training": 0.0, "evaluation": 0.0, "writing": 0.0}
        self.outputs = Outputs(self.out, self.model, self.clock)
        self.checkpoint_path = self.outputs.checkpoint_path
        self.t_begin = 0.0   # set by open_outputs, when the loop begins
        self.reached = None

    @staticmethod
    def say(line: str) -> None:
        print(line, flush=True)

    def wall(self) -> float:
        return time.perf_counter() - self.t_begin

    def announce(self, gpu: str, root) -> None:
        args, cfg = self.args, self.config
        recipe = ["nesterov" if args.nesterov else "", f"label smoothing {args.label_smoothing:g}" if
                  args.label_smoothing else "", f"warm-up {args.warmup_epochs:g} epochs" if args.warmup_epochs else "",
                  f"ema {args.ema:g}" if args.ema else "", f"shift {args.shift}" if args.shift else "",
                  "flip" if args.flip else "", f"cutout {args.cutout}" if args.cutout else "",
                  "test-time mirror" if args.tta else ""]
        self.say(f"GPU {gpu} | dataset {cfg['dataset']} ({self.train.size} train, {self.test.size} test, {root}) | "
                 f"policy {self.policy} | cuda graph {'on' if args.cuda_graph else 'off'}"
                 + (f" | {', '.join(r for r in recipe if r)}" if any(recipe) else ""))

    def open_outputs(self, plotter: Plotter | None) -> None:
        """The outputs (Outputs.open: emptied of an earlier run with --overwrite); the start-up's end."""
        self.outputs.open(plotter, self.meta is None and self.args.overwrite)
        self.clock["start-up"] = startup.process_seconds()   # start-up ends here: the loop begins
        self.t_begin = time.perf_counter() - self.clock["start-up"]   # the program's start, on perf_counter's scale
        self.outputs.last_plot = time.perf_counter()

    def save_checkpoint(self, epoch_done: int, step: int, running_sum: float, now: bool = False) -> None:
        """The checkpoint at (epoch_done, step), on the writer thread, or written before returning (``now``)."""
        self.outputs.checkpoint({"epoch": epoch_done, "step": step, "iteration": self.iteration,
                                 "running_loss": running_sum, "config": self.config, "history": list(self.history)},
                                now)

    def _diverged(self, epoch: int, s: int, mean_loss: float) -> TrainingDiverged:
        has = self.outputs.has_checkpoint()
        return TrainingDiverged(f"loss became {mean_loss} in epoch {epoch + 1} by step {s + 1}; stopped. "
                                + (f"The last good checkpoint is {self.checkpoint_path}" if has
                                   else "No checkpoint was written") + "; try a smaller --lr")

    def epoch(self, epoch: int, sig, ev0, ev1) -> tuple[int | None, float, float]:
        """The epoch's steps from where the run stands: (an exit status when a signal stopped it, or
        None; the GPU's seconds for the epoch; the epoch's mean training loss)."""
        import cupy

        args, model, B, steps = self.args, self.model, self.B, self.steps
        order = self.train.order(args.seed, epoch)
        first = self.start_step if epoch == self.start_epoch else 0
        model.reset_running_loss(self.running if first else 0.0)
        bar = Progress(self.train.size - first * B, epoch + 1, args.epochs, args.quiet)
        t0 = time.perf_counter()
        ev0.record(model.stream)
        done_imgs = 0
        report_every = steps if args.quiet else max(1, steps // 20)   # a host sync per report
        for s in range(first, steps):
            n = min(B, self.train.size - s * B)
            model.load_from(self.train, order, s * B, n, lr=self.sched.at(self.iteration, steps, self.total_iters),
                            augment=self.augment, epoch=epoch)
            model.step(n)
            self.iteration += 1
            done_imgs += n
            if sig.signum is not None:   # see Note [stopping]
                bar.close()
                self.save_checkpoint(epoch, s + 1, model.read_running_loss(), now=True)
                where = f"epoch {epoch + 1}/{args.epochs}, step {s + 1}/{steps} (iteration {self.iteration})"
                self.say(f"stopped by {sig.name} at {where}; " + (
                    f"checkpoint {self.checkpoint_path}; continue with: python -m lenet.train "
                    f"{' '.join(resume_args(self.argv))} --resume" if self.out else "no --out, nothing was saved"))
                return (130 if sig.signum == signal.SIGINT else 143), 0.0, 0.0
            every = CHECKPOINT_EVERY if args.checkpoint_every is None else args.checkpoint_every
            if every and self.iteration % every == 0 and s + 1 < steps:
                self.save_checkpoint(epoch, s + 1, model.read_running_loss())
            if (s + 1) % report_every == 0 or s + 1 == steps:
                mean_loss = model.read_running_loss() / (s + 1)   # one sync per report, not per step
                if not math.isfinite(mean_loss):
                    bar.close()
                    raise self._diverged(epoch, s, mean_loss)
                bar.update(done_imgs, mean_loss, done_imgs / (time.perf_counter() - t0))
                done_imgs = 0
        ev1.record(model.stream)
        ev1.synchronize()
        seconds = max(cupy.cuda.get_elapsed_time(ev0, ev1) / 1000.0, 1e-9)
        bar.close()
        self.clock["training"] += time.perf_counter() - t0
        return None, seconds, model.read_running_loss() / steps

    def evaluate(self, epoch: int, seconds: float, train_loss: float) -> dict:
        """The test split's loss and accuracy after the epoch: its record (printed, kept in history)."""
        args = self.args
        first = self.start_step if epoch == self.start_epoch else 0
        t1 = time.perf_counter()
        test_loss, test_acc = self.model.evaluate(self.test, args.eval_batch_size, tta=args.tta)
        self.clock["evaluation"] += time.perf_counter() - t1
        rec = {"epoch": epoch + 1, "train_loss": train_loss, "test_loss": test_loss, "test_accuracy": test_acc,
               "images_per_s": (self.steps - first) * self.B / seconds, "seconds": seconds,
               "lr": self.sched.at(self.iteration - 1, self.steps, self.total_iters), "wall_s": self.wall()}
        if args.target_accuracy is not None and test_acc >= args.target_accuracy:
            self.reached = rec["target_reached_s"] = rec["wall_s"]
        self.history.append(rec)
        self.say(f"epoch {epoch + 1}/{args.epochs} | train loss {train_loss:.4f} | test loss {test_loss:.4f} | "
                 f"test acc {100 * test_acc:.2f}% | {seconds:.2f} s | {rec['images_per_s'] / 1e6:.2f} M img/s")
        return rec

    def record(self, rec: dict, last: bool) -> None:
        """After an epoch: the checkpoint, the metrics line and (at most every PLOT_SECONDS, and last) the plot."""
        if not self.out:
            return
        self.save_checkpoint(rec["epoch"], 0, 0.0)
        self.outputs.metrics(rec, self.history, self.args.epochs, last)

    def report(self, plot_note: str | None) -> None:
        args, history = self.args, self.history
        if history:
            last = history[-1]
            self.say(f"final | test accuracy {100 * last['test_accuracy']:.2f}% | test loss {last['test_loss']:.4f} | "
                     f"mean epoch {np.mean([h['seconds'] for h in history]):.2f} s"
                     + (f" | target not reached ({100 * args.target_accuracy:.2f}%)"
                        if args.target_accuracy is not None and self.reached is None else ""))
        total, c = self.wall(), self.clock
        other = total - sum(c.values())
        self.say(f"wall clock {total:.2f} s: start-up {c['start-up']:.2f} s, training {c['training']:.2f} s, "
                 f"evaluation {c['evaluation']:.2f} s, writing {c['writing']:.2f} s, other {other:.2f} s")
        wrote = self.outputs.wrote()
        if wrote:
            self.say(f"wrote {wrote}{plot_note or ''}")

    def run(self) -> int:
        """Every epoch left, then the report; the exit status."""
        import cupy

        args = self.args
        ev0, ev1 = cupy.cuda.Event(), cupy.cuda.Event()
        try:
            with Signals() as sig:
                for epoch in range(self.start_epoch, args.epochs):
                    code, seconds, train_loss = self.epoch(epoch, sig, ev0, ev1)
                    if code is not None:
                        return code
                    rec = self.evaluate(epoch, seconds, train_loss)
                    self.record(rec, last=epoch + 1 == args.epochs or self.reached is not None)
                    if self.reached is not None:
                        self.say(f"target accuracy {100 * args.target_accuracy:.2f}% reached at epoch {epoch + 1} "
                                 f"({100 * rec['test_accuracy']:.2f}%), {self.reached:.2f} s after the program started")
                        break
                plot_note = self.outputs.close()
        except StoppedAtOnce as e:
            name = Signals.NAMES.get(e.signum, str(e.signum))
            print(f"stopped at once by a second {name}; {self.outputs.stopped_at_once()}", flush=True)
            return 128 + e.signum
        self.report(plot_note)
        return 0


def run_shape(args, train_images: int, test_images: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(the model's max_batch, every batch size the run steps at, every other one it evaluates at) for splits
    of these sizes (lenet.schedule.batch_sizes of the flags)."""
    return batch_sizes(args.batch_size, train_images, args.eval_batch_size, test_images)


def build_model(args, policy, shape):
    """The run's LeNet, every batch size of ``shape`` (run_shape) planned: the searches stay out of the epochs.
    A size only evaluated is planned forward only (Note [forward-only plans] in lenet/ops.py)."""
    from .model import LeNet

    most, steps, evaluated = shape
    model = LeNet(max_batch=most, policy=policy, seed=args.seed,
                  momentum=args.momentum, weight_decay=args.weight_decay, nesterov=args.nesterov,
                  label_smoothing=args.label_smoothing, ema_decay=args.ema, cuda_graph=args.cuda_graph,
                  fused=args.fused, plan_cache=args.plan_cache)
    startup.mark("model made")
    for n in steps:
        model.plan(n)
        startup.mark(f"batch size {n} planned")
    for n in evaluated:
        model.plan_forward(n)
        startup.mark(f"batch size {n} planned forward only")
    return model


def early_key(args, shape) -> tuple:
    """What a model made beside the data was made for: every flag, and run_shape's sizes."""
    return dict(vars(args)), shape


def build_beside(args, policy) -> None:
    """Note [the model beside the data]: where the dataset's headers say how many images each split holds,
    the model for those sizes is made and planned on the preload thread while this thread reads and checks
    the data. Trainer takes it where the checked splits have those sizes, and makes its own otherwise.

    On a first run the plans are the longest part of the start-up after the dataset's read (their searches
    and cuDNN's first calls: 0.69 s of 2.4 on an H200, docs/performance.md), and the preload thread was idle
    from its first cuDNN graph until the checks passed. A failure there is met again by Trainer, on this
    thread, after the data's errors, as before; a failed check ends the program without waiting for it.
    The plan cache's writes wait for the checks (lenet/plancache.py), as the kernel cache's did not before
    (a module compiled at start-up is stored when compiled). The sizes are the headers' where each file's
    size agrees with its header (data.declared_images): a header that claims more images than its file holds
    sizes no model. The model is taken for the flags it was made with (its key holds them all), so a
    program calling main twice never trains one call's model under the other's flags."""
    try:
        root = data.find_dataset(args.data_dir)
    except (data.DataError, OSError):   # prepare says what is wrong with it
        return
    counts = [None if root is None else data.declared_images(root, split) for split in ("train", "test")]
    if None in counts:
        return
    train_n, test_n = (n if limit is None else min(n, limit)
                       for n, limit in zip(counts, (args.train_size, args.test_size)))
    shape = run_shape(args, train_n, test_n)
    startup.build_beside(early_key(args, shape), lambda: build_model(args, policy, shape))


def start_plotter(args) -> Plotter | None:
    """The plotting child for --out, started before the start-up so that its interpreter and imports are
    done by the time the last epoch asks for a drawing (started when the loop began, it kept a fast run
    waiting at its end: docs/model.md, "The plotting child"). The one lenet.startup.begin started before the
    imports when it saw --out (Note [the plotting child's first run] in lenet/plot.py), else one started now.
    It draws nothing until asked, and leaves when this process does, whatever happens before the loop."""
    early = take_early()
    if not (args.out and can_plot()):
        if early is not None:
            early.discard()
        return None
    plotter = early or Plotter()
    plotter.path = Path(args.out) / "curves.png"
    return plotter


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from .engines import Policy

    policy = cli.policy_from(args, Policy)
    plotter = start_plotter(args)   # Note [plotting in a child] in lenet/plot.py
    # Note [overlapped start-up]
    with startup.starting(args.engine, (args.batch_size, args.eval_batch_size), policy=policy):
        run = prepare(args, beside=lambda: build_beside(args, policy))   # everything that needs no GPU, first
    if run["done"]:   # there is nothing to run (a model made beside the checks is dropped)
        startup.built(None)
        print(f"nothing to do: the checkpoint {files.show(run['resume'])} is at epoch {run['meta']['epoch']} of "
              f"{args.epochs}")
        return 0
    from descriptors import require_gpu

    gpu = require_gpu()
    trainer = Trainer(args, run, policy, argv)
    trainer.announce(gpu, run["root"])
    if trainer.meta is not None:
        steps, start_step, start_epoch = trainer.steps, trainer.start_step, trainer.start_epoch
        where = f"epoch {start_epoch + 1}, step {start_step}/{steps}" if start_step else f"epoch {start_epoch}"
        trainer.say(f"resumed from {run['resume']} after {where}")
    if trainer.start_epoch >= args.epochs:
        trainer.say(f"nothing to do: the checkpoint is at epoch {trainer.start_epoch} of {args.epochs}")
    trainer.open_outputs(plotter)
    return trainer.run()


def resume_args(argv) -> list[str]:
    """The command line of this run without --resume/--overwrite, for the resume hint."""
    args = list(sys.argv[1:] if argv is None else argv)
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in ("--overwrite",) or a.startswith("--resume="):
            continue
        if a == "--resume":
            if i + 1 < len(args) and not args[i + 1].startswith("-"):
                skip = True
            continue
        out.append(a)
    return out


def run() -> None:
    try:
        cli.run(main, cli.prog("train"))
    except TrainingDiverged as e:  # not a usage error: its own status
        print(f"{cli.prog('train')}: error: {e}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    run()
