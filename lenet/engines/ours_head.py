"""Our engine's head (lenet/engines/ours.py): the block and split forms on our kernels (head.cu,
head_split.cu, head_weights.cu), or the tail form: fc1 and its two gradient products on cuBLASLt, the
rest in one pass of ours (head_tail.cu: Note [head tail]); the tail's cuBLASLt algorithms and dW1's
slices are candidates of the planner's loop like every other.

Note [sliced weight gradient]: fc1's weight gradient sums 120 x 256 products over the whole batch, and
cuBLASLt's own split of that sum can leave most of a large GPU idle (docs/engines.md, "dW1's slices").
Our tail form can run it as S matmuls over slices of n // S images in one batched call (8 S tiles), the
rest of the images in one more, and add the S (+ 1) partial products in order with stage_reduce: a fixed
S sums in a fixed order. The search times S in DW1_SLICES against cuBLASLt's one matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from descriptors.algorithms import AlgorithmNotSupportedError

from .. import params as P
from ..kernels import pack_module, prefetch
from ..kernels import head as head_kernels
from ..kernels.head import HeadShape
from ..ops import either_form_key
from .base import Check, PlannedOp, Trial
from .ours_check import OurScratch

TUNED_ALGOS = 8         # cuBLASLt algorithms the tail form times for each of its products
DW1_SLICES = (64, 32, 16, 8)
DW1_MIN_ROWS = 128      # slices the search times have at least this many images


class OurHead(OurScratch):
    """The head on our kernels, in the form the planner chose (a HeadShape)."""

    def _head(self, op, n: int, shape: HeadShape, planner) -> "OursHeadPlan":
        K = op.models   # a pack: each model on its lone run's grid (head_common.cu)
        part, sce = self._scratch(planner, ("head", K), lambda: head_kernels.scratch(K, op.max_batch))
        if shape.form == "tail":
            return OursHeadPlan(self.name, self._tail(op, n, shape, sce, planner), shape, n)
        if K > 1:
            prefetch((pack_module("head_split" if shape.split else "head", K), pack_module("head_weights", K),
                      pack_module("stage_reduce", K)))
        return OursHeadPlan(self.name, head_kernels.HeadLaunches(op.tensors, op.loss, n, shape, part, sce,
                                                                 planner.ctx.stream, planner.ctx.side, K), shape, n)

    def _tail(self, op, n: int, shape: HeadShape, sce, planner) -> "head_kernels.TailLaunches":
        """The tail form (Note [head tail] in lenet/kernels/head_tail.cu): fc1's three products on cuBLASLt
        (a pack's batched, or each model's alone where it sums as its lone run), the rest ours."""
        from ..blas import LtUnavailable
        from .fc import fc_matmuls

        K = op.models
        prefetch((pack_module("head_tail", K), pack_module("stage_reduce", K)))
        rows = self._scratch(planner, ("tail", K), lambda: head_kernels.tail_scratch(K, op.max_batch))
        lt = planner.ctx.lt
        names = ("fc1", "dW1", "dp2")
        share = self.share(op, n, planner.policy)
        try:
            if share > 1 or K == 1:   # Note [tuned matmuls] in lenet/blas.py
                mats = [fc_matmuls(lt.get(), op.tensors, n, K, names=names, bias_grads=False, algos=TUNED_ALGOS)]
                # forward only (Note [forward-only plans] in lenet/ops.py): the gradients' products untuned
                for product in ("fc1",) if op.forward_only else ("fc1", "dp2"):
                    mats[0][product].use(self._matmul_pick(lt.get(), op, n, product, mats[0][product], planner).algo)
                if not op.forward_only:
                    pick = self._matmul_pick(lt.get(), op, n, "dW1", mats[0]["dW1"], planner)
                    mats[0]["dW1"] = self._dw1(lt.get(), op, n, mats[0]["dW1"], pick.algo, pick.slices, planner)[1]
            else:
                mats = [fc_matmuls(lt.get(), op.tensors, n, K, model=m, names=names, bias_grads=False)
                        for m in range(K)]
        except (LtUnavailable, ImportError) as e:
            raise AlgorithmNotSupportedError(f"{shape.name}: {e}") from None
        return head_kernels.TailLaunches(op.tensors, op.loss, n, shape, mats, rows, sce, planner.ctx.stream, K,
                                         mask=op.dx_mask, share=share)


    def _matmul_pick(self, lt, op, n: int, product: str, mm, planner) -> "MatmulAlgo":
        """The planner's decision among cuBLASLt's algorithms for one of the tail's products (Note [tuned
        matmuls] in lenet/blas.py), and for dW1 among its slices too (Note [sliced weight gradient]): each a
        candidate of the planner's loop, timed, the choice stored (a later run recalls it). Timed: a
        reproducible policy's rule never takes the tail form (``candidates``)."""
        cands = [MatmulAlgo(self.name, product, a) for a in range(len(mm.algos))]
        if product == "dW1" and op.models == 1:
            cands += [MatmulAlgo(self.name, product, a, S) for S in DW1_SLICES if n // S >= DW1_MIN_ROWS
                      for a in range(TUNED_ALGOS)]

        def trial(c, best):
            if c.slices == 1:
                return Trial(c, mm.tune(planner.time, c.algo))
            sliced, run = self._dw1(lt, op, n, mm, c.algo, c.slices, planner)
            if c.algo >= len(sliced.algos):
                return f"cuBLASLt offers {len(sliced.algos)} algorithms for it"
            return Trial(c, planner.time(run))

        def recall(stored):
            c = MatmulAlgo(self.name, product, int(stored["algo"]), int(stored["slices"]))
            ok = c.algo < len(mm.algos) if c.slices == 1 else (
                op.models == 1 and c.slices in DW1_SLICES and n // c.slices >= DW1_MIN_ROWS and c.algo < TUNED_ALGOS)
            return Trial(c, stored.get("ms"), Check()) if ok else None

        key = planner.key(f"head tail {product}", {"n": n, **either_form_key(op)}, (self,))
        return planner.choose(key, cands, trial, recall=recall,
                              encode=lambda d: {**d.best.candidate.encode(), "ms": d.best.ms},
                              what=f"the tail's cuBLASLt algorithm for {product} at batch {n}").best.candidate


    def _dw1(self, lt, op, n: int, whole, algo: int, slices: int, planner):
        """dW1 = dh1^T p2 over the batch: cuBLASLt's one matmul (``whole``, slices 1), or S of them over
        slices of the images in one batched call, their partial products added in slice order by
        stage_reduce (Note [sliced weight gradient]), the matmul running cuBLASLt's algorithm ``algo``.
        Returns (the matmul, what runs dW1)."""
        if slices == 1:
            whole.use(algo)
            return whole, whole
        import cupy

        from ..blas import LtMatmul
        from ..kernels import kernel
        from ..kernels.launch import Launch

        t, width = op.tensors, P.SHAPES["fc1.weight"][0] * P.SHAPES["fc1.weight"][1]
        part = self._scratch(planner, "dw1 rows", lambda: cupy.zeros((max(DW1_SLICES) + 1, width), cupy.float32))
        red = kernel("stage_reduce", "stage_reduce_kernel")
        g, S = t.g["fc1.weight"], slices
        r = n // S
        mm = LtMatmul(lt, t.dh1[:r], t.x[:r], part[0].reshape(g.shape), trans_a=True, batch=S,
                      strides=(r * t.dh1.shape[1], r * t.x.shape[1], width), algos=TUNED_ALGOS)
        mm.use(min(algo, len(mm.algos) - 1))
        rest = (LtMatmul(lt, t.dh1[S * r:n], t.x[S * r:n], part[S].reshape(g.shape), trans_a=True)
                if S * r < n else None)
        rows = S + (rest is not None)
        reduce = Launch(red, (-(-width // 32),), (256,), (part, g, g, np.int32(rows), np.int32(width), np.int32(0),
                                                         np.int32(P.TOTAL)), planner.ctx.stream)

        def run():
            mm()
            if rest is not None:
                rest()
            reduce()
        return mm, run



@dataclass(frozen=True)
class MatmulAlgo:
    """A candidate of one of the tail form's cuBLASLt products (``OurHead._matmul_pick``): cuBLASLt's
    algorithm ``algo`` (an index in its heuristic's ranking) over ``slices`` slices of the batch (dW1's;
    1: one matmul)."""

    engine: str
    product: str
    algo: int = 0
    slices: int = 1

    @property
    def name(self) -> str:
        return f"{self.product} a{self.algo}" + (f" over {self.slices} slices" if self.slices > 1 else "")

    def encode(self) -> dict:
        return {"algo": self.algo, "slices": self.slices}



class OursHeadPlan(PlannedOp):
    """The head on our kernels at batch n (lenet.kernels.head.HeadLaunches)."""

    fuses_loss = True    # a training forward computes the loss and dlogits itself

    def __init__(self, engine: str, launches, shape: HeadShape, n: int):
        self.engine, self.shape, self.n = engine, shape, n
        self.forward, self.forward_loss = launches.forward, launches.forward_loss
        self.backward, self.backward_given = launches.backward, launches.backward_given
        self.masks_dx = launches.masks_dx   # dx masked by x > 0 here (else by the stage below: lenet/ops.py, Head)

    def describe(self, ms: float | None = None) -> list[dict]:
        return [{"layer": "fc1+fc2", "op": "fwd+loss+bwd", "engine": self.engine, "algo": self.shape.name,
                 "fused": True, "chunk": self.n, "chunks": 1, "time_ms": ms, "workspace_bytes": 0,
                 "deterministic": True}]


