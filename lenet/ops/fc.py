"""The fully connected layers, fc1 (+ bias, ReLU) and fc2 (+ bias), planned per batch size:
six cuBLASLt matmuls with epilogues where cuBLASLt runs them and fusion is on, else cuBLAS
GEMMs with cuDNN's bias and ReLU calls.

Note [cuBLASLt epilogues]: forward fc1 = GEMM+bias+ReLU (ReLU mask bits kept), fc2 =
GEMM+bias; backward dW2 with db2 (BGRADB), dh1 with the ReLU gradient from the mask
(DRELU), dW1 with db1 (BGRADB), dp2. Twelve launches become six. Where cuBLASLt has no
algorithm for one of them, the whole plan keeps the cuBLAS path (gemm, cuDNN bias and
ReLU, gemv bias gradients), and ``note`` says why.

The input gradient dp2 takes the ReLU mask of the activation that fed fc1 (``act``, the
pooled p2; see Note [relu at the pooled level] in lenet/ops/conv.py).

Note [head engines]: the head also runs as two kernels of ours (lenet/kernels/head.cu: the forward,
and the backward with its mask, then one reduction of per-block weight gradients) in place of six to
eight library launches, each a few microseconds at small batches. Under --engine auto both run at
plan time and the faster wins (each timed as the step runs it); --engine ours takes ours,
--engine legacy|graph the cuBLAS path; with --deterministic and the heuristic policy, ours by rule.
Ours takes G images per block iteration, G a candidate timed like a stage's launch shape.
"""

from __future__ import annotations

import math

import numpy as np

from descriptors import TensorDescriptor, add_tensor
from descriptors.timing import time_forward_backward

from .. import params as P
from ..blas import Lt, LtMatmul, LtUnavailable
from ..kernels import kernel, sm_count

HEAD_GROUPS = (4, 1, 2, 8)       # images per block iteration (the first is the heuristic's; at most 8)
HEAD_BWD_BLOCKS_PER_SM = 2       # at most this many backward blocks per SM: each writes a 128 KB row


class FullyConnected:
    """fc1: x (N, 256) -> h1 (N, 120), ReLU; fc2: h1 -> logits (N, 10). ``x`` and ``act`` name
    4-D model buffers (flattened here), ``dx`` the input gradient."""

    def __init__(self, x: str = "p2", dx: str = "dp2", act: str | None = "p2"):
        self.name, self.x, self.dx, self.act = "fc", x, dx, act
        self._part = None   # our backward's partial-sum rows, made on first use

    def plan(self, model, n: int):
        """The cuBLAS path or ours, whichever runs faster (Note [head engines])."""
        from ..stages import ENGINES   # which --engine lets ours compete: the registry's answer

        pol = model.policy
        if not ENGINES["ours"].serves(pol.engine) or not model.fused:
            return PlannedFullyConnected(self, model, n)
        libs = None if pol.engine == ENGINES["ours"].name else PlannedFullyConnected(self, model, n)
        groups = HEAD_GROUPS[:1] if pol.choice("fwd") == "heuristic" else HEAD_GROUPS
        reproducible = pol.deterministic and pol.choice("fwd") == "heuristic"
        if self._part is None:
            import cupy

            rows = HEAD_BWD_BLOCKS_PER_SM * sm_count()
            self._part = cupy.empty((rows, OursHead.WIDTH), cupy.float32)   # (blocks, fc1.weight .. fc2.bias)
        best = None
        for g in groups:
            cand = OursHead(self, model, n, g, self._part)
            ms = cand.time(model) if (len(groups) > 1 or (libs is not None and not reproducible)) else None
            if best is None or (ms is not None and ms < best[0]):
                best = (ms if ms is not None else math.inf, cand)
        if libs is None or reproducible:
            return best[1]
        libs_ms = OursHead.time_plan(libs, model)
        return best[1] if best[0] <= libs_ms else libs


class PlannedFullyConnected:
    workspace_bytes = 0

    def __init__(self, layer: FullyConnected, model, n: int):
        self.n, h = n, model.handle
        b, p = model.buf, model.p
        self.x = b[layer.x][:n].reshape(n, -1)           # (n, 256)
        self.dx = b[layer.dx][:n].reshape(n, -1)         # (n, 256)
        self.h1, self.logits = b["h1"][:n], b["logits"][:n]          # (n, 120), (n, 10)
        self.dlogits, self.dh1 = b["dlogits"][:n], b["dh1"][:n]      # (n, 10), (n, 120)
        self.model = model
        self.relu = model.relu
        self.hd, self.ld = TensorDescriptor((n, 120, 1, 1)), TensorDescriptor((n, 10, 1, 1))
        self.h14, self.l4, self.dh14 = self.h1.reshape(n, 120, 1, 1), self.logits.reshape(n, 10, 1, 1), \
            self.dh1.reshape(n, 120, 1, 1)
        self.bd = {k: TensorDescriptor((1, p[k].shape[0], 1, 1)) for k in ("fc1.bias", "fc2.bias")}
        self.mask = None
        if layer.act is not None:
            act = b[layer.act][:n]
            self.ad = TensorDescriptor(act.shape)
            self.act, self.dx4 = act, b[layer.dx][:n]
            self.mask = lambda: self.relu.backward(h, self.ad, self.act, self.ad, self.dx4, self.ad, self.act,
                                                   self.ad, self.dx4)
        self.lt, self.note = None, "fusion off"
        if model.fused:
            try:
                self.lt = self._lt(model, n)
                self.note = ""
            except (LtUnavailable, ImportError) as e:
                self.note = str(e)

    def _lt(self, model, n):
        if model.lt is None:
            model.lt = Lt(model.stream)
        lt, p, g = model.lt, model.p, model.g
        aux = model.buf["relu_mask"][: n * LtMatmul.AUX_LD // 8]
        return {
            "fc1": LtMatmul(lt, self.x, p["fc1.weight"], self.h1, trans_b=True, epilogue="relu_aux_bias",
                            bias=p["fc1.bias"], aux=aux),
            "fc2": LtMatmul(lt, self.h1, p["fc2.weight"], self.logits, trans_b=True, epilogue="bias",
                            bias=p["fc2.bias"]),
            "dW2": LtMatmul(lt, self.dlogits, self.h1, g["fc2.weight"], trans_a=True, epilogue="bgradb",
                            bias=g["fc2.bias"]),
            "dh1": LtMatmul(lt, self.dlogits, p["fc2.weight"], self.dh1, epilogue="drelu", aux=aux),
            "dW1": LtMatmul(lt, self.dh1, self.x, g["fc1.weight"], trans_a=True, epilogue="bgradb",
                            bias=g["fc1.bias"]),
            "dp2": LtMatmul(lt, self.dh1, p["fc1.weight"], self.dx),
        }

    def forward(self) -> None:
        if self.lt is not None:   # see Note [cuBLASLt epilogues]
            self.lt["fc1"]()
            self.lt["fc2"]()
            return
        m, h, p = self.model, self.model.handle, self.model.p
        m.blas.gemm(self.x, p["fc1.weight"], self.h1, trans_b=True)            # (n,256)@(256,120)
        add_tensor(h, self.bd["fc1.bias"], m.pb["fc1.bias"], self.hd, self.h14)
        self.relu.forward(h, self.hd, self.h14, self.hd, self.h14)
        m.blas.gemm(self.h1, p["fc2.weight"], self.logits, trans_b=True)       # (n,120)@(120,10)
        add_tensor(h, self.bd["fc2.bias"], m.pb["fc2.bias"], self.ld, self.l4)

    def backward(self) -> None:
        if self.lt is not None:
            for op in ("dW2", "dh1", "dW1", "dp2"):
                self.lt[op]()
        else:
            m, h, p, g, blas = self.model, self.model.handle, self.model.p, self.model.g, self.model.blas
            blas.gemm(self.dlogits, self.h1, g["fc2.weight"], trans_a=True)    # (10,n)@(n,120)
            blas.column_sums(self.dlogits, m.ones, g["fc2.bias"])
            blas.gemm(self.dlogits, p["fc2.weight"], self.dh1)                 # (n,10)@(10,120)
            self.relu.backward(h, self.hd, self.h14, self.hd, self.dh14, self.hd, self.h14, self.hd, self.dh14)
            blas.gemm(self.dh1, self.x, g["fc1.weight"], trans_a=True)         # (120,n)@(n,256)
            blas.column_sums(self.dh1, m.ones, g["fc1.bias"])
            blas.gemm(self.dh1, p["fc1.weight"], self.dx)                      # (n,120)@(120,256)
        if self.mask is not None:
            self.mask()

    def describe(self) -> list[dict]:
        how = ("cuBLASLt, bias/ReLU/bias-gradient epilogues" if self.lt is not None
               else f"cuBLAS gemm + cuDNN bias/ReLU ({self.note})")
        return [{"layer": "fc1+fc2", "op": "fwd+bwd", "engine": "cublaslt" if self.lt is not None else "cublas",
                 "algo": how, "chunk": self.n, "chunks": 1, "workspace_bytes": 0}]


class OursHead:
    """The head on our kernels (Note [head engines]): forward = fc1 + ReLU + fc2; backward = dh1,
    dp2 (masked by p2 > 0), and the weight and bias gradients as per-block rows summed in order."""

    workspace_bytes = 0
    BASE = P.OFFSETS["fc1.weight"]
    WIDTH = P.OFFSETS["fc2.bias"] + P.SHAPES["fc2.bias"][0] - BASE   # fc1.weight .. fc2.bias, padding included

    def __init__(self, layer: FullyConnected, model, n: int, group: int, part):
        b, p = model.buf, model.p
        self.n, self.group, self.stream = n, int(group), model.stream
        x, dx = b[layer.x][:n].reshape(n, -1), b[layer.dx][:n].reshape(n, -1)      # (n, 256)
        h1, logits, dlogits = b["h1"][:n], b["logits"][:n], b["dlogits"][:n]       # (n, 120), (n, 10), (n, 10)
        grads = model.grads[self.BASE: self.BASE + self.WIDTH]
        fwd, bwd, red = (kernel("head", "head_forward_kernel"), kernel("head", "head_backward_kernel"),
                         kernel("stage", "stage_reduce_kernel"))
        g = self.group
        fgrid = max(1, -(-n // g))
        bgrid = max(1, min(fgrid, part.shape[0]))
        off = {k: P.OFFSETS[k] - self.BASE for k in ("fc1.bias", "fc2.weight", "fc2.bias")}
        fargs = (x, p["fc1.weight"], p["fc1.bias"], p["fc2.weight"], p["fc2.bias"], h1, logits, np.int32(n), np.int32(g))
        bargs = (x, h1, dlogits, p["fc1.weight"], p["fc2.weight"], dx, part, np.int32(self.WIDTH),
                 np.int32(off["fc1.bias"]), np.int32(off["fc2.weight"]), np.int32(off["fc2.bias"]), np.int32(n),
                 np.int32(g))
        rargs = (part, grads, grads, np.int32(bgrid), np.int32(self.WIDTH), np.int32(0))
        fsmem = 4 * (1200 + g * (256 + 120) + 64 * 121)
        bsmem = 4 * (120 * 256 + g * (256 + 120 + 10 + 120))   # W1 in shared memory: over the default 48 KB
        if bwd.max_dynamic_shared_size_bytes < bsmem:
            bwd.max_dynamic_shared_size_bytes = bsmem
        rgrid = -(-self.WIDTH // 32)

        def forward():
            with self.stream:
                fwd((fgrid,), (256,), fargs, shared_mem=fsmem)

        def backward():
            with self.stream:
                bwd((bgrid,), (256,), bargs, shared_mem=bsmem)
                red((rgrid,), (256,), rargs)
        self.forward, self.backward = forward, backward
        self.ms = None

    @staticmethod
    def time_plan(plan, model) -> float:
        """ms of forward + backward as the step runs them (the backward after a forward)."""
        return sum(time_forward_backward(plan.forward, plan.backward, model.stream, graph=model.cuda_graph))

    def time(self, model) -> float:
        self.ms = self.time_plan(self, model)
        return self.ms

    def describe(self) -> list[dict]:
        return [{"layer": "fc1+fc2", "op": "fwd+bwd", "engine": "ours", "algo": f"fused head g{self.group}",
                 "fused": True, "chunk": self.n, "chunks": 1, "time_ms": self.ms, "workspace_bytes": 0,
                 "deterministic": True}]
