"""The one registry of engines: every answer about engines (what --engine offers, who runs an operation
under which flag, who owns a candidate name --algo gives, what start-up warms, what a stored choice may
name) comes from ENGINES below, in the order of preference where timing decides nothing. Adding an
engine is its own file and one line here.

    ours      our kernels: fused stages, the head, the loss, the update          --engine ours
    cudnn     a stage by parts on cuDNN: each convolution direction by the engines that offer
              convolutions (below), chunked, then cuDNN's max pooling             (beside those engines)
    legacy    cuDNN's descriptor API: convolution algorithms                      --engine legacy
    graph     cuDNN's graph API: convolution execution plans                      --engine graph
    cublaslt  the head on cuBLASLt's epilogues (or cuBLAS and cuDNN's bias and ReLU) (beside those engines)

``--engine auto`` lets every engine compete; ``--engine FLAG`` runs the engine whose flag is FLAG, the
engines with no flag of their own that run beside it (``runs_beside``: the kinds whose engines' flags
they run under), and those that run an operation under every flag (``everywhere``: our loss and update).
An engine's own rules are written once, in its file (docs/engines.md, "The protocol").
"""

from __future__ import annotations

from .cublaslt import Cublaslt
from .cudnn import Cudnn
from .graph import Graph
from .legacy import Legacy
from .ours import Ours

ENGINES = (Ours(), Cudnn(), Legacy(), Graph(), Cublaslt())
BY_NAME = {e.name: e for e in ENGINES}
FLAGS = ("auto", *(e.flag for e in ENGINES if e.flag))


def by_flag(flag: str):
    """The engine --engine ``flag`` names (None: auto, or no engine's)."""
    return next((e for e in ENGINES if e.flag is not None and e.flag == flag), None)


def offering(kind: str) -> list:
    """The engines that offer operations (or parts) of ``kind``, in the registry's order."""
    return [e for e in ENGINES if kind in e.kinds]


def flags_of(engine) -> tuple[str, ...]:
    """The --engine values ``engine`` runs under: auto, its own flag, and the flags of the engines offering
    the kinds it runs beside."""
    beside = {e.flag for e in ENGINES if e.flag and set(e.kinds) & set(engine.runs_beside)}
    return ("auto", *([engine.flag] if engine.flag else []), *(f for f in FLAGS if f in beside))


def refusal(engine, op, policy) -> str | None:
    """Why ``engine`` may not run ``op`` (an operation, or a part of one; None: asked without one) under
    ``policy``: the flag's rule (the registry's), then the engine's own; None where it may."""
    kind = op.kind if op is not None else None
    if policy.engine not in flags_of(engine) and kind not in engine.everywhere:
        other = by_flag(policy.engine)
        return f"engine {policy.engine} runs {other.runs if other is not None else 'other engines'}"
    return engine.refuses(op, policy)


def serving(op, policy) -> tuple[list, dict]:
    """(the engines that may run ``op`` under ``policy``, {engine: why not} for the others)."""
    ok, why_not = [], {}
    for e in offering(op.kind):
        why = refusal(e, op, policy)
        if why is None:
            ok.append(e)
        else:
            why_not[e.name] = why
    return ok, why_not


def serving_parts(kind: str, part, policy) -> list:
    """The engines that offer parts of ``kind`` (a convolution direction: ``part`` its ConvSpec, or None)
    and may run them under ``policy``: what an engine that runs an operation by parts asks."""
    return [e for e in offering(kind) if refusal(e, None, policy) is None and e.refuses(part, policy) is None]


# Note [the heuristic's engine]: under --algo heuristic each engine offers its first-ranked candidate, and the
# planner used to time them against each other. On the generations where our measurements found one engine
# fastest for a kind of operation at every batch size measured, the heuristic takes that engine's first candidate
# that passes its check without timing the others, as cuDNN's heuristic names an algorithm without timing one;
# the other engines, in the registry's order, only where it offers none that passes. Keyed by generation (a
# compute capability's tens: 90 is sm_90 and sm_9x), for the code our kernels are compiled for (LENET_KERNEL_ARCH's
# where set: an H100 running generation 75's code times the engines, as a T4 does). For one model only: a pack's
# engines (lenet sweep) were never timed against each other, and are still timed. A choice stored by a search
# before (timed) is recalled as every stored choice is. --algo exhaustive still times every engine's every
# candidate, --engine legacy|graph runs cuDNN alone, and --deterministic keeps the registry's order (Note
# [reproducible choices] in lenet/plan.py). Other generations (75 and 80 were measured only as PTX on an sm_90 GPU)
# keep the timing. The measurements: docs/performance.md, "Notes' numbers".
MEASURED_FIRST = {90: {"stage": "ours", "head": "ours"}}


def measured_first(kind: str, policy, arch: int) -> str | None:
    """The engine the heuristic takes for operations of ``kind`` without timing the others, on compute capability
    ``arch`` under ``policy`` (Note [the heuristic's engine]); None: the engines are timed against each other."""
    if not policy.heuristic or policy.reproducible:
        return None
    return MEASURED_FIRST.get(int(arch) // 10 * 10, {}).get(kind)


def heuristic_runs_cudnn_stage(flag: str, policy, arch: int) -> bool:
    """Whether a first search under ``flag`` and ``policy`` on ``arch`` may run a stage on cuDNN (and so build
    cuDNN's graphs): what the start-up asks before it builds its first tiny graph with no choice stored (Note [a
    first graph only where one runs] in lenet/startup.py). False only where the heuristic takes, untimed, an
    engine that runs no cuDNN stage and whose flags' rules let it run."""
    lead = BY_NAME.get(measured_first("stage", policy, arch) or "")
    return lead is None or lead.cudnn_stage or flag not in flags_of(lead) or lead.refuses_flags(policy) is not None


def pins(name: str) -> tuple[str, ...]:
    """The policy directions an engine's own candidate name fixes (none: the name is cuDNN's, or no
    one's): what lets --algo name a candidate of ours as train_step prints it."""
    for e in ENGINES:
        directions = e.pins(name)
        if directions:
            return tuple(directions)
    return ()


def owner(name: str) -> str | None:
    """The engine whose own candidate ``name`` is (None: cuDNN's, or none)."""
    return next((e.name for e in ENGINES if e.pins(name)), None)


def runs_convolutions(flag: str) -> bool:
    """Whether --engine ``flag`` lets an engine that offers cuDNN's convolutions run: what a fixed --algo
    naming a cuDNN algorithm or plan needs."""
    return any(flag in flags_of(e) for e in offering("conv"))


def flag_errors(policy) -> str | None:
    """Why the engine ``policy.engine`` names cannot run under the rest of the policy, in one line, or None:
    the flags' rules only (no library is loaded; ``unavailable`` asks the libraries)."""
    e = by_flag(policy.engine)
    why = e.refuses_flags(policy) if e is not None else None
    return f"--engine {e.flag} {why}" if why else None


def unavailable(flag: str) -> str | None:
    """Why the engine --engine ``flag`` names cannot run here (its library is missing), in one line, or None."""
    e = by_flag(flag)
    why = e.unavailable() if e is not None else None
    return f"--engine {e.flag} cannot run here: {why}" if why else None


def warm(flag: str, batches=None, pack: bool = False, policy=None) -> None:
    """Start readying what the engines --engine ``flag`` lets compete will launch, at these batch sizes
    when they are known, for one model or (``pack``) packs of models, under the flags' ``policy`` when it
    is known (lenet/startup.py calls it once the flags are parsed)."""
    for e in ENGINES:
        if flag in flags_of(e):
            e.warm(batches, pack, policy)


def uses_frontend(flag: str) -> bool:
    """Whether --engine ``flag`` may build graph-API plans (and so load cuDNN's frontend)."""
    return any(e.frontend and flag in ("auto", e.flag) for e in ENGINES)


def cudnn_stages(names) -> bool:
    """Whether any of the engines ``names`` (a stored choice's "engine") runs a stage on cuDNN: what
    lenet/startup.py asks before it warms cuDNN's first graph (Note [a first graph only where one runs])."""
    return any(BY_NAME[n].cudnn_stage for n in names if n in BY_NAME)


def close(states: dict) -> None:
    """Close what each engine made for one model (its cuDNN objects)."""
    for name, state in states.items():
        if name in BY_NAME:
            BY_NAME[name].close(state)


__all__ = ["ENGINES", "BY_NAME", "FLAGS", "by_flag", "offering", "flags_of", "refusal", "serving", "serving_parts",
           "pins", "owner", "runs_convolutions", "flag_errors", "unavailable", "warm", "uses_frontend",
           "cudnn_stages", "close", "MEASURED_FIRST", "measured_first", "heuristic_runs_cudnn_stage"]
