"""Learning-rate schedules, as a function of the iteration (one SGD step = one iteration), and the batch sizes a
run of a given batch size takes over its splits."""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("constant", "step", "cosine", "inv")


@dataclass(frozen=True)
class Schedule:
    """constant: lr
    step:     lr * step_gamma ** (epoch // step_size)
    cosine:   lr * (1 + cos(pi * it / total)) / 2
    inv:      lr * (1 + gamma * it) ** -power          (Caffe's LeNet solver)

    With ``warmup`` W > 0 iterations, any of them is multiplied by min(1, (it + 1) / W): a linear
    warm-up from lr / W to the schedule's own value (PyTorch's LinearLR with start_factor 1/W,
    in front of the schedule).
    """

    kind: str = "inv"
    lr: float = 0.01
    gamma: float = 1e-4
    power: float = 0.75
    step_size: int = 10
    step_gamma: float = 0.1
    warmup: int = 0

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.kind!r}; use one of {', '.join(SCHEDULES)}")

    def at(self, it: int, iters_per_epoch: int, total_iters: int) -> float:
        lr = self._at(it, iters_per_epoch, total_iters)
        return lr * min(1.0, (it + 1) / self.warmup) if self.warmup > 0 else lr

    def _at(self, it: int, iters_per_epoch: int, total_iters: int) -> float:
        if self.kind == "constant":
            return self.lr
        if self.kind == "step":
            return self.lr * self.step_gamma ** ((it // iters_per_epoch) // self.step_size)
        if self.kind == "cosine":
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * min(it, total_iters) / max(total_iters, 1)))
        return self.lr * (1.0 + self.gamma * it) ** (-self.power)

    def table(self, iters_per_epoch: int, total_iters: int):
        """``at(it)`` for it in range(total_iters) as one float64 array, computed at once (a sweep's pack
        writes every model's whole schedule to the GPU once: lenet/sweep.py). The same arithmetic as
        ``at``, elementwise."""
        import numpy as np

        it = np.arange(total_iters, dtype=np.float64)
        if self.kind == "constant":
            lr = np.full(total_iters, self.lr)
        elif self.kind == "step":
            lr = self.lr * self.step_gamma ** ((np.arange(total_iters) // iters_per_epoch) // self.step_size)
        elif self.kind == "cosine":
            lr = self.lr * 0.5 * (1.0 + np.cos(np.pi * np.minimum(it, total_iters) / max(total_iters, 1)))
        else:
            lr = self.lr * (1.0 + self.gamma * it) ** (-self.power)
        if self.warmup > 0:
            lr = lr * np.minimum(1.0, (it + 1) / self.warmup)
        return lr


def batch_sizes(batch: int, train_images: int, eval_batch: int, test_images: int) \
        -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(the largest batch a run takes, every batch size it steps at, every other one it evaluates at) for
    splits of these sizes: an epoch's batches and its last, the evaluation's and its last. A batch larger
    than its split is the whole split (a batch size of 1,000,000 on 200 images sizes no 45 GB model)."""
    last = train_images - (math.ceil(train_images / batch) - 1) * batch
    steps = tuple(dict.fromkeys((min(batch, train_images), last)))
    evals = dict.fromkeys((min(eval_batch, test_images), test_images % eval_batch or eval_batch))
    return max(min(batch, train_images), min(eval_batch, test_images)), steps, tuple(n for n in evals if n not in steps)
