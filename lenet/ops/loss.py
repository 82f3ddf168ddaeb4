"""Softmax cross-entropy (our kernel, lenet/kernels/softmax_ce.cu), planned per batch size. Where the
head runs on our kernels, a training step's loss comes out of the head's forward instead (Note [head
engines] in lenet/ops/fc.py); evaluation always runs it here."""

from __future__ import annotations

from dataclasses import dataclass

from ..kernels import SoftmaxCE


@dataclass(frozen=True)
class LossTensors:
    """What the loss reads and writes: labels (N,) int32; loss (1,) the mean loss of the last training
    forward, or the summed loss of an evaluation; correct (1,) int32 right answers; running (1,) the
    sum of step losses since its reset; label_smoothing, PyTorch's cross_entropy(label_smoothing=)."""

    logits: object
    dlogits: object
    labels: object
    loss: object
    correct: object
    running: object
    label_smoothing: float = 0.0


class SoftmaxCrossEntropy:
    def __init__(self, tensors: LossTensors, stream):
        self.t, self.stream = tensors, stream
        self.sce = SoftmaxCE()

    def plan(self, n: int) -> "PlannedLoss":
        return PlannedLoss(self, n)


class PlannedLoss:
    """``train()``: the mean loss (label-smoothed) into ``loss``, dlogits, and the running sum;
    ``evaluate()``: the summed plain loss and right answers added to the device totals, scored on the
    mean of the logits and ``mean_with`` when given."""

    workspace_bytes = 0

    def __init__(self, op: SoftmaxCrossEntropy, n: int):
        t = op.t
        self.n, self.t, self.sce, self.stream = n, t, op.sce, op.stream
        self.logits, self.labels, self.dlogits = t.logits[:n], t.labels[:n], t.dlogits[:n]

    def train(self) -> None:
        t, n = self.t, self.n
        with self.stream:
            self.sce.forward_backward(self.logits, self.labels, self.dlogits, t.loss, t.correct, n,
                                      grad_scale=1.0 / n, loss_scale=1.0 / n, running=t.running,
                                      label_smoothing=t.label_smoothing)

    def evaluate(self, mean_with=None) -> None:
        t, n = self.t, self.n
        with self.stream:
            self.sce.forward_backward(self.logits, self.labels, None, t.loss, t.correct, n,
                                      grad_scale=1.0 / n, loss_scale=1.0, accumulate=True, mean_with=mean_with)

    def describe(self) -> list[dict]:
        return [{"layer": "loss", "op": "softmax-CE fwd+bwd", "engine": "ours", "algo": "softmax_ce_kernel",
                 "chunk": self.n, "chunks": 1, "workspace_bytes": 0}]
