"""The network: its input, its classes, its two stages, the step's buffers, and its operations in order on
a model's buffers and weights."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from . import params as P
from .ops import (Head, HeadTensors, Loss, LossTensors, Stage, StageSpec, StageTensors, Update,
                  UpdateTensors, WholeStep)

CLASSES = 10
IMAGE = (1, 28, 28)
STAGES = (StageSpec("conv1", (1, 28, 28), (6, 1, 5, 5)), StageSpec("conv2", (6, 12, 12), (16, 6, 5, 5), dx=True))
# The step's buffers: name -> (shape of one image's rows, dtype). Gradients of the pooled outputs are
# masked by them (Note [relu at the pooled level] in lenet/engines/cudnn.py).
BUFFERS = {
    "x": ((1, 28, 28), np.float32),        # input, random until loaded
    "labels": ((), np.int32),
    "p1": ((6, 12, 12), np.float32),       # maxpool(relu(conv1 + bias))
    "p2": ((16, 4, 4), np.float32),        # maxpool(relu(conv2 + bias)) = flat (N, 256)
    "h1": ((120,), np.float32),            # relu(fc1 + bias)
    "logits": ((CLASSES,), np.float32),
    "logits_kept": ((CLASSES,), np.float32),   # the first view's, under test-time augmentation
    "dlogits": ((CLASSES,), np.float32),
    "dh1": ((120,), np.float32),
    "dp2": ((16, 4, 4), np.float32),       # masked by p2 > 0
    "dp1": ((6, 12, 12), np.float32),      # masked by p1 > 0
}


@dataclass
class Operations:
    """The network, in order: two stages, the head, the loss, the update; and all of them as one training
    step (unplanned: lenet/ops.py)."""

    stages: tuple
    head: Head
    head_unmasked: Head   # above a stage that masks dy itself
    loss_tensors: LossTensors
    loss: Loss
    update: Update
    step: WholeStep


def operations(buf: dict, weights, specs, max_batch: int, models: int, momentum, weight_decay, nesterov,
               label_smoothing, ema_decay) -> Operations:
    """The operations on a model's buffers (``buf``: BUFFERS, K N rows) and its weights (lenet.weights). conv1's
    input gradient is never computed: nothing needs it."""
    b, w, N, K = buf, weights, max_batch, models
    p, g = w.p, w.g
    stages = tuple(
        Stage(spec, StageTensors(x=b[x], y=b[y], dy=b["d" + y], dx=b["d" + x] if spec.dx else None,
                                 w=p[f"{spec.name}.weight"], b=p[f"{spec.name}.bias"], dw=g[f"{spec.name}.weight"],
                                 db=g[f"{spec.name}.bias"]), N, K)
        for spec, x, y in zip(specs, ("x", "p1"), ("p1", "p2")))
    loss_tensors = LossTensors(logits=b["logits"], dlogits=b["dlogits"], labels=b["labels"], loss=w.loss_dev,
                               correct=w.correct_dev, running=w.running_loss, label_smoothing=label_smoothing)
    fc = [k for k in P.NAMES if k.startswith("fc")]
    tensors = HeadTensors(x=b["p2"].reshape(K * N, 256), dx=b["dp2"].reshape(K * N, 256), h1=b["h1"], dh1=b["dh1"],
                          logits=b["logits"], dlogits=b["dlogits"], w={k: p[k] for k in fc}, g={k: g[k] for k in fc},
                          grads=w.grads[P.OFFSETS["fc1.weight"]: P.OFFSETS["fc2.bias"] + CLASSES])
    head = Head(tensors, loss_tensors, N, K)
    update = Update(UpdateTensors(w.params, w.grads, w.velocity, w.lr_dev, w.ema, momentum, weight_decay, nesterov,
                                  ema_decay, K, w.hyper))
    return Operations(stages, head, dataclasses.replace(head, dx_mask=False), loss_tensors, Loss(loss_tensors, N, K),
                      update, WholeStep(stages, loss_tensors, update.tensors, N, K))


def buffers(max_batch: int, models: int, seed: int, input_grad: bool) -> dict:
    """BUFFERS for K N rows, every one written (zeros) before any plan reads it: planning times candidates on
    them; the input random until loaded; with ``input_grad``, the images' gradient "dx" (N, 1, 28, 28)."""
    import cupy

    N, K = max_batch, models
    buf = {k: cupy.zeros((K * N, *shape), dtype) for k, (shape, dtype) in BUFFERS.items() if k != "x"}
    buf["x"] = cupy.random.default_rng(seed).standard_normal((K * N, *IMAGE), dtype=cupy.float32)
    if input_grad:
        buf["dx"] = cupy.zeros((N, *IMAGE), cupy.float32)   # the images' gradient
    return buf
