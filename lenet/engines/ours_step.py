"""Our engine's whole training step: one launch of thread-block clusters at small batches (lenet/kernels/
step_cluster.cu, sm_90 and newer; launcher lenet/kernels/step.py), a candidate the planner times against the
chain of launches and checks against the chain's result (Note [a whole step] in lenet/steps.py)."""

from __future__ import annotations

from ..kernels import step as step_kernels
from .base import Named, PlannedOp


class OurStep:
    """The whole step's rules and binding (a part of lenet.engines.ours.Ours)."""

    def _step_refuses(self, op, policy) -> str | None:
        from ..kernels import arch

        if op.models > 1:
            return "runs one model, not a pack"
        if arch() < step_kernels.ARCH:
            return (f"needs thread-block clusters (compute capability {step_kernels.ARCH // 10}.0); these kernels are "
                    f"compiled for {arch() // 10}.{arch() % 10}")
        why = self._step_policy_refuses(policy)
        if why is not None:
            return why
        if any(s.spec.dx and not s.spec.dx_mask for s in op.stages):
            return "does not compute the images' gradient"
        return None

    @staticmethod
    def _step_policy_refuses(policy) -> str | None:
        """Why the flags' policy lets no whole step run, whatever the operation (None: it may)."""
        if policy.owners():
            return "--algo fixes a stage's candidate, which the whole step does not run"
        if policy.chunk is not None:
            return "runs each image in one launch, and --chunk fixes cuDNN's calls"
        return None

    def _step_may_run(self, policy) -> bool:
        """Whether a plan under ``policy`` (None: not known yet) may take the whole step: not where the policy
        refuses it, nor where a reproducible policy's rule takes the chain, first, untimed (lenet/plan.py,
        Note [reproducible choices])."""
        return policy is None or (self._step_policy_refuses(policy) is None and not policy.reproducible)

    def _step_candidates(self, op, n: int) -> list:
        """The forms offered at batch n (Note [the whole step's batch sizes] in lenet/kernels/step.py)."""
        return [Named(self.name, f.name) for f in step_kernels.forms(n)]

    def _step_bind(self, op, n: int, candidate, planner) -> PlannedOp:
        module = step_kernels.form(candidate.name).module
        x, labels = op.stages[0].tensors.x, op.loss.labels
        return PlannedStep(self.name, step_kernels.ClusterStep(x[:n], labels[:n], op.loss, op.update, n,
                                                               planner.ctx.stream, module))


class PlannedStep(PlannedOp):
    """A whole training step at one batch size: ``train()`` runs the forward, the loss (its totals and the
    logits as the chain writes them), every gradient and the update."""

    def __init__(self, engine: str, launch):
        self.engine, self.launch = engine, launch

    def train(self) -> None:
        self.launch()

    def describe(self, ms: float | None = None) -> list[dict]:
        parts = "one launch" if len(self.launch.launches) == 1 else f"{self.launch.clusters} clusters, then the update"
        return [{"layer": "step", "op": f"whole step ({parts})", "engine": self.engine,
                 "algo": self.launch.module,
                 "fused": True, "chunk": self.launch.n, "chunks": 1, "time_ms": ms, "workspace_bytes": 0,
                 "deterministic": True}]
