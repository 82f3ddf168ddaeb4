"""A model's state on the device: one flat buffer each for the parameters, their gradients, the momentum
and the weights' moving average (a pack's (K TOTAL,), model m's row its own; lenet/params.py's layout),
the device scalars of the step (one per model), and the host's views of them: PyTorch's names and
shapes, a checkpoint's flat arrays, a pack's slot started again."""

from __future__ import annotations

import numpy as np

from . import params as P
from .checks import check_hyperparameters
from .kernels import copy_of, device_copy, fill
from .slots import constants


class Weights:
    """Made on ``stream`` for ``slots`` (lenet.slots: One or Pack), each model initialized from its seed."""

    def __init__(self, slots, stream):
        import cupy

        self.slots, self.stream = slots, stream
        K, keeps = slots.models, slots.keeps_average()
        self.params = cupy.asarray(np.concatenate([P.pack(P.init_host(s)) for s in slots.settings["seed"]]))  # (K TOTAL,)
        self.grads = cupy.zeros(K * P.TOTAL, dtype=cupy.float32)      # (K TOTAL,)
        self.velocity = cupy.zeros(K * P.TOTAL, dtype=cupy.float32)   # (K TOTAL,)
        self.ema = copy_of(self.params) if keeps else None   # (K TOTAL,) or None
        # Where the live weights wait while an evaluation runs on the average.
        self.params_aside = cupy.zeros(K * P.TOTAL, dtype=cupy.float32) if keeps else None
        self.p, self.g = P.views(self.params), P.views(self.grads)   # model 0's views
        self.lr_dev = cupy.zeros(K, dtype=cupy.float32)           # (K,) read by the SGD kernel
        self.loss_dev = cupy.zeros(K, dtype=cupy.float32)         # (K,) mean loss of the last forward
        self.correct_dev = cupy.zeros(K, dtype=cupy.int32)        # (K,) right answers in it
        self.running_loss = cupy.zeros(K, dtype=cupy.float32)     # (K,) sum of step losses since reset
        # A pack's constants (sgd.cu: momentum, weight decay, nesterov, ema weight) and label smoothing, (K, 4)
        # and (K,); a lone model's are in the update's launch (None here).
        self.hyper, self.label_smoothing_dev = slots.device_constants()

    # ------------------------------------------------------------------ what a warm-up run saves

    def state(self) -> list:
        return [a for a in (self.params, self.velocity, self.running_loss, self.ema) if a is not None]

    def save(self):
        # On the model's stream: a copy on another stream could still be pending when the warm-up run
        # changes the state or the restore reads the copy (a race seen: docs/model.md, "The warm-up's state").
        with self.stream:
            return [copy_of(a) for a in self.state()]

    def restore(self, saved) -> None:
        with self.stream:
            for a, s in zip(self.state(), saved):
                device_copy(a, s)

    # ------------------------------------------------------------------ host views

    def row(self, flat, model: int | None) -> np.ndarray:
        """One model's flat row of a (K TOTAL,) device buffer, as a host array (model None: a lone model)."""
        model = self.slots.index(model)
        self.stream.synchronize()
        return flat[model * P.TOTAL: (model + 1) * P.TOTAL].get()

    def state_dict(self, model: int | None = None) -> dict[str, np.ndarray]:
        return P.unpack(self.row(self.params, model))

    def grad_dict(self, model: int | None = None) -> dict[str, np.ndarray]:
        return P.unpack(self.row(self.grads, model))

    def eval_state_dict(self, model: int | None = None) -> dict[str, np.ndarray]:
        return P.unpack(self.row(self.ema if self.ema is not None else self.params, model))

    def flat_state(self, model: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        if model is not None:
            return (self.row(self.params, model), self.row(self.velocity, model),
                    self.row(self.ema, model) if self.ema is not None else None)
        self.stream.synchronize()
        return self.params.get(), self.velocity.get(), (self.ema.get() if self.ema is not None else None)

    def load_flat(self, params_flat: np.ndarray, velocity_flat: np.ndarray, ema_flat: np.ndarray | None = None) -> None:
        size = self.slots.models * P.TOTAL
        if params_flat.shape != (size,) or velocity_flat.shape != (size,):
            raise ValueError(f"flat buffers must be ({size},), got {params_flat.shape}, {velocity_flat.shape}")
        with self.stream:
            self.params.set(np.asarray(params_flat, np.float32))
            self.velocity.set(np.asarray(velocity_flat, np.float32))
            if self.ema is not None:
                self.ema.set(np.asarray(ema_flat if ema_flat is not None else params_flat, np.float32))
        self.stream.synchronize()

    def load_state_dict(self, state: dict) -> None:
        host = {k: np.asarray(getattr(v, "detach", lambda: v)()) if not isinstance(v, np.ndarray) else v
                for k, v in state.items()}
        flat = P.pack(host)
        with self.stream:
            self.params.set(np.asarray(flat, np.float32))
            if self.ema is not None:   # new weights: the average starts again from them
                device_copy(self.ema, self.params)
        self.stream.synchronize()

    def restart(self, model: int, *, seed: int, momentum: float, weight_decay: float, nesterov: bool,
                label_smoothing: float, ema_decay: float | None) -> None:
        """Model ``model`` of a pack starts again: the initialization of ``seed``, a zero momentum buffer, its
        average at the weights, and its own constants. Waits for the stream."""
        self.slots.check_restart(model)
        if ema_decay is not None and self.ema is None:
            raise ValueError(f"model {model}: a moving average in a pack made without one (keep_average=True)")
        P.check_seed(seed)
        check_hyperparameters(momentum, weight_decay, nesterov, label_smoothing, ema_decay)
        row = slice(model * P.TOTAL, (model + 1) * P.TOTAL)
        init = P.pack(P.init_host(seed))
        with self.stream:
            self.params[row].set(init, stream=self.stream)
            fill(self.velocity[row], 0)
            if self.ema is not None:
                self.ema[row].set(init, stream=self.stream)
            self.hyper[model].set(constants(momentum, weight_decay, nesterov, ema_decay), stream=self.stream)
            self.label_smoothing_dev[model:model + 1].set(np.array([label_smoothing], np.float32), stream=self.stream)
        self.stream.synchronize()   # the host arrays above may go once this returns
