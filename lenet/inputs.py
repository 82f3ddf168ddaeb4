"""What the next step reads: the batch in a model's input rows (``buf["x"]``, ``buf["labels"]``: n images per
model) and the learning rate on the device (one per model), loaded from the host, gathered from a
GPU-resident dataset, or a pack's from its orders and its table of rates."""

from __future__ import annotations

import math

from .checks import check_batch, per_model
from .kernels import gather_batch, gather_pack


class Inputs:
    """The input rows of ``buf`` and the rates ``lr_dev`` (K,) of a model of ``max_batch`` images per model,
    on ``stream``, for ``slots`` (lenet.slots: One or Pack)."""

    def __init__(self, buf: dict, lr_dev, stream, slots, max_batch: int):
        self.buf, self.lr_dev, self.stream, self.slots, self.max_batch = buf, lr_dev, stream, slots, max_batch
        self.n = max_batch   # rows of the buffers holding the current batch (per model)
        self.lr_host = None   # the rate the device holds: a number, a pack's tuple, "device" (a table's), or None

    def _check_n(self, n: int) -> None:
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"batch size {n} is outside 1..{self.max_batch} (this model's max_batch)")

    def load_batch(self, x, y) -> int:
        """Validate a batch (NumPy, or CuPy made on the caller's current stream) and copy it into the input
        buffers; return n."""
        import cupy

        K = self.slots.models
        if any(isinstance(a, cupy.ndarray) for a in (x, y)):
            # A device batch is the caller's, made on its current stream; ours waits for no other, so it waits
            # for that one (an event: the host does not wait), then checks and copies it.
            caller = cupy.cuda.get_current_stream()
            if caller.ptr != self.stream.ptr:
                self.stream.wait_event(caller.record())
        with self.stream:
            x, y = self.slots.rows(x, y)   # a pack's (K, n, ...) images and (K, n) labels as K n rows
            rows = check_batch(x, y, K * self.max_batch)
            xs = cupy.asarray(x, dtype=cupy.float32).reshape(rows, 1, 28, 28)
            ys = cupy.asarray(y).astype(cupy.int32, copy=False)
            self.buf["x"][:rows] = xs
            self.buf["labels"][:rows] = ys
        self.n = rows // K
        return self.n

    def load_from(self, dataset, order, start: int, n: int, lr: float | None = None, augment=None,
                  epoch: int = 0) -> None:
        """Gather batch order[start:start+n] of a GPU-resident dataset (one launch, no host wait), augmented
        by ``augment`` (lenet.kernels.Augment) with the draws of ``epoch``; also sets the rate when lr is given."""
        self._check_n(n)
        if lr is not None and not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"learning rate must be a finite number >= 0, got {lr}")
        with self.stream:
            gather_batch(dataset.images, dataset.labels, order, start, n, dataset.mean, dataset.std,
                         self.buf["x"], self.buf["labels"], lr, self.lr_dev if lr is not None else None,
                         augment, epoch)
        if lr is not None:
            self.lr_host = lr
        self.n = n

    def load_pack(self, dataset, orders, start: int, n: int, aug, epochs, lr_table, lr_at, step: int) -> None:
        """A pack's batch (lenet.kernels.gather_pack): model m's images orders[m, start:start+n], augmented by
        aug[m] with the draws of epochs[m], and its rate lr_table[lr_at[m] + step]; one launch, no host wait."""
        self._check_n(n)
        with self.stream:
            gather_pack(dataset.images, dataset.labels, orders, start, n, dataset.mean, dataset.std, self.buf["x"],
                        self.buf["labels"], aug, epochs, lr_table, lr_at, step, self.lr_dev)
        self.lr_host = "device"
        self.n = n

    def set_lr(self, lr) -> None:
        """The learning rate the next updates take: one number, or a pack's one per model."""
        rates = per_model(lr, self.slots.models, "learning rate")
        for r in rates:
            if not (math.isfinite(r) and r >= 0):
                raise ValueError(f"learning rate must be a finite number >= 0, got {r}")
        self.lr_host = self.slots.set_lr(self.lr_dev, lr, rates, self.lr_host, self.stream)

    def take_lr(self, lr) -> None:
        """``lr`` set when given; without it, the rate set before (a ValueError when none was)."""
        if lr is not None:
            self.set_lr(lr)
        elif self.lr_host is None:
            raise ValueError("no learning rate set: pass lr")
