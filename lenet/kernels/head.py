"""The head's kernels (head.cu, head_weights.cu) as launches over one batch size: the launchers own the
grid math (Note [head latency] in head.cu).

    head = HeadLaunches(tensors, loss, n, HeadShape(form, group, per), part, sce, stream, side)
    head.forward_loss(); head.backward()       # a training step's head, loss included

Two versions of the forward: head.cu's (one block runs an image group's whole head) and head_split.cu's
(fc1 over 15 blocks a slice of images, then fc2, the loss and the data gradients over 8: Note [head
split]), with the same outputs bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import params as P
from . import SoftmaxCE, kernel, pack_module, sm_count
from .launch import Launch, resident

HEAD_GROUPS = (1, 2, 4, 8)       # the forward's images per block iteration (at most 8)
SPLIT_GROUPS = (1, 2, 4, 8, 16)  # the split forward's images a slice (at most HS_MAXG = 16)
SPLIT_MAX_BATCH = 2048           # the split forward is a candidate up to this batch
SPLIT_UNIT_BLOCKS = 15           # the split forward's fc1 blocks a slice (8 hidden units each)
HEAD_PER = (256, 1024, 4096, 16384)   # the weight gradients' images per block (a range)
HEAD_SHAPES = tuple(("block", g, p) for p in HEAD_PER for g in HEAD_GROUPS) + \
    tuple(("split", g, p) for p in HEAD_PER for g in SPLIT_GROUPS)
HEAD_MAX_RANGES = 64             # rows of partial sums kept (64 ranges of 16384 images: any batch a model takes)
HEAD_FWD_BLOCKS_PER_SM = 8       # at most this many forward blocks per SM (the loss keeps one sum per block)
BASE = P.OFFSETS["fc1.weight"]
WIDTH = P.OFFSETS["fc2.bias"] + P.SHAPES["fc2.bias"][0] - BASE   # fc1.weight .. fc2.bias, padding included


@dataclass(frozen=True)
class HeadShape:
    """Our head's launch shape: its form, "block" (head.cu's forward: a block runs an image group's
    head), "split" (head_split.cu's: fc1 and the rest over many blocks) or "tail" (fc1 and its gradient
    products on cuBLASLt, the rest in head_tail.cu: Note [head tail]); ``group``, the images per block
    iteration (a slice of the split form), or the tail's blocks per SM; ``per``, the weight gradients'
    images per range (0 for the tail, which sums its own). ``engine``: the engine that offers it as a
    planner's candidate (set by that engine; not part of the shape)."""

    form: str
    group: int
    per: int
    engine: str = field(default="", compare=False)

    @property
    def split(self) -> bool:
        return self.form == "split"

    @property
    def name(self) -> str:
        if self.form == "tail":
            return f"fused head tail g{self.group} (fc1 on cuBLASLt)"
        return f"fused head {'split ' if self.split else ''}g{self.group} w{self.per}"

    def encode(self) -> dict:
        return {"form": self.form, "group": self.group, "per": self.per}

    @classmethod
    def decode(cls, stored: dict) -> "HeadShape | None":
        """The shape a stored choice names (None for one of a form this version has not)."""
        form = stored.get("form")
        if form not in FORMS:
            return None
        return cls(form, int(stored["group"]), int(stored["per"]))


FORMS = ("block", "split", "tail")
TAIL_BLOCKS_PER_SM = (2, 1)   # the tail's grids a search times (2: what its registers let an SM hold)
TAIL_MIN_BATCH = 256          # the tail form is a candidate from this batch on
TAIL_HEURISTIC_MIN = 257      # ... and the heuristic's first from this one (shapes: the measurement)
TAIL_WARPS = 8                # head_tail.cu's HT_WARPS: images a block has in flight
TAIL_WIDTH = P.OFFSETS["fc2.bias"] + P.SHAPES["fc2.bias"][0] - P.OFFSETS["fc1.bias"]   # db1 .. db2, padded


def tail_blocks(n: int, per_sm: int, models: int = 1) -> int:
    """The tail kernel's grid at batch n, per model: a pack of ``models`` shares one wave, as the stages'
    grids do (Note [one wave for a pack] in lenet/kernels/stages.py); a pack that sums as its lone runs
    passes 1 (each model on its lone run's grid)."""
    return max(1, min(-(-n // TAIL_WARPS), per_sm * sm_count() // models))


SPLIT_HEURISTIC_MAX = 256   # the heuristic takes the split forward up to this batch
SPLIT_SLICES_PER_SM = 0.25  # ... in the smallest slices that make at most this many slices per SM


def shapes(n: int, heuristic: bool, models: int = 1) -> list[HeadShape]:
    """Launch shapes of our head at batch n: the heuristic's, or every shape whose ranges fit, one per
    (form, forward blocks, ranges), and from TAIL_MIN_BATCH images (a pack's ``models`` times n) the
    tail's grids. The heuristic: ranges of 256 images; up to SPLIT_HEURISTIC_MAX
    images the split forward in the smallest slices that make at most one slice per 4 SMs (the first
    kernel 15 blocks a slice, the second 8), else head.cu's with the smallest group that makes at most
    one forward block per SM; from TAIL_HEURISTIC_MIN images (a pack's all) the tail form first (Note [head
    tail] in head_tail.cu), head.cu's its fallback (where cuBLASLt cannot run the tail's products). Measured
    on whole steps (scripts/probes/head_split.py): docs/kernels.md, "The head"."""
    sms = sm_count()
    if heuristic:
        per = next((p for p in HEAD_PER if -(-n // p) <= HEAD_MAX_RANGES), HEAD_PER[-1])
        if n <= SPLIT_HEURISTIC_MAX:
            g = next((g for g in SPLIT_GROUPS if -(-n // g) <= SPLIT_SLICES_PER_SM * sms), SPLIT_GROUPS[-1])
            ours = HeadShape("split", g, per)
        else:
            g = next((g for g in HEAD_GROUPS if -(-n // g) <= sms), HEAD_GROUPS[-1])
            ours = HeadShape("block", g, per)
        if models * n < TAIL_HEURISTIC_MIN:
            return [ours]
        return [HeadShape("tail", TAIL_BLOCKS_PER_SM[0], 0), ours]   # ours: where cuBLASLt cannot run the tail
    out, seen = [], set()
    tails = tuple(("tail", g, 0) for g in TAIL_BLOCKS_PER_SM) if models * n >= TAIL_MIN_BATCH else ()
    for form, g, p in HEAD_SHAPES + tails:   # a shape that makes the same grids as one before adds nothing
        if form != "tail" and (-(-n // p) > HEAD_MAX_RANGES or (form == "split" and not split_fits(n, g))):
            continue
        key = (form, tail_blocks(n, g)) if form == "tail" else (form, -(-n // g), -(-n // p))
        if key not in seen:
            seen.add(key)
            out.append(HeadShape(form, g, p))
    return out


def split_fits(n: int, group: int) -> bool:
    """Whether the split forward runs n images in slices of ``group``: up to SPLIT_MAX_BATCH images, one
    part of the loss a slice (at most HEAD_FWD_BLOCKS_PER_SM per SM, what the loss's scratch holds)."""
    return n <= SPLIT_MAX_BATCH and -(-n // group) <= HEAD_FWD_BLOCKS_PER_SM * sm_count()


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
    gradients dh1 and dx (masked by x > 0); ``backward_given()``: from dlogits written by the caller (a
    loss of its own), the data gradients (the forward run again first: it is a few microseconds), then
    ``backward()``: the weight and bias gradients on the side stream (Note [side stream] in
    lenet/engines/context.py), over ranges of ``per`` images (one range: written straight into the gradients;
    several: per-range rows added in order). head.cu's version runs each of these forwards in one
    kernel, head_split.cu's in two (fc1, then fc2, the loss and the data gradients: Note [head split]),
    with, in training, a third beside the step that adds the slices' loss sums (lane 1 of the side
    stream: Note [the loss beside the step]).
    ``t``: lenet.ops.HeadTensors; ``loss``: lenet.ops.LossTensors. A pack of ``models`` (Note [packs] in
    lenet/ops.py) launches the pack versions (head_common.cu), each model on its lone run's grid."""

    masks_dx = True   # dx masked by x > 0 in the block and split forms' own kernels, always

    def __init__(self, t, loss, n: int, shape: HeadShape, part, sce: SoftmaxCE, stream, side, models: int = 1):
        K, ranges = models, -(-n // shape.per)
        if ranges > 1 and K * ranges > part.shape[0]:
            raise ValueError(f"{ranges} ranges of {shape.per} images need more partial rows than the "
                             f"{part.shape[0]} kept")
        if K > sce.models:
            raise ValueError(f"the loss's scratch was made for {sce.models} models, the head runs {K}")
        stride = P.TOTAL if ranges == 1 else ranges * WIDTH   # floats between two models' rows of part
        pack = _pack_args(loss, K, stride)
        forms = self._split_forms if shape.split else self._block_forms
        self.forward, self.forward_loss, data_gradients = forms(t, loss, n, shape.group, sce, stream, side, K, pack)
        gradients, beside = self._weight_gradients(t, n, shape.per, ranges, part, stream, side, K, pack)

        def backward():   # beside the stage backwards while the grid leaves SMs idle
            if beside:
                side.run(gradients)
            else:
                gradients()

        def backward_given():
            data_gradients()
            backward()
        self.backward, self.backward_given = backward, backward_given

    @staticmethod
    def _split_forms(t, loss, n: int, group: int, sce, stream, side, K: int, pack):
        """head_split.cu's (forward, forward_loss, data gradients): fc1 over SPLIT_UNIT_BLOCKS blocks a slice
        of ``group`` images, then fc2, the loss and the data gradients (Note [head split])."""
        x, dx, h1, dh1, logits, dlogits, w = (t.x[:n], t.dx[:n], t.h1[:n], t.dh1[:n], t.logits[:n], t.dlogits[:n],
                                             t.w)
        null, f0 = np.uint64(0), np.float32(0)
        scales = (np.float32(1.0 / n), np.float32(1.0 / n), _smoothing(loss))
        slices = -(-n // group)
        if not split_fits(n, group):
            raise ValueError(f"the split head runs at most {SPLIT_MAX_BATCH} images in at most "
                             f"{HEAD_FWD_BLOCKS_PER_SM * sm_count()} slices, not {n} in slices of {group}")
        hidden, out = (kernel(pack_module("head_split", K), "head_split_hidden_kernel"),
                       kernel(pack_module("head_split", K), "head_split_out_kernel"))
        outs = (x, w["fc1.weight"], w["fc2.weight"], w["fc2.bias"], h1, logits, np.int32(n), np.int32(group))
        plain = outs + (null,) * 6 + (null, f0, f0, f0, null, null) + pack
        given = outs + (null, dlogits) + (null,) * 4 + (null, f0, f0, f0, dh1, dx) + pack
        training = outs + (loss.labels[:n], dlogits, loss.loss, loss.correct, sce.partial_loss, sce.partial_correct,
                           loss.running) + scales + (dh1, dx) + pack
        fc1 = Launch(hidden, (SPLIT_UNIT_BLOCKS, slices, K), (256,),
                     (x, w["fc1.weight"], w["fc1.bias"], h1, np.int32(n), np.int32(group)) + pack, stream)
        logits_ = Launch(out, (1, slices, K), (256,), plain, stream)
        out_loss = Launch(out, (256 // 32, slices, K), (256,), training, stream)
        out_given = Launch(out, (256 // 32, slices, K), (256,), given, stream)
        total = Launch(kernel(pack_module("head_split", K), "head_split_loss_kernel"), (K,), (32,),
                       (sce.partial_loss, sce.partial_correct, np.int32(slices), loss.loss, loss.correct,
                        loss.running, scales[1]), side.streams[1]) if slices > 1 else None

        def forward():
            fc1()
            logits_()

        def forward_loss():   # the slices' loss sums added beside the step (Note [the loss beside the step])
            fc1()
            out_loss()
            if total is not None:
                side.run(total, lane=1)

        def data_gradients():
            fc1()
            out_given()
        return forward, forward_loss, data_gradients

    @staticmethod
    def _block_forms(t, loss, n: int, group: int, sce, stream, side, K: int, pack):
        """head.cu's (forward, forward_loss, data gradients): one kernel, a block an image group's head."""
        x, dx, h1, dh1, logits, dlogits, w = (t.x[:n], t.dx[:n], t.h1[:n], t.dh1[:n], t.logits[:n], t.dlogits[:n],
                                             t.w)
        null, f0 = np.uint64(0), np.float32(0)
        scales = (np.float32(1.0 / n), np.float32(1.0 / n), _smoothing(loss))
        weights = (x, w["fc1.weight"], w["fc1.bias"], w["fc2.weight"], w["fc2.bias"], h1, logits, np.int32(n),
                   np.int32(group))
        sums = (sce.partial_loss, sce.partial_correct, sce.ticket)
        fwd = kernel(pack_module("head", K), "head_forward_kernel")
        fgrid = min(max(1, -(-n // group)), sce.blocks)
        plain = weights + (null,) * 8 + (f0, f0, f0, null, null) + pack
        given = weights + (null, dlogits) + (null,) * 6 + (f0, f0, f0, dh1, dx) + pack   # dlogits read
        training = weights + (loss.labels[:n], dlogits, loss.loss, loss.correct) + sums + (loss.running,) + \
            scales + (dh1, dx) + pack
        return (Launch(fwd, (fgrid, K), (256,), plain, stream), Launch(fwd, (fgrid, K), (256,), training, stream),
                Launch(fwd, (fgrid, K), (256,), given, stream))

    @staticmethod
    def _weight_gradients(t, n: int, per: int, ranges: int, part, stream, side, K: int, pack):
        """(the weight and bias gradients' launches, over ranges of ``per`` images, whether they run on the
        side stream): one range writes the gradients themselves, several their rows of ``part``, added in
        order (stage_reduce)."""
        x, h1, dh1, dlogits = t.x[:n], t.h1[:n], t.dh1[:n], t.dlogits[:n]
        off = {k: P.OFFSETS[k] - BASE for k in ("fc1.bias", "fc2.weight", "fc2.bias")}
        wts, red = (kernel(pack_module("head_weights", K), "head_weights_kernel"),
                    kernel(pack_module("stage_reduce", K), "stage_reduce_kernel"))
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
        return gradients, beside


def _smoothing(loss):
    """The label smoothing a kernel takes by value: 0 where a pack's are on the device (``_pack_args``)."""
    return np.float32(0.0 if hasattr(loss.label_smoothing, "data") else loss.label_smoothing)


def _pack_args(loss, models: int, stride: int) -> tuple:
    """A pack's trailing arguments (head_common.cu): the floats between two models' parameters, their label
    smoothings on the device (or none), and the floats between two models' partial rows; none for one model."""
    if models == 1:
        return ()
    per_model = hasattr(loss.label_smoothing, "data")   # a pack's label smoothings on the device
    return np.int32(P.TOTAL), loss.label_smoothing if per_model else np.uint64(0), np.int64(stride)


def tail_scratch(models: int, max_batch: int):
    """The tail's partial rows: each model's for its grid at ``max_batch`` images (one block: none, the
    gradients are written in place)."""
    import cupy

    blocks = tail_blocks(max_batch, max(TAIL_BLOCKS_PER_SM))
    return cupy.zeros((models * blocks if blocks > 1 else 1, TAIL_WIDTH), cupy.float32)


class TailLaunches:
    """The head in the tail form (Note [head tail] in head_tail.cu), HeadLaunches' four calls: fc1 (+ bias,
    ReLU) on cuBLASLt, then head_tail_kernel (the logits; in training the loss, dlogits, dh1 and the sums
    of db1, dW2 and db2); ``backward()``: the blocks' rows added (stage_reduce), dW1 and dp2 on cuBLASLt,
    and, with ``mask``, dp2 masked by x > 0 (head_mask_kernel; without, the stage below masks it: Note [the
    ReLU bit] in stage_common.cu). ``mats``: one dict of LtMatmuls ("fc1", "dW1", "dp2") for
    the whole pack (batched), or one a model (each its lone run's: Note [a deterministic pack's head] in
    lenet/engines/fc.py). ``rows``: tail_scratch's buffer; ``sce``: the loss's per-block sums; ``share``: the
    models sharing one wave of the tail's grid (tail_blocks)."""

    def __init__(self, t, loss, n: int, shape: HeadShape, mats: list, rows, sce: SoftmaxCE, stream,
                 models: int = 1, mask: bool = True, share: int = 1):
        K = models
        fn = kernel(pack_module("head_tail", K), "head_tail_kernel")
        # Note [launch shapes from the device] in lenet/kernels/launch.py; a lone run's grid (share 1): its build's
        fits = resident(fn if share != 1 else kernel("head_tail", "head_tail_kernel"), TAIL_WARPS * 32)
        blocks = tail_blocks(n, max(1, min(shape.group, fits)), share)
        if blocks > 1 and K * blocks > rows.shape[0]:
            raise ValueError(f"the tail's {blocks} blocks need more partial rows than the {rows.shape[0]} kept")
        if blocks > sce.blocks or K > sce.models:
            raise ValueError(f"the loss's scratch holds {sce.blocks} parts for {sce.models} models, the tail runs "
                             f"{blocks} for {K}")
        g_b1 = t.grads[P.OFFSETS["fc1.bias"] - BASE:]   # db1, dW2 and db2 in the flat layout (a model's)
        tail, tail_plain, tail_given = self._tail_kernels(t, loss, n, fn, blocks, g_b1 if blocks == 1 else rows, sce,
                                                          stream, K)
        count = K * n * 256   # dx's floats, every model's rows one after another
        mask = Launch(kernel(pack_module("head_tail", K), "head_mask_kernel"),
                      (max(1, min(-(-count // 1024), 4 * sm_count())),), (256,), (t.x, t.dx, np.int64(count)),
                      stream) if mask else None
        red = kernel(pack_module("stage_reduce", K), "stage_reduce_kernel")
        reduced = (Launch(red, (-(-TAIL_WIDTH // 32), K), (256,), (rows, g_b1, g_b1, np.int32(blocks),
                                                                  np.int32(TAIL_WIDTH), np.int32(0), np.int32(P.TOTAL)),
                          stream) if blocks > 1 else None)

        def fc1():
            for m in mats:
                m["fc1"]()

        def forward():
            fc1()
            tail_plain()

        def forward_loss():
            fc1()
            tail()

        def backward():   # all on the main stream: dW1 beside dp2 on the side stream was slower (docs/kernels.md,
            if reduced is not None:   # "The head")
                reduced()
            for m in mats:
                m["dW1"]()
                m["dp2"]()
            if mask is not None:
                mask()

        def backward_given():
            fc1()   # h1 again, as the other forms run their forward again
            tail_given()
            backward()
        self.forward, self.forward_loss, self.backward, self.backward_given = forward, forward_loss, backward, backward_given
        self.masks_dx = mask is not None

    @staticmethod
    def _tail_kernels(t, loss, n: int, fn, blocks: int, target, sce, stream, K: int):
        """head_tail_kernel's three launches (training, the logits alone, from given dlogits) on ``blocks``
        blocks a model, the sums of db1, dW2 and db2 into ``target`` (the gradients, or the blocks' rows)."""
        null, f0 = np.uint64(0), np.float32(0)
        h1, dh1, logits, dlogits, w = t.h1[:n], t.dh1[:n], t.logits[:n], t.dlogits[:n], t.w
        pack = _pack_args(loss, K, P.TOTAL if blocks == 1 else blocks * TAIL_WIDTH)
        head = (h1, w["fc2.weight"], w["fc2.bias"], logits, np.int32(n))
        layout = (np.int32(TAIL_WIDTH), np.int32(P.OFFSETS["fc2.weight"] - P.OFFSETS["fc1.bias"]),
                  np.int32(P.OFFSETS["fc2.bias"] - P.OFFSETS["fc1.bias"]))
        training = head + (loss.labels[:n], dlogits, loss.loss, loss.correct, sce.partial_loss, sce.partial_correct,
                           sce.ticket, loss.running, np.float32(1.0 / n), np.float32(1.0 / n), _smoothing(loss), dh1,
                           target) + layout + pack
        plain = head + (null,) * 8 + (f0, f0, f0, null, null) + layout + pack
        given = head + (null, dlogits) + (null,) * 6 + (f0, f0, f0, dh1, target) + layout + pack
        return tuple(Launch(fn, (blocks, K), (TAIL_WARPS * 32,), a, stream) for a in (training, plain, given))
