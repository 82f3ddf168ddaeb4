"""Softmax cross-entropy (our kernel, lenet/kernels/softmax_ce.cu), planned per batch size."""

from __future__ import annotations


class SoftmaxCrossEntropy:
    def plan(self, model, n: int) -> "PlannedLoss":
        return PlannedLoss(model, n)


class PlannedLoss:
    """``train()``: the mean loss (label-smoothed as the model says) into model.loss_dev, dlogits,
    and the running sum; ``evaluate()``: the summed plain loss and right answers added to the
    device totals, scored on the mean of the logits and ``mean_with`` when given."""

    workspace_bytes = 0

    def __init__(self, model, n: int):
        self.n, self.m = n, model
        self.logits, self.labels = model.buf["logits"][:n], model.buf["labels"][:n]
        self.dlogits = model.buf["dlogits"][:n]

    def train(self) -> None:
        m, n = self.m, self.n
        with m.stream:
            m.sce.forward_backward(self.logits, self.labels, self.dlogits, m.loss_dev, m.correct_dev, n,
                                   grad_scale=1.0 / n, loss_scale=1.0 / n, running=m.running_loss,
                                   label_smoothing=m.label_smoothing)

    def evaluate(self, mean_with=None) -> None:
        m, n = self.m, self.n
        with m.stream:
            m.sce.forward_backward(self.logits, self.labels, None, m.loss_dev, m.correct_dev, n,
                                   grad_scale=1.0 / n, loss_scale=1.0, accumulate=True, mean_with=mean_with)

    def describe(self) -> list[dict]:
        return [{"layer": "loss", "op": "softmax-CE fwd+bwd", "engine": "ours", "algo": "softmax_ce_kernel",
                 "chunk": self.n, "chunks": 1, "workspace_bytes": 0}]
