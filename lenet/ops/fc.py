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
"""

from __future__ import annotations

from descriptors import TensorDescriptor, add_tensor

from ..blas import Lt, LtMatmul, LtUnavailable


class FullyConnected:
    """fc1: x (N, 256) -> h1 (N, 120), ReLU; fc2: h1 -> logits (N, 10). ``x`` and ``act`` name
    4-D model buffers (flattened here), ``dx`` the input gradient."""

    def __init__(self, x: str = "p2", dx: str = "dp2", act: str | None = "p2"):
        self.name, self.x, self.dx, self.act = "fc", x, dx, act

    def plan(self, model, n: int) -> "PlannedFullyConnected":
        return PlannedFullyConnected(self, model, n)


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
