"""The SGD update (our kernel, lenet/kernels/sgd.cu): one launch over the flat parameter buffer."""

from __future__ import annotations

from ..kernels import sgd_update


class SGD:
    """PyTorch's torch.optim.SGD rule with momentum and weight decay; lr read from device memory."""

    def __init__(self, momentum: float = 0.0, weight_decay: float = 0.0):
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)

    def __call__(self, model) -> None:
        with model.stream:
            sgd_update(model.params, model.grads, model.velocity, model.lr_dev, self.momentum, self.weight_decay)

    def describe(self) -> list[dict]:
        return [{"layer": "sgd", "op": "update", "engine": "ours", "algo": "sgd_kernel", "chunk": None,
                 "chunks": 1, "workspace_bytes": 0}]
