"""The head's kernels (head.cu, head_weights.cu) as launches over one batch size: the launchers own the
grid math (Note [head latency] in head.cu).

    head = HeadLaunches(tensors, loss, n, group, per, part, sce, stream, side)
    head.forward_loss(); head.backward()       # a training step's head, loss included
"""

from __future__ import annotations

import numpy as np

from .. import params as P
from . import SoftmaxCE, kernel, pack_module, sm_count
from .launch import Launch

HEAD_GROUPS = (1, 2, 4, 8)       # the forward's images per block iteration (at most 8)
HEAD_PER = (256, 1024, 4096, 16384)   # the weight gradients' images per block (a range)
HEAD_SHAPES = tuple((g, p) for p in HEAD_PER for g in HEAD_GROUPS)
HEAD_MAX_RANGES = 64             # rows of partial sums kept (64 ranges of 16384 images: any batch a model takes)
HEAD_FWD_BLOCKS_PER_SM = 8       # at most this many forward blocks per SM (the loss keeps one sum per block)
BASE = P.OFFSETS["fc1.weight"]
WIDTH = P.OFFSETS["fc2.bias"] + P.SHAPES["fc2.bias"][0] - BASE   # fc1.weight .. fc2.bias, padding included


def shapes(n: int, heuristic: bool) -> list[tuple[int, int]]:
    """(group, per) launch shapes of our head at batch n: the heuristic's one (the smallest group that
    makes at most one forward block per SM, ranges of 256 images), or every shape whose ranges fit, one
    per range count. A search on an H100 (132 SMs) takes that group at 64 to 1024 images (1, 1, 2, 4, 8),
    and the head's step time with it against a group of half (two blocks per SM) is 43.1 / 55.0 us at
    256, 50.3 / 60.1 at 512, 61.9 / 71.7 at 1024 (train_step --algo exhaustive against heuristic)."""
    fits = [(g, p) for g, p in HEAD_SHAPES if -(-n // p) <= HEAD_MAX_RANGES]
    if heuristic:
        g = next((g for g in HEAD_GROUPS if -(-n // g) <= sm_count()), HEAD_GROUPS[-1])
        per = next((p for p in HEAD_PER if -(-n // p) <= HEAD_MAX_RANGES), HEAD_PER[-1])
        return [(g, per)]
    out, seen = [], set()
    for g, p in fits:   # one per (forward blocks, ranges): a larger group that makes no fewer blocks adds nothing
        key = (-(-n // g), -(-n // p))
        if key not in seen:
            seen.add(key)
            out.append((g, p))
    return out


def scratch(models: int = 1, max_batch: int | None = None):
    """(partial rows, the loss's per-block sums): what a head keeps, (HEAD_MAX_RANGES, WIDTH) rows for one
    model; for a pack of ``models``, each model's rows for the ranges of ``max_batch`` images at the
    smallest range (none where one range covers it: the gradients are written in place)."""
    import cupy

    if models == 1:
        rows = HEAD_MAX_RANGES
    else:   # one range writes the gradients in place: the buffer is then never read
        ranges = min(HEAD_MAX_RANGES, -(-max_batch // HEAD_PER[0]))
        rows = models * ranges if ranges > 1 else 1
    return (cupy.zeros((rows, WIDTH), cupy.float32),
            SoftmaxCE(HEAD_FWD_BLOCKS_PER_SM * sm_count(), models=models))


class HeadLaunches:
    """``forward()``: the logits; ``forward_loss()``: the logits, the loss and dlogits, and the data
    gradients dh1 and dx (masked by x > 0) in the same kernel; ``backward_given()``: from dlogits
    written by the caller (a loss of its own), the data gradients (the same kernel, its forward run
    again: the head's forward is a few microseconds), then ``backward()``: the weight and bias
    gradients on the side stream (Note [side stream] in lenet/plan.py), over ranges of ``per`` images
    (one range: written straight into the gradients; several: per-range rows added in order).
    ``t``: lenet.ops.HeadTensors; ``loss``: lenet.ops.LossTensors. A pack of ``models`` (Note [packs] in
    lenet/ops.py) launches the pack versions (head_common.cu), each model on its lone run's grid."""

    def __init__(self, t, loss, n: int, group: int, per: int, part, sce: SoftmaxCE, stream, side, models: int = 1):
        x, dx = t.x[:n], t.dx[:n]                                                # (n, 256)
        h1, dh1, logits, dlogits = t.h1[:n], t.dh1[:n], t.logits[:n], t.dlogits[:n]   # (n, 120) x 2, (n, 10) x 2
        w, K = t.w, models
        fwd, wts, red = (kernel(pack_module("head", K), "head_forward_kernel"),
                         kernel(pack_module("head_weights", K), "head_weights_kernel"),
                         kernel(pack_module("stage_reduce", K), "stage_reduce_kernel"))
        fgrid = min(max(1, -(-n // group)), sce.blocks)
        ranges = -(-n // per)
        if ranges > 1 and K * ranges > part.shape[0]:
            raise ValueError(f"{ranges} ranges of {per} images need more partial rows than the {part.shape[0]} kept")
        if K > sce.models:
            raise ValueError(f"the loss's scratch was made for {sce.models} models, the head runs {K}")
        off = {k: P.OFFSETS[k] - BASE for k in ("fc1.bias", "fc2.weight", "fc2.bias")}
        null, f0 = np.uint64(0), np.float32(0)
        per_model = hasattr(loss.label_smoothing, "data")   # a pack's label smoothings on the device
        stride = P.TOTAL if ranges == 1 else ranges * WIDTH   # floats between two models' rows of part
        pack = () if K == 1 else (np.int32(P.TOTAL), loss.label_smoothing if per_model else null, np.int64(stride))
        weights = (x, w["fc1.weight"], w["fc1.bias"], w["fc2.weight"], w["fc2.bias"], h1, logits, np.int32(n),
                   np.int32(group))
        plain = weights + (null,) * 8 + (f0, f0, f0, null, null) + pack
        given = weights + (null, dlogits) + (null,) * 6 + (f0, f0, f0, dh1, dx) + pack   # dlogits read, not computed
        training = weights + (loss.labels[:n], dlogits, loss.loss, loss.correct, sce.partial_loss, sce.partial_correct,
                              sce.ticket, loss.running, np.float32(1.0 / n), np.float32(1.0 / n),
                              np.float32(0.0 if per_model else loss.label_smoothing), dh1, dx) + pack
        rows = t.grads if ranges == 1 else part   # one range writes the gradients themselves (same layout)
        wargs = (x, h1, dh1, dlogits, rows, np.int32(WIDTH), np.int32(off["fc1.bias"]),
                 np.int32(off["fc2.weight"]), np.int32(off["fc2.bias"]), np.int32(n), np.int32(per)) + pack
        rargs = (part, t.grads, t.grads, np.int32(ranges), np.int32(WIDTH), np.int32(0), np.int32(P.TOTAL))
        beside = side.fits(120 * ranges * K)   # decided here, not at every call (Note [side stream])
        on = side.stream if beside else stream
        weights_ = Launch(wts, (120, ranges, K), (256,), wargs, on)
        reduced = Launch(red, (-(-WIDTH // 32), K), (256,), rargs, on) if ranges > 1 else None   # one range: no rows

        def gradients():
            weights_()
            if reduced is not None:
                reduced()

        def backward():   # beside the stage backwards while the grid leaves SMs idle
            if beside:
                side.run(gradients)
            else:
                gradients()
        self.forward = Launch(fwd, (fgrid, K), (256,), plain, stream)
        self.forward_loss = Launch(fwd, (fgrid, K), (256,), training, stream)
        self.backward = backward
        data_gradients = Launch(fwd, (fgrid, K), (256,), given, stream)

        def backward_given():
            data_gradients()
            backward()
        self.backward_given = backward_given
