"""The SGD update (our kernel, lenet/kernels/sgd.cu): one launch over the flat parameter buffer,
which also moves the weights' exponential moving average when the model keeps one."""

from __future__ import annotations

from ..kernels import sgd_launch


class SGD:
    """PyTorch's torch.optim.SGD rule with momentum (plain or Nesterov) and weight decay, lr read
    from device memory (``lr``, (1,)); then ema += (1 - ema_decay) * (params - ema) when the model
    keeps a moving average (``ema`` not None). Every buffer is flat, of the same layout."""

    def __init__(self, stream, params, grads, velocity, lr, ema=None, *, momentum: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, ema_decay: float | None = None):
        self.stream, self.params, self.grads, self.velocity, self.lr, self.ema = stream, params, grads, velocity, lr, ema
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self.nesterov, self.ema_decay = bool(nesterov), ema_decay
        self._launch = sgd_launch(stream, params, grads, velocity, lr, self.momentum, self.weight_decay,
                                  self.nesterov, ema, ema_decay or 0.0)

    def __call__(self) -> None:
        self._launch()

    def describe(self) -> list[dict]:
        what = ("nesterov " if self.nesterov else "") + ("+ ema" if self.ema_decay else "")
        return [{"layer": "sgd", "op": ("update " + what).strip(), "engine": "ours", "algo": "sgd_kernel",
                 "chunk": None, "chunks": 1, "workspace_bytes": 0}]
