"""A model's evaluation: forward only, the summed loss and the right answers totalled on the device, over
a whole GPU-resident split at once (one CUDA graph with every batch, its gather and the totals), on the
weights' moving average when one is kept, optionally with test-time augmentation."""

from __future__ import annotations

from .kernels import device_copy, fill


class Evaluation:
    """Over a model's plans (lenet.steps.Plans), input rows (lenet.inputs.Inputs) and state on the device
    (lenet.weights.Weights), run by ``runner`` (lenet/runner.py; captured with ``cuda_graph``)."""

    def __init__(self, plans, inputs, weights, runner, cuda_graph: bool):
        self.plans, self.inputs, self.weights, self.runner, self.cuda_graph = plans, inputs, weights, runner, cuda_graph
        self.slots, self.stream, self.buf = inputs.slots, inputs.stream, inputs.buf

    def begin(self) -> None:
        with self.stream:
            fill(self.weights.loss_dev, 0)
            fill(self.weights.correct_dev, 0)

    def batch(self, n: int) -> None:
        """Forward only on the loaded batch of n; adds its summed loss and right answers to the totals."""
        step = self.plans.plan_forward(n)
        step.forward()
        step.loss.evaluate()

    def end(self):
        """(summed loss, right answers) since ``begin``; synchronizes. A pack's: two arrays (K,)."""
        self.stream.synchronize()
        return self.slots.totals(self.weights.loss_dev, self.weights.correct_dev)

    def evaluate(self, dataset, batch: int = 1000, tta: bool = False) -> tuple:
        """(mean loss, accuracy) over ``dataset`` (lenet.LeNet.evaluate); a pack's: arrays (K,)."""
        if not 1 <= batch:
            raise ValueError(f"evaluation batch size must be >= 1, got {batch}")
        batch = min(batch, self.plans.max_batch, dataset.size)
        sizes = [min(batch, dataset.size - s) for s in range(0, dataset.size, batch)]
        for n in set(sizes):   # planned first: planning must not be captured
            self.plans.plan_forward(n)
        # The key holds the dataset: its graph reads the dataset's buffers, which must outlive it.
        self.runner.run(("eval", dataset, batch, bool(tta)), lambda: self._run(dataset, batch, sizes, tta),
                        self.cuda_graph)
        loss_sum, correct = self.end()   # a pack's: arrays (K,)
        return loss_sum / dataset.size, correct / dataset.size

    def _run(self, dataset, batch: int, sizes: list, tta: bool) -> None:
        """Every batch of the split, forward only, into the totals (what the runner captures)."""
        w, buf = self.weights, self.buf
        self.begin()
        if w.ema is not None:
            with self.stream:
                device_copy(w.params_aside, w.params)
                device_copy(w.params, w.ema)
        for start, n in zip(range(0, dataset.size, batch), sizes):
            step, rows = self.plans.plan_forward(n), self.slots.models * n
            self.slots.gather_eval(self.inputs, dataset, start, n, False)
            step.forward()
            if tta:
                with self.stream:
                    device_copy(buf["logits_kept"][:rows], buf["logits"][:rows])
                self.slots.gather_eval(self.inputs, dataset, start, n, True)
                step.forward()
            step.loss.evaluate(buf["logits_kept"][:rows] if tta else None)
        if w.ema is not None:
            with self.stream:
                device_copy(w.params, w.params_aside)
