"""The head's fully connected layers as cuBLASLt matmuls on its buffers, for the engines that run them
there: the cuBLASLt head (lenet/engines/cublaslt.py, all six) and our tail form (lenet/engines/ours.py:
fc1, dW1 and dp2, the rest in lenet/kernels/head_tail.cu)."""

from __future__ import annotations

from .. import params as P


def _is_param(v, w: dict, g: dict) -> bool:
    """Whether view v is one of the parameters' or gradients' (a pack's stride is then P.TOTAL)."""
    return any(v is a for a in (*w.values(), *g.values()))


SIX = ("fc1", "fc2", "dW2", "dh1", "dW1", "dp2")


def fc_matmuls(lt, t, n: int, models: int, *, aux=None, model: int | None = None, names=SIX,
               bias_grads: bool = True, algos: int = 1) -> dict:
    """The head's matmuls ``names`` on cuBLASLt at batch n, on ``t``'s buffers (w, g, x, h1, logits,
    dlogits, dh1, dx): fc1 with bias + ReLU (its mask bits into ``aux`` when given), fc2 with bias, dW2 and
    dW1 with their bias gradients (unless ``bias_grads`` is off), dh1 through the mask in ``aux``, dp2.
    A pack's (Note [packs] in lenet/ops.py) as batched ones, model m's activations n rows after model
    m - 1's, its parameters P.TOTAL floats after; or, given ``model``, that model's alone, the calls of
    its lone run. ``algos``: the algorithms each keeps (LtMatmul, Note [tuned matmuls] in lenet/blas.py).

    Note [a deterministic pack's head]: batched matmuls sum as cuBLASLt's batched kernel does, which is
    not bit for bit the lone run's (docs/engines.md, "A pack's batched matmuls"). Where a pack sums as its lone runs (``sums_as_lone`` in base.py: under
    --deterministic, or a pack of few images) its head therefore runs each model's matmuls of its lone
    run, K times as many launches: with --engine legacy|graph (Note [a pack on cuDNN] in
    lenet/engines/cudnn.py) every model of the pack is then its lone run, bit for bit."""
    from ..blas import LtMatmul
    from ..ops import shifted

    w, g, K, T = t.w, t.g, models, P.TOTAL
    x, h1, logits, dlogits, dh1, dx = (a[:n] for a in (t.x, t.h1, t.logits, t.dlogits, t.dh1, t.dx))
    if model is not None:
        m = model
        w, g = {k: shifted(v, m * T) for k, v in w.items()}, {k: shifted(v, m * T) for k, v in g.items()}
        x, h1, logits, dlogits, dh1, dx = (shifted(a, m * n * a.shape[1]) for a in (x, h1, logits, dlogits, dh1, dx))
        if aux is not None:
            aux = aux[m * n * LtMatmul.AUX_LD // 8:(m + 1) * n * LtMatmul.AUX_LD // 8]
        K = 1

    def mm(a, b, c, **kw):
        sa, sb, sc = (T if _is_param(v, w, g) else n * v.shape[1] for v in (a, b, c))
        return LtMatmul(lt, a, b, c, batch=K, strides=(sa, sb, sc), bias_stride=T, algos=algos, **kw)
    def bias_grad(bias) -> dict:   # a weight gradient's epilogue: its bias's gradient too, unless bias_grads is off
        return {"epilogue": "bgradb", "bias": bias} if bias_grads else {}

    relu = {"epilogue": "relu_aux_bias", "aux": aux} if aux is not None else {"epilogue": "relu_bias"}
    make = {
        "fc1": lambda: mm(x, w["fc1.weight"], h1, trans_b=True, bias=w["fc1.bias"], **relu),
        "fc2": lambda: mm(h1, w["fc2.weight"], logits, trans_b=True, epilogue="bias", bias=w["fc2.bias"]),
        "dW2": lambda: mm(dlogits, h1, g["fc2.weight"], trans_a=True, **bias_grad(g["fc2.bias"])),
        "dh1": lambda: mm(dlogits, w["fc2.weight"], dh1, epilogue="drelu", aux=aux),
        "dW1": lambda: mm(dh1, x, g["fc1.weight"], trans_a=True, **bias_grad(g["fc1.bias"])),
        "dp2": lambda: mm(dh1, w["fc1.weight"], dx),
    }
    return {k: make[k]() for k in names}
