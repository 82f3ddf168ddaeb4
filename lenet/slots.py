"""How many models a model object trains, as an object: ``One`` (a lone run) or ``Pack`` (K > 1 models of
one architecture in one step, a sweep's: Note [packs] in lenet/ops.py). Every place where the two differ
(where the update's constants live, the shape of a batch, a learning rate and a loss as one number or K,
which model a host view reads, how an evaluation gathers its images) asks the model's slots, chosen once,
at construction, instead of testing K."""

from __future__ import annotations

import numpy as np

from .checks import per_model
from .kernels import MIRROR, aug_rows, fill, gather_pack


def slots_for(settings: dict, keep_average: bool = False, input_grad: bool = False):
    """``One`` or ``Pack`` for a model's settings (one list of K values each: checks.settings_of)."""
    models = len(settings["seed"])
    if models == 1:
        return One(settings)
    if input_grad:
        raise ValueError("the images' gradient is for one model (lenet.torch); a pack has models > 1")
    return Pack(settings, keep_average)


class One:
    """A lone model: the update's constants in its launch, as ever; its numbers host floats."""

    models = 1

    def __init__(self, settings: dict):
        self.settings = settings

    def keeps_average(self) -> bool:
        return self.settings["ema_decay"][0] is not None

    def device_constants(self) -> tuple:
        """(the update's constants (K, 4), the label smoothing (K,)) on the device: a pack's only."""
        return None, None

    def update_constants(self, label_smoothing_dev, keeps: bool) -> tuple:
        """(momentum, weight decay, nesterov, label smoothing, ema decay) as the operations take them."""
        st = self.settings
        return (st["momentum"][0], st["weight_decay"][0], bool(st["nesterov"][0]), float(st["label_smoothing"][0]),
                st["ema_decay"][0])

    def rows(self, x, y):
        """A host or device batch as the rows of the input buffers."""
        return x, y

    def reset_running_loss(self, running, value, stream) -> None:
        with stream:
            fill(running, value)

    def set_lr(self, lr_dev, lr, rates: list, last, stream):
        """Write the learning rate where it changed; returns what the device holds now (``last`` the same)."""
        if lr != last:
            with stream:
                fill(lr_dev, lr)
        return lr

    def totals(self, loss_dev, correct_dev):
        """(summed loss, right answers) read from the device: numbers."""
        return float(loss_dev.get()[0]), int(correct_dev.get()[0])

    def loss(self, loss_dev):
        return float(loss_dev.get()[0])

    def index(self, model: int | None) -> int:
        """Which model a host view reads (None: the lone one)."""
        model = 0 if model is None else model
        if not 0 <= model < self.models:
            raise ValueError(f"model {model} is outside 0..{self.models - 1}")
        return model

    def gather_eval(self, inputs, dataset, start: int, n: int, mirror: bool) -> None:
        """Test images [start, start + n) (mirrored for test-time augmentation) into the input rows
        (lenet.inputs.Inputs)."""
        inputs.load_from(dataset, dataset.identity, start, n, augment=MIRROR if mirror else None)

    def check_restart(self, model: int) -> None:
        raise ValueError("a lone model trains the configuration it was made with; a pack (models >= 2) "
                         "lets a model take another")


class Pack(One):
    """K > 1 models: the update's constants and the label smoothing on the device, one row each (so that
    a slot may take another configuration: lenet/pack.py); batches (K, n, ...); numbers (K,) arrays."""

    def __init__(self, settings: dict, keep_average: bool = False):
        super().__init__(settings)
        self.models = len(settings["seed"])
        self.keep_average = bool(keep_average)
        self._eval_inputs: dict = {}   # the evaluation's orders and flags, per split size

    def keeps_average(self) -> bool:
        # A pack whose slots may later take configurations with an average keeps the buffer (``keep_average``).
        return any(d is not None for d in self.settings["ema_decay"]) or self.keep_average

    def device_constants(self) -> tuple:
        import cupy

        st = self.settings
        hyper = cupy.asarray(np.stack([constants(st["momentum"][m], st["weight_decay"][m], st["nesterov"][m],
                                                 st["ema_decay"][m]) for m in range(self.models)]))
        return hyper, cupy.asarray(np.array(st["label_smoothing"], np.float32))

    def update_constants(self, label_smoothing_dev, keeps: bool) -> tuple:
        return 0.0, 0.0, False, label_smoothing_dev, 0.0 if keeps else None

    def rows(self, x, y):
        """(K, n, ...) images and (K, n) labels, model m's batch x[m], as K n rows."""
        K = self.models
        if tuple(getattr(x, "shape", ()))[:1] != (K,) or tuple(getattr(y, "shape", ()))[:1] != (K,):
            raise ValueError(f"a pack of {K} models takes images (K, n, 1, 28, 28) and labels (K, n), got "
                             f"{getattr(x, 'shape', type(x))} and {getattr(y, 'shape', type(y))}")
        return x.reshape(-1, *x.shape[2:]), y.reshape(-1)

    def reset_running_loss(self, running, value, stream) -> None:
        """One value, or one per model (which waits for the stream)."""
        if not isinstance(value, (list, tuple, np.ndarray)):
            return super().reset_running_loss(running, value, stream)
        with stream:
            running.set(np.asarray(per_model(value, self.models, "running loss"), np.float32), stream=stream)
        stream.synchronize()   # the host array may go once this returns

    def set_lr(self, lr_dev, lr, rates: list, last, stream):
        if tuple(rates) != last:   # a copy only when the rates change: it waits for the stream
            with stream:
                lr_dev.set(np.asarray(rates, np.float32), stream=stream)
            stream.synchronize()   # the host array may go before an asynchronous copy reads it
        return tuple(rates)

    def totals(self, loss_dev, correct_dev):
        return loss_dev.get().astype(np.float64), correct_dev.get().astype(np.int64)

    def loss(self, loss_dev):
        return loss_dev.get()

    def index(self, model: int | None) -> int:
        if model is None:
            raise ValueError(f"a pack of {self.models} models: say which model (0..{self.models - 1})")
        return super().index(model)

    def gather_eval(self, inputs, dataset, start: int, n: int, mirror: bool) -> None:
        """Every model's test images [start, start + n), one launch."""
        import cupy

        key = ("eval", dataset.size, mirror)
        if key not in self._eval_inputs:
            with inputs.stream:
                K = self.models
                self._eval_inputs[key] = (cupy.tile(dataset.identity[None, :], (K, 1)),
                                          cupy.asarray(aug_rows([(0, 2 if mirror else 0, 0, 0)] * K)),
                                          cupy.zeros(K, cupy.int32))
        orders, aug, epochs = self._eval_inputs[key]
        with inputs.stream:
            gather_pack(dataset.images, dataset.labels, orders, start, n, dataset.mean, dataset.std, inputs.buf["x"],
                        inputs.buf["labels"], aug, epochs, None, None, 0, None)
        inputs.n = n

    def check_restart(self, model: int) -> None:
        self.index(model)


def constants(momentum, weight_decay, nesterov, ema_decay) -> np.ndarray:
    """A pack model's row of the update's constants (sgd.cu): momentum, weight decay, nesterov, ema weight
    (1: no average kept, the buffer copies the weights)."""
    return np.array([momentum, weight_decay, float(bool(nesterov)), 1.0 - (ema_decay or 0.0)], np.float32)
