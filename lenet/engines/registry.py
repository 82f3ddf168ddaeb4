"""The one registry of engines: every answer about engines (what --engine offers, who runs an operation,
who owns a candidate name --algo gives, what start-up warms, what a stored choice may name) comes from
ENGINES below, in the order of preference where timing decides nothing.

    ours      our kernels: fused stages, the head, the loss, the update          --engine ours
    cudnn     a stage by parts on cuDNN: each convolution direction by the engines that offer
              convolutions (below), chunked, then cuDNN's max pooling             (with legacy, graph)
    legacy    cuDNN's descriptor API: convolution algorithms                      --engine legacy
    graph     cuDNN's graph API: convolution execution plans                      --engine graph
    cublaslt  the head on cuBLASLt's epilogues (or cuBLAS and cuDNN's bias and ReLU) (with legacy, graph)

``--engine auto`` lets every engine compete; ``--engine NAME`` runs the engine whose flag is NAME, and
the engines with no flag of their own that run beside it (the cuDNN stage by parts and the cuBLAS head
beside a cuDNN convolution engine). An engine's rules are written once, in its file.
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


def offering(kind: str) -> list:
    """The engines that offer operations (or parts) of ``kind``, in the registry's order."""
    return [e for e in ENGINES if kind in e.kinds]


def serving(op, policy) -> tuple[list, dict]:
    """(the engines that may run ``op`` under ``policy``, {engine: why not} for the others)."""
    ok, why_not = [], {}
    for e in offering(op.kind):
        why = e.refuses(op, policy)
        if why is None:
            ok.append(e)
        else:
            why_not[e.name] = why
    return ok, why_not


def pins(name: str) -> tuple[str, ...]:
    """The policy directions an engine's own candidate name fixes (none: the name is cuDNN's, or no
    one's): what lets --algo name a candidate of ours as train_step prints it."""
    for e in ENGINES:
        got = getattr(e, "pins", None)
        directions = got(name) if got is not None else ()
        if directions:
            return tuple(directions)
    return ()


def owner(name: str) -> str | None:
    """The engine whose own candidate ``name`` is (None: cuDNN's, or none)."""
    for e in ENGINES:
        got = getattr(e, "pins", None)
        if got is not None and got(name):
            return e.name
    return None


def flag_errors(policy) -> str | None:
    """Why the engine ``policy.engine`` names cannot run under the rest of the policy, in one line, or None."""
    for e in ENGINES:
        if e.flag == policy.engine:
            check = getattr(e, "refuses_flags", None)
            why = check(policy) if check is not None else None
            if why:
                return f"--engine {e.flag} {why}"
    return None


def warm(flag: str, batches=None) -> None:
    """Start readying what the engines --engine ``flag`` lets compete will launch, at these batch sizes
    when they are known (lenet/startup.py calls it once the flags are parsed)."""
    for e in ENGINES:
        w = getattr(e, "warm", None)
        if w is not None and (flag == "auto" or flag == e.flag or flag in getattr(e, "beside", ())):
            w(batches)


def uses_frontend(flag: str) -> bool:
    """Whether --engine ``flag`` may build graph-API plans (and so load cuDNN's frontend)."""
    return any(getattr(e, "frontend", False) and flag in ("auto", e.flag) for e in ENGINES)


def cudnn_stages(names) -> bool:
    """Whether any of the engines ``names`` (a stored choice's "engine") runs a stage on cuDNN: what
    lenet/startup.py asks before it warms cuDNN's first graph (Note [a first graph only where one runs])."""
    return any(getattr(BY_NAME.get(n), "cudnn_stage", False) for n in names)


def close(states: dict) -> None:
    """Close what each engine made for one model (its cuDNN objects)."""
    for name, state in states.items():
        done = getattr(BY_NAME.get(name), "close", None)
        if done is not None:
            done(state)


__all__ = ["ENGINES", "BY_NAME", "FLAGS", "offering", "serving", "pins", "owner", "flag_errors", "warm",
           "uses_frontend", "cudnn_stages", "close"]
