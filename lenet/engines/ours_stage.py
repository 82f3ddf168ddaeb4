"""Our engine's stages (lenet/engines/ours.py): each direction fused into one kernel (stage*.cu), its
candidates the launch shapes and kernel versions (lenet/kernels/stages.py), chosen per direction by the
planner, each checked against cuDNN's exact result first (lenet/engines/ours_check.py)."""

from __future__ import annotations

from descriptors.algorithms import AlgorithmNotSupportedError

from .. import params as P
from ..kernels import pack_module, prefetch, sm_count
from ..kernels import stages
from ..kernels.stages import Backward, Forward
from ..ops import either_form_key
from .base import LONE_SUMS_PER_SM, Check, PlannedOp, Trial, forward_only_error
from .ours_check import OurChecks


class OurStages(OurChecks):
    """A stage on our kernels: its candidates under a policy, and the planner's decision per direction."""

    def stage_candidates(self, spec, policy, n: int | None = None) -> tuple[list, list]:
        """(forward candidates, backward candidates) of a stage under ``policy`` at batch n: the first of
        each (heuristic), all (exhaustive), or the one --algo names (Note [pinned candidates])."""
        ks = stages.for_spec(spec)
        out = []
        for cands, directions in ((ks.forward_candidates(n), ("fwd",)),
                                  (ks.backward_candidates(n), ("bwd-filter", "bwd-data"))):
            named = {policy.choice(d) for d in directions if policy.fixed(d)}
            if len(named) > 1:
                raise AlgorithmNotSupportedError(f"--algo pins two backwards of ours ({', '.join(sorted(named))}); "
                                                 f"one kernel runs both gradients: name one")
            if named:
                pick = stages.parse_name(named.pop())
                if not ks.offers(pick):
                    raise AlgorithmNotSupportedError(
                        f"stage {spec.name} has no candidate {pick.name}; it offers "
                        f"{', '.join(c.name for c in cands[:3])} ... ({len(cands)} in all, as train_step "
                        f"--algo exhaustive lists the winners)")
                why = ks.refuses(pick)
                if why is not None:
                    raise AlgorithmNotSupportedError(f"stage {spec.name}: {why}")
                cands = [pick]
            elif all(policy.choice(d) == "heuristic" for d in directions):
                cands = cands[:1]
            out.append(cands)
        return out[0], out[1]


    def _stage(self, op, n: int, planner) -> "OursStagePlan":
        spec, ks, stream, side = op.spec, stages.for_spec(op.spec), planner.ctx.stream, planner.ctx.side
        K = op.models   # a pack: Note [model from the grid] in lenet/kernels/stage_common.cu
        share = self.share(op, n, planner.policy)

        def make():   # rows for every batch up to max_batch: a pack's grids round up per model
            import cupy

            most = max(stages.BACKWARD_BLOCKS_PER_SM) * sm_count()
            lone = K * min(op.max_batch, most)   # each model on its lone grid: at most one row per image
            if K > 1 and not planner.policy.deterministic:   # and only while K n <= LONE_SUMS_PER_SM SMs
                lone = min(lone, LONE_SUMS_PER_SM * sm_count())
            rows = lone if K == 1 else max(most + K, lone)
            return {"arg": cupy.zeros((K * op.max_batch, *spec.y), cupy.uint8),   # (N, K, H/2, W/2) argmax bytes
                    "part": cupy.zeros((rows, ks.width), cupy.float32)}          # (blocks, mw + mb) partial sums
        own = self._scratch(planner, ("stage", op.name), make)
        t, arg = op.tensors.rows(K * n), own["arg"][: K * n]
        fwds, bwds = self.stage_candidates(spec, planner.policy, share * n)   # a pack fills the GPU as K n images do
        if op.forward_only:   # Note [forward-only plans] in lenet/ops.py: no backward checked, timed or bound
            bwds = []
        prefetch({pack_module(m, K) for m in {ks.module(c).name for c in fwds + bwds} | {"stage_reduce"}})   # at once

        def forward(c):
            run = stages.stage_forward(ks, c, n, stream, t.x, t.w, t.b, t.y, arg, K, P.TOTAL, share)
            return run, run

        def backward(c):   # the reduction goes to the side stream only while the grid leaves SMs idle
            run = stages.stage_backward(ks, c, n, stream, own["part"], t.x, t.w, arg, t.dy, t.dw, t.db, t.dx,
                                        side if side.fits(K * c.grid(n, share)) else None, K, P.TOTAL, share)
            return run, side.joined(run)
        fwd = self._direction(op, n, "fwd", fwds, forward, planner)
        if op.forward_only:
            return OursStagePlan(self.name, spec, n, fwd.best, None)
        bwd = self._direction(op, n, "bwd", bwds, backward, planner, before=fwd.best.plan)
        return OursStagePlan(self.name, spec, n, fwd.best, bwd.best)


    def _direction(self, op, n, d: str, cands: list, launcher, planner, before=None):
        """The planner's decision for one direction of a stage: every candidate checked, then timed (where
        there is more than one) as the step runs it; ``before`` runs first (the backward reads what the
        chosen forward leaves: the argmax)."""
        ks = stages.for_spec(op.spec)
        kind = Forward if d == "fwd" else Backward

        def trial(c, best):
            check = self.check_stage(planner, op.spec, c, op.models, self.share(op, n, planner.policy) == 1)
            if check.why is not None:
                return check.why
            run, timed = launcher(c)
            if before is not None:
                before()
            return Trial(c, planner.time(timed) if len(cands) > 1 else None, check, run)

        def recall(stored):   # checked when it was stored (Note [checking a stage]); offered now (the heuristic's)
            c = stages.parse_name(stored["name"])
            if not isinstance(c, kind) or not ks.offers(c) or c not in cands:
                return None
            return Trial(c, stored.get("ms"), Check(stored.get("error"), int(stored.get("ties") or 0)), launcher(c)[0])

        def encode(dec):
            b = dec.best
            return {"name": b.candidate.name, "ms": b.ms, "error": b.check.error, "ties": b.check.ties}
        lone = {"lone_grids": self.share(op, n, planner.policy) == 1} if op.models > 1 else {}   # which sums
        key = planner.key(f"stage {op.name} {d}", {"n": n, **either_form_key(op), **lone}, (self,))
        return planner.choose(key, cands, trial, recall=recall, encode=encode,
                              what=f"the {d} kernel of ours for stage {op.name}")

    # ---------------------------------------------------------------- the head



class OursStagePlan(PlannedOp):
    """A stage on our kernels at batch n: the chosen forward and backward (lenet.plan.Trial each)."""

    masks_dy = True   # the argmax byte's ReLU bit (Note [the ReLU bit] in lenet/kernels/stage_common.cu)

    def __init__(self, engine: str, spec, n: int, fwd, bwd):
        """``bwd`` None: planned forward only (Note [forward-only plans] in lenet/ops.py)."""
        self.engine, self.spec, self.n, self.fwd, self.bwd = engine, spec, n, fwd, bwd
        self.forward = fwd.plan
        if bwd is not None:
            self.backward = bwd.plan

    def backward(self) -> None:
        raise forward_only_error(self.spec.name, self.n)

    def describe(self, ms: float | None = None) -> list[dict]:
        name, f, b = self.spec.name, self.fwd, self.bwd
        rows = [{"layer": name, "op": "fwd+bias_relu_pool", "engine": self.engine, "algo": f.candidate.name,
                 "fused": True, "chunk": self.n, "chunks": 1, "time_ms": f.ms, "workspace_bytes": 0,
                 "error": f.check.error, "ties": f.check.ties, "deterministic": True, "math": "fp32"}]
        if b is not None:
            rows.append({"layer": name, "op": "bwd" + ("+data" if self.spec.dx else "") + "+filter+bias",
                         "engine": self.engine, "algo": b.candidate.name, "fused": True, "chunk": self.n, "chunks": 1,
                         "time_ms": b.ms, "workspace_bytes": 0, "error": b.check.error, "deterministic": True,
                         "math": "fp32"})
        return rows


