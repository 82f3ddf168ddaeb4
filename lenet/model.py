"""LeNet-5 as a list of planned operations on one CUDA stream.

    x (N,1,28,28)
    conv1 6@5x5 + bias -> ReLU -> maxpool 2x2/2     (N,6,12,12)
    conv2 16@5x5 + bias -> ReLU -> maxpool 2x2/2    (N,16,4,4)
    flatten 256 -> fc1 120 + bias -> ReLU -> fc2 10 + bias  (N,10)
    softmax cross-entropy, mean over the batch

Everything a step touches is made once, at construction, for ``max_batch``: every activation and
gradient buffer (BUFFERS), the flat parameter / gradient / velocity buffers. A batch of n <= max_batch
images uses the first n rows of each buffer and a Step made for n on first use (or by ``plan(n)``): each
operation (lenet/ops.py) planned for n by the model's planner (lenet/plan.py), which chooses the engine
and its candidates by measurement. A step then allocates nothing, never waits for the host and branches
on no device value, so lenet/runner.py can capture it in a CUDA graph and replay it (``cuda_graph=True``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from descriptors import Handle
from descriptors.algorithms import free_memory

# Re-exported where callers have long found them: the checks before any GPU work, the network's shapes.
from .checks import (bytes_per_image, check_batch, check_memory, check_pack, models_that_fit,  # noqa: F401
                     policy_of, settings_of)
from .engines import Policy
from .evaluation import Evaluation
from .inputs import Inputs
from .network import BUFFERS, CLASSES, IMAGE, STAGES, buffers, operations  # noqa: F401
from .plan import Planner
from .runner import Runner
from .slots import slots_for
from .steps import Plans, Step
from .weights import Weights


def _store(handle, plan_cache):
    """The on-disk store of choices (lenet/plancache.py): True for the default file, or a path (or None)."""
    if not plan_cache:
        return None
    from . import plancache

    return plancache.open_cache(handle, path=None if plan_cache is True else plan_cache)


class LeNet:
    """The network, its parameters and its optimizer state, on one CUDA stream.

    >>> model = LeNet(max_batch=64, seed=0)
    >>> model.train_step(x, y, lr=0.01)   # queued on model.stream; returns the device loss (1,)
    >>> model.loss()                      # waits for the stream, then reads it

    The device scalar lives on the model's own (non-blocking) stream: read it with ``loss()``, or
    after ``model.stream.synchronize()``; CuPy's default stream does not wait for it. ``policy``
    (lenet.engines.Policy) says which engines compete and how; ``fused``, when given, overrides its fusion.
    Its parts: the checks (lenet/checks.py), one model or a pack (lenet/slots.py), the state on the device
    and its host views (lenet/weights.py), the operations (lenet/network.py) and their plans per batch size
    (lenet/steps.py).
    """

    def __init__(self, max_batch: int = 64, *, policy: Policy | None = None, seed=0,
                 momentum=0.0, weight_decay=0.0, nesterov=False, label_smoothing=0.0, ema_decay=None,
                 stream=None, cuda_graph: bool = False, fused: bool | None = None, plan_cache=False,
                 input_grad: bool = False, models: int = 1, keep_average: bool = False):
        if not isinstance(max_batch, (int, np.integer)) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        # A pack of K > 1: Note [packs] in lenet/ops.py; each setting one or K values.
        self.settings = settings_of(models, seed=seed, momentum=momentum, weight_decay=weight_decay,
                                    nesterov=nesterov, label_smoothing=label_smoothing, ema_decay=ema_decay)
        self.slots = slots_for(self.settings, keep_average, input_grad)
        self.models, self.keep_average = self.slots.models, bool(keep_average)
        from descriptors import require_gpu

        from .kernels import require_arch

        require_arch(require_gpu())   # one line (NoGpuError) where there is none or it is too old

        self.max_batch, self.policy, self.cuda_graph = int(max_batch), policy_of(policy, fused), bool(cuda_graph)
        # With ``input_grad``, conv1 also computes the images' gradient (buf["dx"]: lenet.torch asks for it).
        self.input_grad = bool(input_grad)
        self.specs = (dataclasses.replace(STAGES[0], dx=True, dx_mask=False), *STAGES[1:]) if input_grad else STAGES
        # Before allocating; CuPy's cached blocks count as free (a model made beside the data for other sizes and
        # dropped, Note [the model beside the data] in lenet/train.py, leaves its blocks there).
        check_memory(self.max_batch, *free_memory(), self.policy, self.models)
        self.handle = Handle(stream)
        self.stream = self.handle.stream
        self.plan_cache = _store(self.handle, plan_cache)
        self.planner = Planner(self.handle, self.policy, max_batch=self.max_batch, store=self.plan_cache,
                               captured=self.cuda_graph)
        with self.stream:
            self.weights = w = Weights(self.slots, self.stream)
            self.buf = buffers(self.max_batch, self.models, self.settings["seed"][0], self.input_grad)
        # The state's buffers under their names of old (what lenet.torch, lenet.pack and the tests read).
        self.params, self.grads, self.velocity, self.ema, self.params_aside = (
            w.params, w.grads, w.velocity, w.ema, w.params_aside)
        self.p, self.g, self.lr_dev, self.loss_dev, self.correct_dev, self.running_loss = (
            w.p, w.g, w.lr_dev, w.loss_dev, w.correct_dev, w.running_loss)
        self.hyper, self.label_smoothing_dev = w.hyper, w.label_smoothing_dev
        self.operations = ops = operations(self.buf, w, self.specs, self.max_batch, self.models,
                                           *self.slots.update_constants(w.label_smoothing_dev, w.ema is not None))
        self.stages, self.head, self.head_unmasked, self.loss_tensors = ops.stages, ops.head, ops.head_unmasked, \
            ops.loss_tensors
        self.loss_op, self.update_op = ops.loss, ops.update
        self.sgd = self.planner.plan(self.update_op, 0)
        self.runner = Runner(self.stream, self.planner.ctx.workspace, w.save, w.restore)
        self.plans = Plans(self.planner, ops, self.max_batch, self.plan_cache, self.sgd, superseded=self.runner.clear)
        self.inputs = Inputs(self.buf, w.lr_dev, self.stream, self.slots, self.max_batch)
        self.evaluation = Evaluation(self.plans, self.inputs, w, self.runner, self.cuda_graph)

    # ------------------------------------------------------------------ plans

    @property
    def workspace(self):
        return self.planner.ctx.workspace

    @property
    def blas(self):
        return self.planner.ctx.blas

    @property
    def fused(self) -> bool:
        return self.policy.fused

    def plan(self, n: int) -> Step:
        """Every operation planned for batch size n (made once, then cached; an evaluation's graph captured
        with a forward-only Step of n is captured again with this one: Plans.plan)."""
        return self.plans.plan(n)

    def planned(self, n: int) -> bool:
        """Whether batch size n is planned for training (a step of it would not search)."""
        return self.plans.planned(n)

    def plan_forward(self, n: int) -> Step:
        """What an evaluation at batch size n runs: the training Step where n has one, else the operations
        planned forward only (Note [forward-only plans] in lenet/ops.py)."""
        return self.plans.plan_forward(n)

    def set_policy(self, policy: Policy, fused: bool | None = None) -> None:
        """Choose every operation again under ``policy`` (and ``fused``, when given) for every
        planned batch size."""
        self.policy = self.planner.policy = policy_of(policy, fused)
        self.runner.clear()
        self.plans.replan()

    def set_fused(self, fused: bool) -> None:
        """Let (or stop letting) the operations fuse: our fused kernels, conv+bias+ReLU, cuBLASLt epilogues."""
        self.set_policy(self.policy, fused)

    def describe(self, n: int | None = None) -> list[dict]:
        """One row per planned operation at batch n: engine, plan or algorithm, chunk, time, workspace."""
        return self.plan(self.max_batch if n is None else n).describe() + self.sgd.describe()

    def close(self) -> None:
        """Free what the engines made for this model (cuDNN's descriptors and graphs) now, not at exit."""
        self.plans.clear()
        self.runner.clear()
        self.planner.close()
        self.handle.close()

    # ------------------------------------------------------------------ data (lenet/inputs.py)

    @property
    def n(self) -> int:
        """Images per model in the input rows now."""
        return self.inputs.n

    @n.setter
    def n(self, n: int) -> None:
        self.inputs.n = n

    def load_batch(self, x, y) -> int:
        """Validate a batch (NumPy or CuPy) and copy it into the input buffers; return n."""
        return self.inputs.load_batch(x, y)

    def load_from(self, dataset, order, start: int, n: int, lr: float | None = None, augment=None,
                  epoch: int = 0) -> None:
        """Gather batch order[start:start+n] of a GPU-resident dataset into the input buffers
        (one launch, no host wait), augmented by ``augment`` (lenet.kernels.Augment) with the
        draws of ``epoch``; also sets the learning rate when lr is given."""
        self.inputs.load_from(dataset, order, start, n, lr, augment, epoch)

    def load_pack(self, dataset, orders, start: int, n: int, aug, epochs, lr_table, lr_at, step: int) -> None:
        """A pack's batch (lenet.kernels.gather_pack): model m's images orders[m, start:start+n] of a
        GPU-resident dataset, augmented by aug[m] with the draws of epochs[m], and its learning rate
        lr_table[lr_at[m] + step]; one launch, no host wait."""
        self.inputs.load_pack(dataset, orders, start, n, aug, epochs, lr_table, lr_at, step)

    def set_lr(self, lr) -> None:
        """The learning rate the next updates take: one number, or a pack's one per model."""
        self.inputs.set_lr(lr)

    def reset_running_loss(self, value=0.0) -> None:
        """Set the running sum of step losses (0, or a resumed epoch's sum so far; a pack's: one value, or one
        per model, which waits for the stream)."""
        self.slots.reset_running_loss(self.running_loss, value, self.stream)

    def read_running_loss(self) -> float:
        """Sum of the step losses since the last reset (synchronizes)."""
        self.stream.synchronize()
        return float(self.running_loss.get()[0])

    # ------------------------------------------------------------------ the step

    def forward(self, n: int | None = None):
        """Forward pass and loss on the loaded batch; returns the device loss (1,).

        dlogits is written too, ready for backward().
        """
        step = self.plan(self.n if n is None else n)
        step.forward_loss()
        step.side.join()   # the loss's total may be added beside the step (lenet.engines.context.SideStream)
        return self.loss_dev

    def backward(self, n: int | None = None) -> None:
        """Gradients of the mean loss into ``grads`` (needs the forward of the same batch)."""
        self.plan(self.n if n is None else n).backward()

    def update(self, lr: float | None = None) -> None:
        """One SGD update of every parameter from ``grads`` (momentum, weight decay as built)."""
        self.inputs.take_lr(lr)
        self.sgd()

    def _train(self, step: Step) -> None:
        step.train()

    def step(self, n: int | None = None, lr: float | None = None):
        """forward + backward + SGD on the batch already in the input buffers; returns the
        device loss of the forward. With cuda_graph, replays the step captured for n."""
        n = self.n if n is None else n
        self.inputs.take_lr(lr)
        step = self.plan(n)
        self.runner.run(("train", n), lambda: self._train(step), self.cuda_graph)
        return self.loss_dev

    def train_step(self, x, y, lr: float):
        """Load a batch (validated), run one SGD step; returns the device loss before the update."""
        n = self.load_batch(x, y)
        return self.step(n, lr)

    # ------------------------------------------------------------------ evaluation (lenet/evaluation.py)

    def evaluate_begin(self) -> None:
        self.evaluation.begin()

    def evaluate_batch(self, n: int | None = None) -> None:
        """Forward only; adds the batch's summed loss and right answers to the device totals."""
        self.evaluation.batch(self.n if n is None else n)

    def evaluate_end(self):
        """(summed loss, right answers) since evaluate_begin; synchronizes. A pack's: two arrays (K,)."""
        return self.evaluation.end()

    def evaluate(self, dataset, batch: int = 1000, tta: bool = False) -> tuple[float, float]:
        """(mean loss, accuracy) over a whole GPU-resident split, forward only, with the moving
        average of the weights when the model keeps one. With ``tta`` (test-time augmentation),
        each image is scored on the mean of its logits and its left-right mirror's. Every batch,
        its gather and the totals run as one CUDA graph (with cuda_graph), and the host waits
        once, for the totals."""
        return self.evaluation.evaluate(dataset, batch, tta)

    # ------------------------------------------------------------------ host views

    def loss(self):
        """The loss of the last forward, read from the device (synchronizes); a pack's, an array (K,)."""
        self.stream.synchronize()
        return self.slots.loss(self.loss_dev)

    def logits(self) -> np.ndarray:
        self.stream.synchronize()
        return self.buf["logits"][: self.n].get()

    def state_dict(self, model: int | None = None) -> dict[str, np.ndarray]:
        """Parameters as host arrays under PyTorch's names and shapes (a pack's: of one model)."""
        return self.weights.state_dict(model)

    def grad_dict(self, model: int | None = None) -> dict[str, np.ndarray]:
        return self.weights.grad_dict(model)

    def eval_state_dict(self, model: int | None = None) -> dict[str, np.ndarray]:
        """The weights evaluation and export use: the moving average when kept, else the parameters."""
        return self.weights.eval_state_dict(model)

    def flat_state(self, model: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(parameters, momentum buffer, moving average or None) as flat host arrays: what a
        checkpoint holds; of every model of a pack, (K TOTAL,) each, or of ``model`` alone."""
        return self.weights.flat_state(model)

    def load_flat(self, params_flat: np.ndarray, velocity_flat: np.ndarray, ema_flat: np.ndarray | None = None) -> None:
        """Load a checkpoint's flat buffers. Without ``ema_flat`` a model that keeps a moving
        average starts it at the parameters."""
        self.weights.load_flat(params_flat, velocity_flat, ema_flat)

    def load_state_dict(self, state: dict) -> None:
        """Load parameters (PyTorch names and shapes; NumPy or torch CPU tensors)."""
        self.weights.load_state_dict(state)

    def set_model(self, model: int, **config) -> None:
        """Model ``model`` of a pack starts again (lenet.pack's slots): the initialization of ``seed``, a
        zero momentum buffer, its average at the weights, and its own constants (keywords seed, momentum,
        weight_decay, nesterov, label_smoothing, ema_decay). Waits for the stream."""
        self.weights.restart(model, **config)
