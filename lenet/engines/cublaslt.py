"""The head on NVIDIA's libraries as an engine: fc1 (+ bias, ReLU) and fc2 (+ bias) as six cuBLASLt
matmuls with epilogues where cuBLASLt runs them and fusion is on, else cuBLAS GEMMs with cuDNN's bias
and ReLU calls; the loss after it is its own operation. It runs beside the engines that offer cuDNN's
convolutions (under their --engine flags), and competes with every other head under auto (timed as the
step runs it, the loss included; with --deterministic and the heuristic, the registry's first by rule).

Note [cuBLASLt epilogues]: forward fc1 = GEMM+bias+ReLU (ReLU mask bits kept), fc2 =
GEMM+bias; backward dW2 with db2 (BGRADB), dh1 with the ReLU gradient from the mask
(DRELU), dW1 with db1 (BGRADB), dp2. Twelve launches become six. Where cuBLASLt has no
algorithm for one of them, the whole plan keeps the cuBLAS path (gemm, cuDNN bias and
ReLU, gemv bias gradients), and ``note`` says why.

The input gradient dx takes the ReLU mask of the input x itself (the pooled p2, a ReLU's output;
see Note [relu at the pooled level] in lenet/engines/cudnn.py).
"""

from __future__ import annotations

from descriptors import ActivationDescriptor, TensorDescriptor, add_tensor

from descriptors.algorithms import AlgorithmNotSupportedError

from .base import Engine, Named, PlannedOp, sums_as_lone
from .fc import fc_matmuls


class Cublaslt(Engine):
    name = "cublaslt"
    runs_beside = ("conv",)   # under the flags of the engines that offer cuDNN's convolutions
    kinds = ("head",)

    def refuses(self, op, policy) -> str | None:
        if op.models > 1 and not policy.fused:
            return f"runs a pack of {op.models} models as batched cuBLASLt matmuls, which are fused (drop --no-fused)"
        return None

    # version(): "", the library's version is the store's (lenet/plancache.py)

    def scratch_per_image(self, op, policy) -> int:
        """Bytes per image of max_batch this engine allocates for the head: fc1's ReLU bits."""
        from ..blas import LtMatmul   # here: the flag parse imports this module (Note [overlapped start-up])

        return LtMatmul.AUX_LD // 8

    def candidates(self, op, n: int, planner) -> list:
        # NVIDIA's float32 GEMM, not checked at plan time: held to PyTorch's by the GPU tests
        return [Named(self.name, "cuBLASLt epilogues" if planner.policy.fused else "cuBLAS")]

    def recall(self, op, n: int, stored: dict, planner):
        return self.candidates(op, n, planner)[0]

    def bind(self, op, n: int, candidate, planner) -> "PlannedHead":
        from ..blas import LtMatmul

        state = planner.state(self.name)
        if "relu" not in state:
            import cupy

            state["relu"] = ActivationDescriptor("relu")
            state["lt"] = planner.ctx.lt   # the model's cuBLASLt (scripts/bench.py reads its workspace here)
            with planner.ctx.stream:   # fc1's ReLU bits, cuBLASLt's aux output
                state["mask"] = cupy.zeros(op.models * op.max_batch * LtMatmul.AUX_LD // 8, cupy.uint8)
        loss = planner.loss(op, n)   # planned before the head (Note [the head's loss] in lenet/plan.py)
        head = PlannedHead(self.name, op.tensors, n, loss, planner, state["relu"],
                           planner.ctx.lt if planner.policy.fused else None, state["mask"], op.models, op.dx_mask)
        if op.models > 1 and head.lt is None:
            raise AlgorithmNotSupportedError(f"a pack of {op.models} models: {head.note}")
        return head

    def close(self, state: dict) -> None:
        if "relu" in state:
            state.pop("relu").close()
        state.clear()


class PlannedHead(PlannedOp):
    """The head on cuBLASLt (with epilogues) or cuBLAS + cuDNN's bias and ReLU, at batch n."""

    fuses_loss = False   # a training forward runs the planned loss after it

    def __init__(self, engine: str, t, n: int, loss, planner, relu, lt=None, relu_mask=None, models: int = 1,
                 dx_mask: bool = True):
        ctx = planner.ctx
        self.engine = engine
        self.n, self.h, self.blas, self.ones, self.relu = n, ctx.handle, ctx.blas, ctx.ones, relu
        self.models, self.masks_dx = models, dx_mask
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
        # dx's mask runs over every model's rows at once (cuDNN's ReLU backward, elementwise)
        self.x4 = t.x[: models * n].reshape(models * n, -1, 1, 1)
        self.dx4 = t.dx[: models * n].reshape(models * n, -1, 1, 1)
        self.xd = TensorDescriptor(self.x4.shape)
        from ..blas import LtMatmul, LtUnavailable

        self.lt, self.note = None, "fusion off"
        if lt is not None:
            try:
                aux = relu_mask[: models * n * LtMatmul.AUX_LD // 8]
                # Note [a deterministic pack's head]: each model its lone run's six matmuls
                self.lt = ([self._lt(lt.get(), aux)] if models == 1 or not sums_as_lone(models, n, planner.policy)
                           else [self._lt(lt.get(), aux, model=m) for m in range(models)])
                self.note = ""
            except (LtUnavailable, ImportError) as e:
                self.note = str(e)

    def _lt(self, lt, aux, model: int | None = None):
        """The six matmuls: fc_matmuls for this head's tensors."""
        return fc_matmuls(lt, self, self.n, self.models, aux=aux, model=model)

    def forward(self) -> None:
        if self.lt is not None:   # see Note [cuBLASLt epilogues]
            for lt in self.lt:
                lt["fc1"]()
                lt["fc2"]()
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
            for lt in self.lt:
                for op in ("dW2", "dh1", "dW1", "dp2"):
                    lt[op]()
        else:
            h, w, g, blas = self.h, self.w, self.g, self.blas
            blas.gemm(self.dlogits, self.h1, g["fc2.weight"], trans_a=True)    # (10,n)@(n,120)
            blas.column_sums(self.dlogits, self.ones, g["fc2.bias"])
            blas.gemm(self.dlogits, w["fc2.weight"], self.dh1)                 # (n,10)@(10,120)
            self.relu.backward(h, self.hd, self.h14, self.hd, self.dh14, self.hd, self.h14, self.hd, self.dh14)
            blas.gemm(self.dh1, self.x, g["fc1.weight"], trans_a=True)         # (120,n)@(n,256)
            blas.column_sums(self.dh1, self.ones, g["fc1.bias"])
            blas.gemm(self.dh1, w["fc1.weight"], self.dx)                      # (n,120)@(120,256)
        # dx masked by x > 0 (x is a ReLU's output: Note [relu at the pooled level]), unless the stage below
        # masks it itself (lenet/ops.py: Head.dx_mask)
        if self.masks_dx:
            xd = self.xd
            self.relu.backward(self.h, xd, self.x4, xd, self.dx4, xd, self.x4, xd, self.dx4)

    def describe(self, ms: float | None = None) -> list[dict]:
        how = ("cuBLASLt, bias/ReLU/bias-gradient epilogues" if self.lt is not None
               else f"cuBLAS gemm + cuDNN bias/ReLU ({self.note})")
        return [{"layer": "fc1+fc2", "op": "fwd+bwd", "engine": self.engine if self.lt is not None else "cublas",
                 "algo": how, "chunk": self.n, "chunks": 1, "workspace_bytes": 0}]
