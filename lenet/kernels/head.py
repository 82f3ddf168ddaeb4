"""The head's kernels (head.cu, head_weights.cu) as launches over one batch size: the launchers own the
grid math (Note [head latency] in head.cu).

    head = HeadLaunches(tensors, loss, n, group, per, part, sce, stream, side)
    head.forward_loss(); head.backward()       # a training step's head, loss included
"""

from __future__ import annotations

import numpy as np

from .. import params as P
from . import SoftmaxCE, kernel, sm_count
from .launch import Launch

HEAD_GROUPS = (1, 2, 4, 8)       # the forward's images per block iteration (at most 8)
HEAD_PER = (256, 1024, 4096, 16384)   # the weight gradients' images per block (a range)
HEAD_SHAPES = tuple((g, p) for p in HEAD_PER for g in HEAD_GROUPS)
HEAD_MAX_RANGES = 64             # rows of partial sums kept (64 ranges of 16384 images: any batch a model takes)
HEAD_FWD_BLOCKS_PER_SM = 8       # at most this many forward blocks per SM (the loss keeps one sum per block)
BASE = P.OFFSETS["fc1.weight"]
WIDTH = P.OFFSETS["fc2.bias"] + P.SHAPES["fc2.bias"][0] - BASE   # fc1.weight .. fc2.bias, padding included


def shapes(n: int, heuristic: bool) -> list[tuple[int, int]]:
    """(group, per) launch shapes of our head at batch n: the heuristic's one (a group of 1 while that
    leaves no SM idle, ranges of 256 images), or every shape whose ranges fit, one per range count."""
    fits = [(g, p) for g, p in HEAD_SHAPES if -(-n // p) <= HEAD_MAX_RANGES]
    if heuristic:
        g = next((g for g in HEAD_GROUPS if -(-n // g) <= 2 * sm_count()), HEAD_GROUPS[-1])
        per = next((p for p in HEAD_PER if -(-n // p) <= HEAD_MAX_RANGES), HEAD_PER[-1])
        return [(g, per)]
    out, seen = [], set()
    for g, p in fits:   # one per (forward blocks, ranges): a larger group that makes no fewer blocks adds nothing
        key = (-(-n // g), -(-n // p))
        if key not in seen:
            seen.add(key)
            out.append((g, p))
    return out


def scratch():
    """(partial rows (HEAD_MAX_RANGES, WIDTH), the loss's per-block sums): what one model's head keeps."""
    import cupy

    return cupy.zeros((HEAD_MAX_RANGES, WIDTH), cupy.float32), SoftmaxCE(HEAD_FWD_BLOCKS_PER_SM * sm_count())


class HeadLaunches:
    """``forward()``: the logits; ``forward_loss()``: the logits, the loss and dlogits, and the data
    gradients dh1 and dx (masked by x > 0) in the same kernel; ``backward_given()``: from dlogits
    written by the caller (a loss of its own), the data gradients (the same kernel, its forward run
    again: the head's forward is a few microseconds), then ``backward()``: the weight and bias
    gradients on the side stream (Note [side stream] in lenet/plan.py), over ranges of ``per`` images
    (one range: written straight into the gradients; several: per-range rows added in order).
    ``t``: lenet.ops.HeadTensors; ``loss``: lenet.ops.LossTensors."""

    def __init__(self, t, loss, n: int, group: int, per: int, part, sce: SoftmaxCE, stream, side):
        x, dx = t.x[:n], t.dx[:n]                                                # (n, 256)
        h1, dh1, logits, dlogits = t.h1[:n], t.dh1[:n], t.logits[:n], t.dlogits[:n]   # (n, 120) x 2, (n, 10) x 2
        w = t.w
        fwd, wts, red = (kernel("head", "head_forward_kernel"), kernel("head_weights", "head_weights_kernel"),
                         kernel("stage_reduce", "stage_reduce_kernel"))
        fgrid = min(max(1, -(-n // group)), sce.blocks)
        ranges = -(-n // per)
        if ranges > part.shape[0]:
            raise ValueError(f"{ranges} ranges of {per} images need more partial rows than the {part.shape[0]} kept")
        off = {k: P.OFFSETS[k] - BASE for k in ("fc1.bias", "fc2.weight", "fc2.bias")}
        null, f0 = np.uint64(0), np.float32(0)
        weights = (x, w["fc1.weight"], w["fc1.bias"], w["fc2.weight"], w["fc2.bias"], h1, logits, np.int32(n),
                   np.int32(group))
        plain = weights + (null,) * 8 + (f0, f0, f0, null, null)
        given = weights + (null, dlogits) + (null,) * 6 + (f0, f0, f0, dh1, dx)   # dlogits read, not computed
        training = weights + (loss.labels[:n], dlogits, loss.loss, loss.correct, sce.partial_loss, sce.partial_correct,
                              sce.ticket, loss.running, np.float32(1.0 / n), np.float32(1.0 / n),
                              np.float32(loss.label_smoothing), dh1, dx)
        rows = t.grads if ranges == 1 else part   # one range writes the gradients themselves (same layout)
        wargs = (x, h1, dh1, dlogits, rows, np.int32(WIDTH), np.int32(off["fc1.bias"]),
                 np.int32(off["fc2.weight"]), np.int32(off["fc2.bias"]), np.int32(n), np.int32(per))
        rargs = (part, t.grads, t.grads, np.int32(ranges), np.int32(WIDTH), np.int32(0), np.int32(0))
        beside = side.fits(120 * ranges)   # decided here, not at every call (Note [side stream])
        on = side.stream if beside else stream
        weights_ = Launch(wts, (120, ranges), (256,), wargs, on)
        reduced = Launch(red, (-(-WIDTH // 32),), (256,), rargs, on) if ranges > 1 else None   # one range: no rows

        def gradients():
            weights_()
            if reduced is not None:
                reduced()

        def backward():   # beside the stage backwards while the grid leaves SMs idle
            if beside:
                side.run(gradients)
            else:
                gradients()
        self.forward = Launch(fwd, (fgrid,), (256,), plain, stream)
        self.forward_loss = Launch(fwd, (fgrid,), (256,), training, stream)
        self.backward = backward
        data_gradients = Launch(fwd, (fgrid,), (256,), given, stream)

        def backward_given():
            data_gradients()
            backward()
        self.backward_given = backward_given
