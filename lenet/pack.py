"""Many LeNets at once: K training configurations of one batch size and epoch count, trained together
by one model of K models (LeNet(models=K), Note [packs] in lenet/ops.py), every step one CUDA graph.

    from lenet.pack import Config, Pack
    pack = Pack([Config(seed=s) for s in range(16)], train, valid)   # GpuDatasets, on any stream
    results = pack.run()     # one Result per configuration: accuracy per epoch, final weights

Each model keeps what a lone `lenet train` run with its flags has: its own initialization and data order
(its seed), its own learning-rate schedule, momentum, Nesterov, weight decay, label smoothing, moving
average and augmentation. The data stays on the GPU once; each model gathers its own batch from its
own permutation (lenet/kernels/data.cu, gather_pack_kernel), so a model sees the batches its lone run
would. A slot whose model is done (or pruned: lenet/study.py) may take another configuration at an
epoch's end, with its own step counter and schedule from 0 (``assign``).

Note [pack schedule]: a model's learning rate at each of its steps is written to the GPU once, as one row
of a (K, steps) table: the gather kernel of each step writes lr[m] = table[m, its step], so a captured
step follows every model's schedule without a host copy. Its epoch's permutation (K of them, one upload
an epoch) is drawn on the host while the GPU still runs the epoch before (double-buffered).

Note [a pack and a lone run]: model k of a pack computes what the lone run of its configuration computes.
Where the pack is small it sums in the lone run's order too (``sums_as_lone`` in lenet/engines/base.py:
at most 4 images per SM, e.g. up to 4 models of 128 on a GPU of 132 SMs), and always under --deterministic: our
stage kernels give each model its lone run's candidates and grid (Ours.share in lenet/engines/ours.py),
our head runs each model on its lone run's grid (head_common.cu), cuDNN's engines run each model's lone
calls (Note [a pack on cuDNN] in lenet/engines/cudnn.py) and cuBLASLt each model's lone matmuls (Note [a
deterministic pack's head] in lenet/engines/fc.py). Its gradients and weights are then its lone
run's, bit for bit, where the two choose the same engines and candidates (always under --deterministic
with the heuristic, Note [reproducible choices] in lenet/plan.py; tests/test_pack_gpu.py). The price is
a grid that grows with K: at 128 images per model a pack of 64 launches 64 times the lone run's blocks,
each with its row of partial sums (nearly twice the step of a shared grid at K = 64: docs/performance.md,
"Notes' numbers: packs"). A larger pack
without --deterministic therefore fills the GPU as K n images do: our stage kernels split each model's
images over ceil(blocks / K) blocks and rank their candidates at K n images, the head may run as batched
cuBLASLt matmuls, and the sums run in another order. First-step gradients then agree within 1e-6 in
relative L2 (2e-7 measured), and within 2e-6 where the pack's rank at K n images takes stage 2's tensor-core
forward and the lone run the float32 one (1.2e-6 measured at 3 x 300 images: Note [pack tolerance] in
tests/test_pack_gpu.py); 16 epochs of SGD carry the rounding into another trajectory, as two
lone runs on two engines do (seeds 0-2 of the fast recipe alone: 91.30 / 91.47 / 91.17% on ours,
91.42 / 91.47 / 91.50% on legacy, 91.48 / 91.56 / 91.33% on graph). A pack is bit-identical to itself:
the same pack size, flags and GPU give the same results (a resumed sweep ends as an uninterrupted one,
tests/test_sweep_gpu.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

from .data import CUTOUT_MAX, epoch_order
from .schedule import SCHEDULES, Schedule, batch_sizes

MAX_PACK = 64   # models per pack by default: the step at 128 images per model fills 132 SMs from ~16 on


@dataclass(frozen=True)
class Config:
    """One model's training configuration: the flags of `lenet train` a sweep varies (their defaults are
    the README's fast Fashion-MNIST recipe)."""

    lr: float = 0.15
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    label_smoothing: float = 0.05
    schedule: str = "cosine"
    warmup_epochs: float = 1.0
    ema: float | None = None
    shift: int = 0
    flip: bool = True
    cutout: int = 0
    seed: int = 0
    batch_size: int = 150
    epochs: int = 16
    gamma: float = 1e-4
    power: float = 0.75
    step_size: int = 10
    step_gamma: float = 0.1

    def __post_init__(self):
        """One-line ValueErrors naming the setting and what it allows."""
        def bad(name, allowed):
            return ValueError(f"{name} {getattr(self, name)!r}: {allowed}")
        for name in ("lr", "weight_decay", "warmup_epochs", "gamma", "power", "step_gamma"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise bad(name, "must be a finite number >= 0")
        if not 0.0 <= self.momentum < 1.0:
            raise bad("momentum", "must be in [0, 1)")
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("nesterov needs a momentum > 0")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise bad("label_smoothing", "must be in [0, 1)")
        if self.ema is not None and not 0.0 < self.ema < 1.0:
            raise bad("ema", "must be in (0, 1), or None (off)")
        if self.schedule not in SCHEDULES:
            raise bad("schedule", f"use one of {', '.join(SCHEDULES)}")
        for name, low, high in (("shift", 0, 13), ("cutout", 0, CUTOUT_MAX), ("seed", 0, 2**32 - 1), ("batch_size", 1, 1 << 20),
                                ("epochs", 1, 100000), ("step_size", 1, 100000)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not low <= v <= high:
                raise bad(name, f"must be an integer from {low} to {high}")
        if self.warmup_epochs > self.epochs:
            raise ValueError(f"warmup_epochs {self.warmup_epochs:g} is longer than the run ({self.epochs} epochs)")

    def replace(self, **kw) -> "Config":
        return dataclasses.replace(self, **kw)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def schedule_of(self, steps: int) -> Schedule:
        return Schedule(self.schedule, self.lr, self.gamma, self.power, self.step_size, self.step_gamma,
                        warmup=round(self.warmup_epochs * steps))

    def train_flags(self, tta: bool = False) -> list[str]:
        """The `lenet train` flags that train this configuration alone (each value written so that it reads
        back as the same number: an Optuna trial's 0.0712345678 is not rounded to 0.0712346)."""
        g = _exact
        out = [f"--epochs {self.epochs}", f"--batch-size {self.batch_size}", f"--schedule {self.schedule}",
               f"--lr {g(self.lr)}", f"--momentum {g(self.momentum)}", f"--weight-decay {g(self.weight_decay)}",
               f"--seed {self.seed}"]
        if self.schedule == "inv":
            out += [f"--gamma {g(self.gamma)}", f"--power {g(self.power)}"]
        if self.schedule == "step":
            out += [f"--step-size {self.step_size}", f"--step-gamma {g(self.step_gamma)}"]
        out += (["--nesterov"] if self.nesterov else []) + \
               ([f"--label-smoothing {g(self.label_smoothing)}"] if self.label_smoothing else []) + \
               ([f"--warmup-epochs {g(self.warmup_epochs)}"] if self.warmup_epochs else []) + \
               ([f"--ema {g(self.ema)}"] if self.ema is not None else []) + \
               ([f"--shift {self.shift}"] if self.shift else []) + (["--flip"] if self.flip else []) + \
               ([f"--cutout {self.cutout}"] if self.cutout else []) + \
               (["--tta"] if tta else [])
        return out


def _exact(v: float) -> str:
    """v as short as it reads back exactly: 0.1 as 0.1, 5e-4 as 0.0005, 0.07123456789 whole."""
    short = f"{v:g}"
    return short if float(short) == v else repr(float(v))


def config_from(d: dict) -> Config:
    """A Config from its as_dict() (a results row, a checkpoint): unknown keys are an error."""
    names = {f.name for f in dataclasses.fields(Config)}
    extra = sorted(set(d) - names)
    if extra:
        raise ValueError(f"not a configuration: unknown settings {', '.join(extra)}")
    return Config(**d)


@dataclass
class Result:
    """One configuration's run: per epoch the evaluated split's accuracy and loss and the mean training
    loss; its final weights (flat host buffers: evaluated weights, parameters, momentum)."""

    config: Config
    slot: int
    accuracy: list = field(default_factory=list)
    loss: list = field(default_factory=list)
    train_loss: list = field(default_factory=list)
    seconds: float = 0.0
    pruned: bool = False
    weights: np.ndarray | None = None    # what evaluation used (the moving average when kept)
    params: np.ndarray | None = None
    velocity: np.ndarray | None = None
    tag: object = None                    # the caller's (an Optuna trial)

    @property
    def final(self) -> float:
        return self.accuracy[-1] if self.accuracy else float("nan")

    @property
    def done(self) -> bool:
        return self.pruned or len(self.accuracy) >= self.config.epochs


def packs(configs: list[Config], most: int = MAX_PACK) -> list[list[Config]]:
    """Configurations grouped by (batch size, epochs), in their order, each group cut into packs of at
    most ``most`` models: as few packs as the batch sizes and epoch counts allow."""
    if most < 1:
        raise ValueError(f"a pack holds at least 1 model, got {most}")
    groups: dict = {}
    for c in configs:
        groups.setdefault((c.batch_size, c.epochs), []).append(c)
    return [g[i:i + most] for g in groups.values() for i in range(0, len(g), most)]


class Pack:
    """K slots, each training one configuration at a time (module docstring). All slots share the batch
    size and epoch count; ``evals`` is the split evaluated after every epoch (validation, or test)."""

    def __init__(self, configs: list[Config], train, evals, *, policy=None, plan_cache=False,
                 eval_batch: int = 1000, tta: bool = False, cuda_graph: bool = True, models: int | None = None,
                 model=None, keep_average: bool = False):
        import cupy

        from .kernels import AUG_FIELDS
        from .model import LeNet

        if not configs:
            raise ValueError("a pack needs at least one configuration")
        first = configs[0]
        if any((c.batch_size, c.epochs) != (first.batch_size, first.epochs) for c in configs):
            raise ValueError("a pack's configurations share one batch size and epoch count (lenet.pack.packs)")
        K = self.K = int(models or len(configs))
        if len(configs) > K:
            raise ValueError(f"{len(configs)} configurations for a pack of {K} models")
        self.batch_size, self.epochs, self.tta = first.batch_size, first.epochs, bool(tta)
        self.train, self.evals = train, evals
        self.B = min(self.batch_size, train.size)   # a batch larger than its split is the whole split
        self.steps = math.ceil(train.size / self.B)
        self.eval_batch = min(eval_batch, evals.size)
        fill = configs + [configs[-1]] * (K - len(configs))   # idle slots train a copy, unread
        self.model = model or LeNet(
            max_batch=max(self.B, self.eval_batch), models=K, policy=policy, plan_cache=plan_cache,
            cuda_graph=cuda_graph, seed=[c.seed for c in fill], momentum=[c.momentum for c in fill],
            weight_decay=[c.weight_decay for c in fill], nesterov=[c.nesterov for c in fill],
            label_smoothing=[c.label_smoothing for c in fill], ema_decay=[c.ema for c in fill],
            keep_average=keep_average)   # slots assigned later may keep a moving average
        m = self.model
        if m.ema is None and any(c.ema is not None for c in configs):
            raise ValueError("this pack's model keeps no moving average; make it with one")
        self.stream = m.stream
        for split in (train, evals):   # sent on their own stream (a sweep's: once, for all its packs); ours waits
            if split.stream.ptr != self.stream.ptr:   # for no other, so it waits for that one (the host does not)
                self.stream.wait_event(split.stream.record())
        T = self.steps * self.epochs
        with self.stream:
            self.lr_table = cupy.zeros(K * T, cupy.float32)        # (K, T): Note [pack schedule]
            self.lr_at = cupy.zeros(K, cupy.int32)                 # (K,) row m's first entry this epoch
            self.aug = cupy.zeros((K, AUG_FIELDS), cupy.int32)     # (K, 4) shift, flip, seed, cutout: aug_rows
            self.epoch_dev = cupy.zeros(K, cupy.int32)             # (K,) each slot's epoch (augmentation draws)
            self.orders = [cupy.zeros((K, train.size), cupy.int32) for _ in range(2)]   # double-buffered
        self.slots: list[Result | None] = [None] * K
        self.results: list[Result] = []
        self._next = None   # (what each slot's next permutation is of, the permutations): Note [pack schedule]
        self._turn = 0
        for k, c in enumerate(configs):
            self.assign(k, c, fresh=False)
        _, steps, evaluated = batch_sizes(self.batch_size, train.size, eval_batch, evals.size)
        for n in steps:
            m.plan(n)   # every batch size now: the search stays out of the epochs
        for n in evaluated:
            m.plan_forward(n)   # Note [forward-only plans] in lenet/ops.py

    # ---------------------------------------------------------------- slots

    def assign(self, k: int, config: Config, tag=None, fresh: bool = True) -> Result:
        """Slot k trains ``config`` from its first step: its own initialization (``fresh``: written now;
        else the model was made with it), momentum buffer, average, constants and schedule."""
        if (config.batch_size, config.epochs) != (self.batch_size, self.epochs):
            raise ValueError(f"slot {k}: configuration of batch {config.batch_size}, {config.epochs} epochs in a "
                             f"pack of batch {self.batch_size}, {self.epochs} epochs")
        from .kernels import aug_rows

        m, T = self.model, self.steps * self.epochs
        if fresh:   # the model's own (it refuses what it cannot take: a lone model, an average it has no room for)
            m.set_model(k, seed=config.seed, momentum=config.momentum, weight_decay=config.weight_decay,
                        nesterov=config.nesterov, label_smoothing=config.label_smoothing, ema_decay=config.ema)
        elif config.ema is not None and m.ema is None:
            raise ValueError(f"slot {k}: a moving average in a pack made without one (keep_average=True)")
        table = config.schedule_of(self.steps).table(self.steps, T).astype(np.float32)
        with self.stream:
            self.lr_table[k * T:(k + 1) * T].set(table, stream=self.stream)
            self.aug[k].set(aug_rows([(config.shift, int(config.flip), config.seed, config.cutout)])[0],
                            stream=self.stream)
        self.stream.synchronize()   # the host arrays above may go once set() returns
        r = Result(config, k, tag=tag)
        self.slots[k] = r
        self.results.append(r)
        return r

    @property
    def active(self) -> list[int]:
        return [k for k, r in enumerate(self.slots) if r is not None and not r.done]

    def release(self, k: int) -> None:
        """Slot k's model stops (it is done or pruned): its row keeps training unread until assigned."""
        self.slots[k] = None

    # ---------------------------------------------------------------- epochs

    def _order_keys(self, ahead: int) -> list:
        """(seed, epoch) of each slot's permutation ``ahead`` epochs on (None: an idle slot)."""
        return [(r.config.seed, len(r.accuracy) + ahead) if r is not None else None for r in self.slots]

    def _orders(self, keys: list, have=None) -> np.ndarray:
        """The permutations ``keys`` name, reusing the rows of ``have`` = (keys, array) that match."""
        out = np.empty((self.K, self.train.size), np.int32)
        for k, key in enumerate(keys):
            if have is not None and have[0][k] == key:
                out[k] = have[1][k]
            else:
                out[k] = epoch_order(*key, self.train.size) if key is not None else np.arange(self.train.size,
                                                                                            dtype=np.int32)
        return out

    def begin_epoch(self):
        """Upload this epoch's permutations, epochs and schedule rows (Note [pack schedule]); returns the
        device orders."""
        orders = self._orders(self._order_keys(0), self._next)   # a slot assigned since: its own drawn now
        self._next = None
        buf = self.orders[self._turn]
        self._turn ^= 1
        T = self.steps * self.epochs
        epochs = np.array([len(r.accuracy) if r is not None else 0 for r in self.slots], np.int32)
        with self.stream:
            buf.set(orders, stream=self.stream)
            self.epoch_dev.set(epochs, stream=self.stream)
            self.lr_at.set(np.arange(self.K, dtype=np.int32) * T + np.minimum(epochs, self.epochs - 1) * self.steps,
                           stream=self.stream)
            self.model.reset_running_loss(0.0)
        self.stream.synchronize()
        return buf

    def steps_of(self, orders, first: int = 0, stop=None) -> int:
        """The epoch's steps from ``first``; returns the step it stopped before (``stop()`` true after a
        step: a signal), or self.steps."""
        m, B = self.model, self.B
        for s in range(first, self.steps):
            n = min(B, self.train.size - s * B)
            m.load_pack(self.train, orders, s * B, n, self.aug, self.epoch_dev, self.lr_table, self.lr_at, s)
            m.step(n)
            if s == first and self._next is None:   # drawn while the GPU runs this epoch
                keys = self._order_keys(1)
                self._next = (keys, self._orders(keys))
            if stop is not None and stop():
                return s + 1
        return self.steps

    def end_epoch(self, seconds: float) -> list[Result]:
        """Evaluate every model on ``evals``; append each active slot's figures; returns the slots that are
        now done (their final weights copied to the host)."""
        m = self.model
        train_loss = m.running_loss.get(stream=self.stream) / self.steps
        loss, acc = m.evaluate(self.evals, batch=self.eval_batch, tta=self.tta)
        # A pack of one configuration is a lone model (LeNet(models=1)), whose figures are numbers: as rows of one.
        train_loss, loss, acc = np.atleast_1d(train_loss), np.atleast_1d(loss), np.atleast_1d(acc)
        finished = []
        for k, r in enumerate(self.slots):
            if r is None or r.done:
                continue
            r.accuracy.append(float(acc[k]))
            r.loss.append(float(loss[k]))
            r.train_loss.append(float(train_loss[k]))
            r.seconds += seconds
            if r.done:
                self.keep_weights(k)
                finished.append(r)
        return finished

    def keep_weights(self, k: int) -> None:
        r = self.slots[k]
        r.params, r.velocity, ema = self.model.flat_state(k)
        r.weights = ema if r.config.ema is not None else r.params

    def run(self, on_epoch=None) -> list[Result]:
        """Every slot's configuration to its last epoch (the Python API's whole run); ``on_epoch(pack,
        finished)`` after each epoch's evaluation. Returns the results in assignment order."""
        while self.active:
            t = time.perf_counter()
            orders = self.begin_epoch()
            self.steps_of(orders)
            finished = self.end_epoch(time.perf_counter() - t)
            for r in finished:
                self.release(r.slot)
            if on_epoch is not None:
                on_epoch(self, finished)
        return self.results

    def close(self) -> None:
        self.model.close()
