"""The head, fc1 (+ bias, ReLU) and fc2 (+ bias), planned per batch size: six cuBLASLt matmuls with
epilogues where cuBLASLt runs them and fusion is on, else cuBLAS GEMMs with cuDNN's bias and ReLU
calls, or two kernels of ours (Note [head engines]).

Note [cuBLASLt epilogues]: forward fc1 = GEMM+bias+ReLU (ReLU mask bits kept), fc2 =
GEMM+bias; backward dW2 with db2 (BGRADB), dh1 with the ReLU gradient from the mask
(DRELU), dW1 with db1 (BGRADB), dp2. Twelve launches become six. Where cuBLASLt has no
algorithm for one of them, the whole plan keeps the cuBLAS path (gemm, cuDNN bias and
ReLU, gemv bias gradients), and ``note`` says why.

The input gradient dx takes the ReLU mask of the input x itself (the pooled p2, a ReLU's output;
see Note [relu at the pooled level] in lenet/ops/conv.py).

Note [head engines]: the head also runs as two kernels of ours (lenet/kernels/head.cu: the forward,
which in a training step also computes the loss and dlogits, and the backward with its mask, then
one reduction of per-block weight gradients on the side stream, Note [side stream] in
lenet/ops/context.py) in place of six to eight library launches and the loss's, each a few
microseconds at small batches. Under --engine auto both run at plan time and the faster wins (each
timed as the step runs it, the loss included); --engine ours takes ours, --engine legacy|graph the
cuBLAS path; with --deterministic and the heuristic policy, ours by rule. Ours takes G images per
block iteration, G a candidate timed like a stage's launch shape. The choice is stored with the
search's other choices (Note [stored choices] in descriptors/search.py): a later run with the same
key builds it without timing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from descriptors import TensorDescriptor, add_tensor
from descriptors.timing import time_forward_backward

from .. import params as P
from ..blas import LtMatmul, LtUnavailable
from ..kernels import SoftmaxCE, kernel, sm_count, source_digest
from ..kernels.launch import Launch
from .loss import LossTensors, SoftmaxCrossEntropy

HEAD_GROUPS = (1, 2, 4, 8)       # the forward's images per block iteration (at most 8)
HEAD_PER = (256, 1024, 4096, 16384)   # the weight gradients' images per block (a range)
HEAD_CANDIDATES = tuple((g, p) for p in HEAD_PER for g in HEAD_GROUPS)
HEAD_MAX_RANGES = 64             # rows of partial sums kept (64 ranges of 16384 images: any batch a model takes)
HEAD_FWD_BLOCKS_PER_SM = 8       # at most this many forward blocks per SM (the loss keeps one sum per block)


def candidates(n: int, heuristic: bool) -> list[tuple[int, int]]:
    """(group, per) launch shapes of our head at batch n: the heuristic's one (a group of 1 while that
    leaves no SM idle, ranges of 256 images), or every shape whose ranges fit, one per range count."""
    fits = [(g, p) for g, p in HEAD_CANDIDATES if -(-n // p) <= HEAD_MAX_RANGES]
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


@dataclass(frozen=True)
class HeadTensors:
    """The full-batch arrays the head reads and writes (a batch of n uses their first n rows).

    x (N, 256) the flattened stage output, a ReLU's output (its mask masks dx); dx (N, 256) its
    gradient; h1 (N, 120) relu(fc1), dh1 its gradient; logits, dlogits (N, 10); relu_mask fc1's ReLU
    bits for cuBLASLt (N * LtMatmul.AUX_LD / 8 bytes); w, g the parameters' and gradients' named views
    (fc1.weight .. fc2.bias); grads the flat gradient buffer from fc1.weight to fc2.bias (padding
    included)."""

    x: object
    dx: object
    h1: object
    dh1: object
    logits: object
    dlogits: object
    relu_mask: object
    w: dict
    g: dict
    grads: object


class FullyConnected:
    """fc1: x (N, 256) -> h1 (N, 120), ReLU; fc2: h1 -> logits (N, 10); the loss after it."""

    def __init__(self, tensors: HeadTensors, loss: LossTensors):
        self.name, self.t, self.loss = "fc", tensors, loss
        self._part = None   # our backward's partial-sum rows, made on first use
        self._sce = None    # our forward's loss sums, one per block
        self._timing = None   # the loss while candidates are timed: (LossTensors, SoftmaxCrossEntropy), made once

    def _timing_loss(self, stream) -> tuple[LossTensors, SoftmaxCrossEntropy]:
        """The loss with its device totals (loss, correct, running) swapped for scratch ones: timing a
        candidate runs a training forward, which must not touch the model's totals (an evaluation may
        be planning a batch size in the middle of its sums)."""
        if self._timing is None:
            import cupy

            t = replace(self.loss, loss=cupy.zeros(1, cupy.float32), correct=cupy.zeros(1, cupy.int32),
                        running=cupy.zeros(1, cupy.float32))
            self._timing = (t, SoftmaxCrossEntropy(t, stream))
        return self._timing

    def plan(self, ctx, n: int, loss):
        """The cuBLAS path or ours, whichever runs faster (Note [head engines]); ``loss`` is the planned
        loss (lenet.ops.loss.PlannedLoss) the cuBLAS path runs after its forward."""
        from ..stages import ENGINES   # which --engine lets ours compete: the registry's answer

        pol = ctx.policy
        if not ENGINES["ours"].serves(pol.engine) or not ctx.fused:
            return PlannedFullyConnected(self.t, ctx, n, loss)
        store = ctx.search.store
        op = {"head": "fc1+fc2", "n": n, "engine": pol.engine, "kernels": source_digest(), "fwd": pol.choice("fwd"),
              "deterministic": pol.deterministic, "captured": ctx.captured}
        hit = store.get(op) if store is not None else None
        if hit is not None and hit.get("engine") == "ours" and [hit.get("group"), hit.get("per")] in \
                [list(c) for c in HEAD_CANDIDATES]:
            return self._ours(ctx, n, int(hit["group"]), int(hit["per"]), ms=hit.get("ms"))
        if hit is not None and hit.get("engine") == "libraries" and pol.engine != ENGINES["ours"].name:
            return PlannedFullyConnected(self.t, ctx, n, loss)
        timing, timing_op = self._timing_loss(ctx.stream)
        libs = None
        if pol.engine != ENGINES["ours"].name:   # timed with the scratch totals, then given the real loss
            libs = PlannedFullyConnected(self.t, ctx, n, timing_op.plan(n))
        cands = candidates(n, pol.choice("fwd") == "heuristic")
        reproducible = pol.deterministic and pol.choice("fwd") == "heuristic"
        best = None
        for g, per in cands:
            cand = self._ours(ctx, n, g, per, timing)
            ms = cand.time(ctx) if (len(cands) > 1 or (libs is not None and not reproducible)) else None
            if best is None or (ms is not None and ms < best[0]):
                best = (ms if ms is not None else math.inf, cand)
        if libs is not None and not reproducible and OursHead.time_plan(libs, ctx) < best[0]:
            libs.loss = loss
            if store is not None:
                store.put(op, {"engine": "libraries"})
            return libs
        g, per = best[1].group, best[1].per
        if store is not None:
            store.put(op, {"engine": "ours", "group": g, "per": per, "ms": best[1].ms})
        return self._ours(ctx, n, g, per, ms=best[1].ms)

    def _ours(self, ctx, n: int, group: int, per: int, loss: LossTensors | None = None,
              ms: float | None = None) -> "OursHead":
        if self._part is None:
            import cupy

            self._part = cupy.empty((HEAD_MAX_RANGES, OursHead.WIDTH), cupy.float32)   # (ranges, width)
            self._sce = SoftmaxCE(HEAD_FWD_BLOCKS_PER_SM * sm_count())
        head = OursHead(self.t, loss or self.loss, ctx, n, group, per, self._part, self._sce)
        head.ms = ms
        return head


class PlannedFullyConnected:
    """The head on cuBLASLt (with epilogues) or cuBLAS + cuDNN's bias and ReLU, at batch n."""

    workspace_bytes = 0
    fuses_loss = False   # a training forward runs the planned loss after it

    def __init__(self, t: HeadTensors, ctx, n: int, loss):
        self.n, self.h, self.blas, self.ones, self.relu = n, ctx.handle, ctx.blas, ctx.ones, ctx.relu
        self.loss, self.w, self.g = loss, t.w, t.g
        self.x, self.dx = t.x[:n], t.dx[:n]                          # (n, 256)
        self.h1, self.logits = t.h1[:n], t.logits[:n]                # (n, 120), (n, 10)
        self.dlogits = t.dlogits[:n]                                 # (n, 10)
        self.dh1 = t.dh1[:n]                                         # (n, 120)
        self.hd, self.ld = TensorDescriptor((n, 120, 1, 1)), TensorDescriptor((n, 10, 1, 1))
        self.h14, self.l4, self.dh14 = self.h1.reshape(n, 120, 1, 1), self.logits.reshape(n, 10, 1, 1), \
            self.dh1.reshape(n, 120, 1, 1)
        self.bd = {k: TensorDescriptor((1, t.w[k].shape[0], 1, 1)) for k in ("fc1.bias", "fc2.bias")}
        self.b4 = {k: t.w[k].reshape(1, -1, 1, 1) for k in ("fc1.bias", "fc2.bias")}   # (1, C, 1, 1)
        self.x4 = self.x.reshape(n, -1, 1, 1)
        self.dx4 = self.dx.reshape(n, -1, 1, 1)
        self.xd = TensorDescriptor(self.x4.shape)
        self.lt, self.note = None, "fusion off"
        if ctx.fused:
            try:
                self.lt = self._lt(ctx.lt.get(), t.relu_mask[: n * LtMatmul.AUX_LD // 8])
                self.note = ""
            except (LtUnavailable, ImportError) as e:
                self.note = str(e)

    def _lt(self, lt, aux):
        w, g = self.w, self.g
        return {
            "fc1": LtMatmul(lt, self.x, w["fc1.weight"], self.h1, trans_b=True, epilogue="relu_aux_bias",
                            bias=w["fc1.bias"], aux=aux),
            "fc2": LtMatmul(lt, self.h1, w["fc2.weight"], self.logits, trans_b=True, epilogue="bias",
                            bias=w["fc2.bias"]),
            "dW2": LtMatmul(lt, self.dlogits, self.h1, g["fc2.weight"], trans_a=True, epilogue="bgradb",
                            bias=g["fc2.bias"]),
            "dh1": LtMatmul(lt, self.dlogits, w["fc2.weight"], self.dh1, epilogue="drelu", aux=aux),
            "dW1": LtMatmul(lt, self.dh1, self.x, g["fc1.weight"], trans_a=True, epilogue="bgradb",
                            bias=g["fc1.bias"]),
            "dp2": LtMatmul(lt, self.dh1, w["fc1.weight"], self.dx),
        }

    def forward(self) -> None:
        if self.lt is not None:   # see Note [cuBLASLt epilogues]
            self.lt["fc1"]()
            self.lt["fc2"]()
            return
        h, w, blas = self.h, self.w, self.blas
        blas.gemm(self.x, w["fc1.weight"], self.h1, trans_b=True)              # (n,256)@(256,120)
        add_tensor(h, self.bd["fc1.bias"], self.b4["fc1.bias"], self.hd, self.h14)
        self.relu.forward(h, self.hd, self.h14, self.hd, self.h14)
        blas.gemm(self.h1, w["fc2.weight"], self.logits, trans_b=True)         # (n,120)@(120,10)
        add_tensor(h, self.bd["fc2.bias"], self.b4["fc2.bias"], self.ld, self.l4)

    def forward_loss(self) -> None:
        """The training forward: logits, then the loss and dlogits."""
        self.forward()
        self.loss.train()

    def backward_given(self) -> None:
        """Every gradient from dlogits written by the caller (a loss of its own)."""
        self.backward()

    def backward(self) -> None:
        if self.lt is not None:
            for op in ("dW2", "dh1", "dW1", "dp2"):
                self.lt[op]()
        else:
            h, w, g, blas = self.h, self.w, self.g, self.blas
            blas.gemm(self.dlogits, self.h1, g["fc2.weight"], trans_a=True)    # (10,n)@(n,120)
            blas.column_sums(self.dlogits, self.ones, g["fc2.bias"])
            blas.gemm(self.dlogits, w["fc2.weight"], self.dh1)                 # (n,10)@(10,120)
            self.relu.backward(h, self.hd, self.h14, self.hd, self.dh14, self.hd, self.h14, self.hd, self.dh14)
            blas.gemm(self.dh1, self.x, g["fc1.weight"], trans_a=True)         # (120,n)@(n,256)
            blas.column_sums(self.dh1, self.ones, g["fc1.bias"])
            blas.gemm(self.dh1, w["fc1.weight"], self.dx)                      # (n,120)@(120,256)
        # dx masked by x > 0 (x is a ReLU's output: Note [relu at the pooled level])
        xd = self.xd
        self.relu.backward(self.h, xd, self.x4, xd, self.dx4, xd, self.x4, xd, self.dx4)

    def describe(self) -> list[dict]:
        how = ("cuBLASLt, bias/ReLU/bias-gradient epilogues" if self.lt is not None
               else f"cuBLAS gemm + cuDNN bias/ReLU ({self.note})")
        return [{"layer": "fc1+fc2", "op": "fwd+bwd", "engine": "cublaslt" if self.lt is not None else "cublas",
                 "algo": how, "chunk": self.n, "chunks": 1, "workspace_bytes": 0}]


class OursHead:
    """The head on our kernels (Note [head engines], Note [head latency] in lenet/kernels/head.cu).
    ``forward()``: the logits; ``forward_loss()``: the logits, the loss and dlogits, and the data
    gradients dh1 and dx (masked by x > 0) in the same kernel; ``backward_given()``: from dlogits
    written by the caller (a loss of its own), the data gradients (the same kernel, its forward run
    again: the head's forward is a few microseconds), then ``backward()``: the weight and bias
    gradients on the side stream, over ranges of ``per`` images (one range: written straight into the
    gradients; several: per-range rows added in order)."""

    workspace_bytes = 0
    fuses_loss = True    # a training forward computes the loss and dlogits itself
    BASE = P.OFFSETS["fc1.weight"]
    WIDTH = P.OFFSETS["fc2.bias"] + P.SHAPES["fc2.bias"][0] - BASE   # fc1.weight .. fc2.bias, padding included

    def __init__(self, t: HeadTensors, loss: LossTensors, ctx, n: int, group: int, per: int, part, sce: SoftmaxCE):
        self.n, self.group, self.per, self.stream = n, int(group), int(per), ctx.stream
        x, dx = t.x[:n], t.dx[:n]                                                # (n, 256)
        h1, dh1, logits, dlogits = t.h1[:n], t.dh1[:n], t.logits[:n], t.dlogits[:n]   # (n, 120) x 2, (n, 10) x 2
        w = t.w
        fwd, wts, red = (kernel("head", "head_forward_kernel"), kernel("head_weights", "head_weights_kernel"),
                         kernel("stage_reduce", "stage_reduce_kernel"))
        g = self.group
        fgrid = min(max(1, -(-n // g)), sce.blocks)
        ranges = -(-n // self.per)
        if ranges > part.shape[0]:
            raise ValueError(f"{ranges} ranges of {self.per} images need more partial rows than the {part.shape[0]} "
                             f"kept")
        off = {k: P.OFFSETS[k] - self.BASE for k in ("fc1.bias", "fc2.weight", "fc2.bias")}
        null, f0 = np.uint64(0), np.float32(0)
        weights = (x, w["fc1.weight"], w["fc1.bias"], w["fc2.weight"], w["fc2.bias"], h1, logits, np.int32(n),
                   np.int32(g))
        plain = weights + (null,) * 8 + (f0, f0, f0, null, null)
        given = weights + (null, dlogits) + (null,) * 6 + (f0, f0, f0, dh1, dx)   # dlogits read, not computed
        training = weights + (loss.labels[:n], dlogits, loss.loss, loss.correct, sce.partial_loss, sce.partial_correct,
                              sce.ticket, loss.running, np.float32(1.0 / n), np.float32(1.0 / n),
                              np.float32(loss.label_smoothing), dh1, dx)
        rows = t.grads if ranges == 1 else part   # one range writes the gradients themselves (same layout)
        wargs = (x, h1, dh1, dlogits, rows, np.int32(self.WIDTH), np.int32(off["fc1.bias"]),
                 np.int32(off["fc2.weight"]), np.int32(off["fc2.bias"]), np.int32(n), np.int32(self.per))
        rargs = (part, t.grads, t.grads, np.int32(ranges), np.int32(self.WIDTH), np.int32(0))
        rgrid = -(-self.WIDTH // 32)
        stream, side = self.stream, ctx.side
        beside = side.fits(120 * ranges)   # decided here, not at every call (Note [side stream])
        on = side.stream if beside else stream
        weights_ = Launch(wts, (120, ranges), (256,), wargs, on)
        reduced = Launch(red, (rgrid,), (256,), rargs, on) if ranges > 1 else None   # one range: no partial rows

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
        self.ms = None

    @staticmethod
    def time_plan(plan, ctx) -> float:
        """ms of a training step's head: the forward with the loss, then the backward (and its side work)."""
        return sum(time_forward_backward(plan.forward_loss, ctx.side.joined(plan.backward), ctx.stream,
                                         graph=ctx.captured))

    def time(self, ctx) -> float:
        self.ms = self.time_plan(self, ctx)
        return self.ms

    @property
    def name(self) -> str:
        return f"fused head g{self.group} w{self.per}"

    def describe(self) -> list[dict]:
        return [{"layer": "fc1+fc2", "op": "fwd+loss+bwd", "engine": "ours", "algo": self.name,
                 "fused": True, "chunk": self.n, "chunks": 1, "time_ms": self.ms, "workspace_bytes": 0,
                 "deterministic": True}]
