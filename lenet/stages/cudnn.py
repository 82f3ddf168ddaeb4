"""The cuDNN stage engine: the convolution with its bias and ReLU on cuDNN's descriptor API or graph
API (each direction chosen by descriptors.search over the engines the policy allows, chunks
included), then cuDNN's max pooling on the unpooled output, which this engine keeps per stage.
"""

from __future__ import annotations


class CudnnPlan:
    engine = "cudnn"

    def __init__(self, conv, pool):   # lenet.ops.conv.PlannedConv, lenet.ops.pool.PlannedPool
        self.conv, self.pool = conv, pool
        self.workspace_bytes = conv.workspace_bytes

    def forward(self) -> None:
        self.conv.forward()
        self.pool.forward()

    def backward(self) -> None:
        self.pool.backward()
        self.conv.backward()

    def describe(self) -> list[dict]:
        return self.conv.describe() + self.pool.describe()

    def choice(self) -> dict:
        return {}   # the convolutions and the pooling keep their own stored choices


class CudnnStage:
    name = "cudnn"

    def serves(self, engine: str) -> bool:
        """Whether --engine ``engine`` lets this engine compete: auto, or one of cuDNN's APIs."""
        from descriptors.engines import ENGINES

        return engine == "auto" or engine in ENGINES

    def warm(self, batches=None) -> None:
        pass   # cuDNN's one-time set-up is lenet.startup's (Note [cuDNN's first call])

    def refuses(self, spec, ctx) -> str | None:
        from descriptors.algorithms import Direction, owner_of

        p = ctx.policy
        if not self.serves(p.engine):
            return f"engine {p.engine} runs no cuDNN convolution"
        theirs = [p.choice(d) for d in Direction if p.fixed(d) and owner_of(p.choice(d)) is not None]
        if theirs:
            return f"--algo names {theirs[0]}, not a cuDNN algorithm"
        return None

    def plan(self, ctx, stage, n: int, stored: dict | None = None) -> CudnnPlan:
        import cupy

        from ..ops.conv import PlannedConv   # here: the flag parse imports this module (lenet.kernels' note)
        from ..ops.pool import PlannedPool

        spec = stage.spec
        k, h, w = spec.conv_chw

        def make():
            N = stage.max_batch
            return {"c": cupy.empty((N, k, h, w), cupy.float32),      # (N, K, H, W) relu(conv + bias)
                    "dc": cupy.empty((N, k, h, w), cupy.float32),     # (N, K, H, W) its gradient
                    "bias": cupy.empty(k * h * w, cupy.float32)}      # (K*H*W,) bias-gradient scratch
        own = stage.scratch(self.name, make)
        t = stage.tensors.rows(n)
        c, dc = own["c"][:n], own["dc"][:n]
        conv = PlannedConv(ctx, spec.name, spec.conv, n, x=t.x, w=t.w, b=t.b, y=c, dy=dc, dw=t.dw, db=t.db,
                           dx=t.dx, act=t.x if t.dx is not None else None, bias_scratch=own["bias"])
        pool = PlannedPool(ctx, spec.name.replace("conv", "pool"), n, x=c, y=t.y, dx=dc, dy=t.dy)
        return CudnnPlan(conv, pool)
