"""A stage of the network: conv (5x5, valid) + bias + ReLU + 2x2/2 max-pool, forward and backward,
planned once per batch size over every stage engine.

    stage = Stage(spec, tensors, max_batch)   # full-batch arrays, made once by the model
    planned = stage.plan(ctx, n)              # an engine chosen by measurement, its calls bound
    planned.forward(); planned.backward()     # no arguments: a step can be captured in a CUDA graph

The engines, one file each, listed once in ENGINES below (the order is the order of preference
where timing decides nothing):
    ours.py   our fused kernels (lenet/kernels/stage*.cu), checked against cuDNN's exact result
    cudnn.py  cuDNN's convolutions (descriptor API or graph API, descriptors/search.py) + cuDNN pooling

Note [stage engines]: what a stage's forward leaves for its backward differs by engine (cuDNN's
pooling backward reads the unpooled output, ours one argmax byte per window), so one engine runs
both directions of a stage. Each engine chooses its candidates for each direction itself (cuDNN:
the convolution search, chunks included; ours: launch shapes), and the engines then compete on
forward + backward, each timed on the stage's own tensors as the step runs them (in a CUDA graph,
or as eager launches). Planning therefore writes the stage's outputs and gradients (never a
parameter). With --deterministic and the heuristic policy, timing decides nothing: the first engine
of ENGINES that runs the stage wins (Note [reproducible choices] in descriptors/search.py). A
stored choice names the engine and its candidates (Note [stored choices] there).
"""

from __future__ import annotations

from descriptors.algorithms import AlgorithmNotSupportedError, Direction, register_engine
from descriptors.timing import time_forward_backward

from ..kernels import source_digest
from .base import EnginePlan, StageEngine, StageSpec, StageTensors
from .cudnn import CudnnStage
from .ours import OursStage

ENGINES: dict[str, StageEngine] = {e.name: e for e in (OursStage(), CudnnStage())}
for _name, _engine in ENGINES.items():   # --engine NAME runs that engine alone; "cudnn" is named by its APIs
    if _name != "cudnn":
        register_engine(_name, getattr(_engine, "pins", None))


def warm(engine: str, batches=None) -> None:
    """Start readying the kernels of every stage engine that --engine ``engine`` lets compete, for
    these batch sizes when they are known."""
    for e in ENGINES.values():
        if e.serves(engine):
            e.warm(batches)


class PlannedStage:
    """A stage at one batch size: the winning engine's plan, and every engine's measured time."""

    def __init__(self, plan: EnginePlan, times: dict, why_not: dict):
        self.plan, self.times, self.why_not = plan, times, why_not
        self.forward, self.backward = plan.forward, plan.backward
        self.workspace_bytes = plan.workspace_bytes

    @property
    def engine(self) -> str:
        return self.plan.engine

    def describe(self) -> list[dict]:
        rows = self.plan.describe()
        for r in rows:
            r["stage_engine"] = self.plan.engine
            if self.times:
                r["stage_ms"] = dict(self.times)
        return rows


class Stage:
    """One stage over its full-batch tensors; ``plan(ctx, n)`` for each batch size n <= max_batch.
    Engines keep their own per-stage buffers here (``scratch``), made on first use."""

    def __init__(self, spec: StageSpec, tensors: StageTensors, max_batch: int):
        self.spec, self.tensors, self.max_batch = spec, tensors, int(max_batch)
        self._scratch: dict = {}

    def scratch(self, engine: str, make):
        if engine not in self._scratch:
            self._scratch[engine] = make()
        return self._scratch[engine]

    def _op(self, ctx, n: int) -> dict:
        p = ctx.policy
        return {"stage": self.spec.key(), "n": n, "engine": p.engine, "kernels": source_digest(),
                "policy": [p.choice(d) for d in Direction] + [p.workspace_limit, p.deterministic, p.allow_winograd,
                                                              p.allow_tf32, p.chunk],
                "fused": ctx.fused, "captured": ctx.captured}

    def plan(self, ctx, n: int) -> PlannedStage:
        why_not, engines = {}, []
        for e in ENGINES.values():
            why = e.refuses(self.spec, ctx)
            if why is None:
                engines.append(e)
            else:
                why_not[e.name] = why
        if not engines:
            raise AlgorithmNotSupportedError(f"no engine runs stage {self.spec.name} under {ctx.policy}: "
                                             + "; ".join(f"{k} {v}" for k, v in why_not.items()))
        store, op = ctx.search.store, self._op(ctx, n)
        hit = store.get(op) if store is not None else None
        if hit is not None:
            planned = self._recall(ctx, n, engines, hit, why_not)
            if planned is not None:
                return planned
        p = ctx.policy
        reproducible = p.deterministic and all(p.choice(d) == "heuristic" for d in Direction)
        times, plans, failed = {}, [], {}
        for e in engines:
            try:
                plan = e.plan(ctx, self, n)
            except AlgorithmNotSupportedError as err:
                failed[e.name] = str(err)
                continue
            ctx.workspace.reserve(plan.workspace_bytes)   # may re-allocate: see Note [re-capture]
            times[e.name] = sum(time_forward_backward(plan.forward, ctx.side.joined(plan.backward),
                                                      ctx.handle.stream, graph=ctx.captured))
            plans.append(plan)
            if reproducible:
                break
        if not plans:
            first = next(iter(failed.values()))
            raise AlgorithmNotSupportedError(first if len(failed) == 1 else
                                             "; ".join(f"{k}: {v}" for k, v in failed.items()))
        best = min(plans, key=lambda pl: times[pl.engine])
        why_not.update({k: f"failed: {v}" for k, v in failed.items()})
        if store is not None:
            store.put(op, {"engine": best.engine, "choice": best.choice(), "times": times})
        return PlannedStage(best, times, why_not)

    def _recall(self, ctx, n, engines, hit: dict, why_not: dict) -> PlannedStage | None:
        """The stored choice's engine planned from its stored candidates, or None if it no longer fits."""
        e = next((e for e in engines if e.name == hit.get("engine")), None)
        if e is None:
            return None
        try:
            plan = e.plan(ctx, self, n, hit.get("choice") or None)
        except (AlgorithmNotSupportedError, KeyError, TypeError, ValueError):
            return None
        ctx.workspace.reserve(plan.workspace_bytes)
        times = hit.get("times") if isinstance(hit.get("times"), dict) else {}
        return PlannedStage(plan, times, why_not)


__all__ = ["Stage", "StageSpec", "StageTensors", "PlannedStage", "ENGINES", "warm"]
