"""The convolution of a stage (conv + bias + ReLU) on cuDNN, planned per batch size.

Each direction (forward with bias and ReLU, weight gradient, data gradient) is chosen by
descriptors.search over every engine, chunk sizes included, and bound here to the stage's
tensors; the layer never knows which engine won.

Note [relu at the pooled level]: ReLU commutes with max pooling (both are monotone), so
p = maxpool(relu(c)) = relu(maxpool(c)) and the ReLU mask of a stage can be applied to the
pooled gradient, before the pool's backward routes it: maxpool_backward(dp * (p > 0))
equals relu_backward(maxpool_backward(dp)) exactly (the routed position holds p itself;
where p == 0 both give 0). The pooled tensor is 4x smaller, and the mask becomes the
epilogue of whatever computes dp: conv2's data gradient (``act`` = p1, fused into the graph
where cuDNN builds it) and fc1's input gradient (act = p2).
"""

from __future__ import annotations

import math

from descriptors.engines import BATCH_ROLES, ENGINES
from descriptors.search import ConvChoice


class BoundConv:
    """A ConvChoice bound to full-batch arrays: one launcher per chunk, and, for a weight gradient
    in several chunks, per-chunk partials summed into ``dw`` by one cuBLAS gemv.

    Note [chunked weight gradient]: the graph API's weight gradient has no beta, so each chunk
    writes its own partial (chunks x K*C*R*S floats, allocated here at plan time) and one gemv
    adds them in a fixed order: deterministic, and equal to one call's result up to float32
    summation order. Each partial starts on a 256-byte boundary: graph plans refuse a pointer
    that is not aligned (CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER, seen on an H100 for rows of
    150 floats).
    """

    def __init__(self, handle, choice: ConvChoice, arrays: dict, workspace, blas=None, ones=None):
        import cupy

        self.choice, spec = choice, choice.spec
        self.partials, self._reduce = None, None
        if spec.direction == "bwd-filter" and choice.chunks > 1:
            size = math.prod(spec.w)
            rows = cupy.zeros((choice.chunks, -(-size // 64) * 64), dtype=cupy.float32)   # (chunks, padded K*C*R*S)
            self.partials = rows[:, :size]
            dw = arrays["dw"].reshape(-1)
            self._reduce = lambda: blas.column_sums(self.partials, ones, dw)
        self.calls = []
        for i, (start, count, timed) in enumerate(choice.calls()):
            a = {r: (arr[start:start + count] if r in BATCH_ROLES else arr) for r, arr in arrays.items()}
            if self.partials is not None:
                a["dw"] = self.partials[i].reshape(spec.w)
            engine = ENGINES[timed.candidate.engine]
            self.calls.append(engine.bind(handle, spec.at(count), timed.candidate, a, workspace))

    def __call__(self) -> None:
        for call in self.calls:
            call()
        if self._reduce is not None:
            self._reduce()

    @property
    def workspace_bytes(self) -> int:
        c = self.choice
        return max(c.full.candidate.workspace_bytes, c.rest.candidate.workspace_bytes if c.rest else 0)

    def describe(self, layer: str) -> dict:
        c, t = self.choice, self.choice.full.candidate
        row = {"layer": layer, "op": c.spec.direction + (f"+{c.spec.epilogue}" if c.spec.epilogue else ""),
               "engine": t.engine, "algo": t.name, "fused": t.fused, "chunk": c.chunk, "chunks": c.chunks,
               "time_ms": c.ms, "workspace_bytes": self.workspace_bytes, "error": c.full.error,
               "deterministic": t.deterministic, "math": t.math, "policy": c.policy}
        if c.rest is not None and c.rest.candidate != t:
            row["rest"] = c.rest.candidate.label
        return row


class PlannedConv:
    """conv + bias + ReLU of one stage at batch n, bound to its tensors: the forward, the weight and
    bias gradient, and (when ``dx`` is given) the data gradient masked by ``act > 0``.

    ``x``, ``y``, ``dy``, ``dx``, ``act`` are the batch's rows; ``conv(direction, n, epilogue)`` makes
    the ConvSpec of each direction; ``bias_scratch`` holds C*H*W floats of y for the bias gradient.
    """

    def __init__(self, ctx, name: str, conv, n: int, *, x, w, b, y, dy, dw, db, dx=None, act=None, bias_scratch):
        self.name, self.n = name, n
        h, pol, ws, choose = ctx.handle, ctx.policy, ctx.workspace, ctx.search.choose
        kw = dict(fused=ctx.fused, captured=ctx.captured)
        b4 = b.reshape(1, -1, 1, 1)
        self.forward = BoundConv(h, choose(h, conv("fwd", n, "bias_relu"), pol, **kw),
                                 {"x": x, "w": w, "b": b4, "y": y}, ws)
        self.wgrad = BoundConv(h, choose(h, conv("bwd-filter", n), pol, **kw),
                               {"x": x, "dy": dy, "dw": dw}, ws, ctx.blas, ctx.ones)
        self.dgrad = None
        if dx is not None:
            arrays = {"dy": dy, "w": w, "dx": dx}
            if act is not None:
                arrays["act"] = act
            self.dgrad = BoundConv(h, choose(h, conv("bwd-data", n, "drelu" if act is not None else ""), pol, **kw),
                                   arrays, ws)
        self._bias = _bias_gradient(ctx.blas, ctx.ones, dy, db, bias_scratch)

    def backward(self) -> None:
        self.wgrad()
        self._bias()
        if self.dgrad is not None:
            self.dgrad()

    @property
    def workspace_bytes(self) -> int:
        return max(c.workspace_bytes for c in (self.forward, self.wgrad, self.dgrad) if c is not None)

    def describe(self) -> list[dict]:
        rows = [c.describe(self.name) for c in (self.forward, self.wgrad, self.dgrad) if c is not None]
        rows.append({"layer": self.name, "op": "bias-grad", "engine": "cublas", "algo": "2 x gemv",
                     "chunk": self.n, "chunks": 1})
        return rows


def _bias_gradient(blas, ones, dy, db, scratch):
    """db[c] = sum of dy[:, c, :, :], as two cuBLAS gemv: over the batch, then over H*W.

    Note [conv bias gradient]: cudnnConvolutionBackwardBias launches one block per channel;
    measured with ncu on an H100 (cuDNN 9.19, batch 64) it took 58 us for conv1 and 32 us for
    conv2, the largest items of the step. Two gemv take ~4 us each.
    """
    n, c, hh, ww = dy.shape
    tmp = scratch[: c * hh * ww]
    flat = dy.reshape(n, c * hh * ww)

    def run():
        blas.column_sums(flat, ones, tmp)                    # (C*H*W,) sum over N
        blas.row_sums(tmp.reshape(c, hh * ww), ones, db)     # (C,) sum over H*W
    return run
