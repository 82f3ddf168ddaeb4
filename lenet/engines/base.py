"""The protocol every engine follows, and what the planner hands back and forth with it: every method and
attribute a caller uses on an engine or a planned operation is declared here, with its default, so an
engine overrides only what it has (docs/engines.md, "The protocol").

An engine is whatever can run operations of the network (lenet/ops.py: a stage, the head, the loss,
the update) or the parts of one (a convolution direction): one class in one file of this package,
listed once in lenet/engines/registry.py. The planner (lenet/plan.py) asks every engine the registry
lets serve an operation for its candidates, binds each, and chooses by measurement:

    class Engine:
        name: str                                    # what stored choices and describe() say
        flag: str | None                             # the --engine value that runs it alone (None: it runs beside)
        kinds: tuple[str, ...]                       # the operations (and parts) it offers
        runs: str                                    # what --engine <flag> runs, in words (refusals say it)
        runs_beside: tuple[str, ...]                 # no flag: it runs under the flags of the engines offering these kinds
        everywhere: tuple[str, ...]                  # kinds it runs under every flag
        frontend, cudnn_stage: bool                  # may load cuDNN's frontend; runs a stage on cuDNN
        def pins(name) -> tuple[str, ...]            # the policy directions its own candidate name fixes
        def refuses(op, policy) -> str | None        # its own rules (the flag's are the registry's)
        def refuses_flags(policy) -> str | None      # the flags' rules for --engine <flag>, loading no library
        def unavailable() -> str | None              # why it cannot run here (may load libraries)
        def version() -> str                         # what a stored choice of it depends on
        def scratch_per_image(op, policy) -> int     # bytes per image of max_batch it allocates for op
        def warm(batches, pack, policy)              # start readying what it will launch
        def candidates(op, n, planner) -> list       # its ways to run op at batch n: named, each bound by bind
        def recall(op, n, stored, planner)           # the candidate a stored choice names, if offered still
        def bind(op, n, candidate, planner)          # -> a PlannedOp on op's tensors (raises
                                                     #    AlgorithmNotSupportedError where it cannot)
        def close(state)                             # free what it made for one model

A planned operation holds its tensors, plans and workspace share, runs with no arguments (so a step
can be captured in a CUDA graph) and describes itself for the programs (PlannedOp below); the planner
hands back the winner as a ``Chosen``: the planned operation with the times of every candidate and
why each other engine was refused.

An engine keeps nothing mutable of its own: what it makes for a model (cuDNN's descriptors and graphs,
scratch buffers, its checks) lives in ``planner.state(engine)``, which the model owns; what every engine
shares (the handle, the stream, cuBLAS, cuBLASLt, the side stream, the workspace) is the model's one
``planner.ctx`` (lenet/engines/context.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from descriptors.candidates import Candidate as ConvCandidate


LONE_SUMS_PER_SM = 4   # a pack's images per SM up to which its models sum as their lone runs (docs/engines.md)


def sums_as_lone(models: int, n: int, policy, sms: int | None = None) -> bool:
    """Whether each model of a pack of ``models`` at n images each sums as its lone run does: its lone
    run's launch shapes and matmuls (Note [a pack and a lone run] in lenet/pack.py). Always under
    --deterministic; otherwise while the pack holds at most LONE_SUMS_PER_SM images per SM, where the
    lone runs' grids cost what a shared one does (docs/engines.md, "A pack's grids"). ``sms``: the
    GPU's multiprocessors (default: the current GPU's)."""
    if models == 1 or policy.deterministic:
        return True
    if sms is None:
        from ..kernels import sm_count

        sms = sm_count()
    return models * n <= LONE_SUMS_PER_SM * sms


@dataclass(frozen=True)
class Check:
    """A candidate against its operation's exact reference: the distance (norm-wise relative, or None
    where the engine is the reference), near-tie decisions it took otherwise (counted, allowed), and why
    it fails (None: it passes)."""

    error: float | None = None
    ties: int = 0
    why: str | None = None


@dataclass
class Trial:
    """A candidate that passed its check: its time (ms per call, None where it was not timed), its check,
    and what binding it made (a planned operation, a launcher)."""

    candidate: object
    ms: float | None
    check: Check = field(default_factory=Check)
    plan: object = None

    @property
    def error(self) -> float | None:
        return self.check.error


@dataclass
class Decision:
    """What the planner's loop found: the surviving candidates, fastest first (in the order tried where
    timing decides nothing), those refused with why, and whether it came from the store."""

    table: list
    refused: dict
    recalled: bool = False

    @property
    def best(self) -> Trial:
        return self.table[0]


class Candidate(Protocol):
    engine: str
    name: str

    def encode(self) -> dict: ...


def label(c) -> str:
    """How a candidate is named in a decision's table: its engine and name (a convolution's, its own label,
    which says whether its epilogue is fused)."""
    if isinstance(c, ConvCandidate):
        return c.label
    return f"{c.engine}:{c.name}" if c.engine else c.name


@dataclass(frozen=True)
class Named:
    """A candidate that is its name (an engine with one way to run an operation)."""

    engine: str
    name: str

    def encode(self) -> dict:
        return {"name": self.name}


class PlannedOp:
    """An operation bound to its tensors at one batch size, by one engine; each engine's subclass overrides
    what it runs. A stage or the head: forward, backward; the head also forward_loss (the training forward:
    the loss and dlogits too, by itself where ``fuses_loss``, else by the planned loss after it) and
    backward_given (every gradient from dlogits the caller wrote). The loss: train, evaluate. The update:
    called."""

    engine: str = ""
    workspace_bytes: int = 0
    masks_dy: bool = False     # a stage's: its backward masks dy by its own ReLU, so the head above may
                               # leave it unmasked (lenet/ops.py: Head)
    masks_dx: bool = False     # the head's: it masked dx by x > 0 itself
    fuses_loss: bool = False   # the head's: its training forward computes the loss and dlogits itself

    def forward(self) -> None:
        raise NotImplementedError

    def backward(self) -> None:
        raise NotImplementedError

    def forward_loss(self) -> None:
        self.forward()

    def backward_given(self) -> None:
        self.backward()

    def train(self) -> None:                   # the loss's
        raise NotImplementedError

    def evaluate(self, mean_with=None) -> None:   # the loss's
        raise NotImplementedError

    def __call__(self) -> None:                # the update's
        raise NotImplementedError

    def describe(self, ms: float | None = None) -> list[dict]:
        """Rows of engine, plan or kernel, chunk, time, workspace, error; ``ms``: what the planner measured
        for it (None: not timed)."""
        return []


def forward_only_error(name: str, n: int) -> RuntimeError:
    """What a backward of an operation planned forward only raises (Note [forward-only plans] in lenet/ops.py)."""
    return RuntimeError(f"{name} at batch {n} was planned forward only (a batch size only evaluated): "
                        f"plan the batch size for training first")


class Chosen(PlannedOp):
    """What the planner hands back for an operation: the winning engine's planned operation (``op``), its
    time, the time of every candidate (``times``: label -> ms), and why each other engine was refused
    (``why_not``). Its methods are the planned operation's own, bound once (no call in between)."""

    def __init__(self, op: PlannedOp, ms: float | None, times: dict, why_not: dict):
        self.op, self.ms, self.times, self.why_not = op, ms, times, why_not
        self.engine, self.workspace_bytes = op.engine, op.workspace_bytes
        self.masks_dy, self.masks_dx, self.fuses_loss = op.masks_dy, op.masks_dx, op.fuses_loss
        self.forward, self.backward = op.forward, op.backward
        self.forward_loss, self.backward_given = op.forward_loss, op.backward_given
        self.train, self.evaluate = op.train, op.evaluate

    def __call__(self) -> None:
        self.op()

    def describe(self, ms: float | None = None) -> list[dict]:
        return self.op.describe(self.ms if ms is None else ms)


class Engine:
    """The protocol (above), with every default: an engine overrides only what it has."""

    name: str = ""
    flag: str | None = None
    kinds: tuple = ()
    runs: str = ""
    runs_beside: tuple = ()
    everywhere: tuple = ()
    frontend: bool = False
    cudnn_stage: bool = False

    def pins(self, name: str) -> tuple[str, ...]:
        return ()

    def refuses(self, op, policy) -> str | None:
        return None

    def refuses_flags(self, policy) -> str | None:
        return None

    def unavailable(self) -> str | None:
        return None

    def version(self) -> str:
        return ""

    def scratch_per_image(self, op, policy) -> int:
        return 0

    def warm(self, batches=None, pack: bool = False, policy=None) -> None:
        return None

    def candidates(self, op, n: int, planner) -> list:
        raise NotImplementedError

    def recall(self, op, n: int, stored: dict, planner):
        """The candidate whose encoding a stored choice holds, if offered still."""
        return next((c for c in self.candidates(op, n, planner)
                     if all(stored.get(k) == v for k, v in c.encode().items())), None)

    def bind(self, op, n: int, candidate, planner) -> PlannedOp:
        raise NotImplementedError

    def close(self, state: dict) -> None:
        state.clear()


class ConvEngine(Engine):
    """What an engine offering convolution directions from one of cuDNN's candidate sources does (the
    descriptor API's LegacyConvs, the graph API's GraphConvs: ``Source``), its rules aside: the source is
    the model's (``planner.state``), made on first use (its candidates named by this engine) and closed
    with the model."""

    Source = None
    kinds = ("conv",)
    names_winograd = False   # what a fixed --algo may name of it includes Winograd's algorithms
    cudnn_stage = True   # a stage it runs calls cuDNN (registry.cudnn_stages)

    def source(self, planner):
        state = planner.state(self.name)
        if "convs" not in state:
            state["convs"] = self.Source(self.name)
        return state["convs"]

    def conv_candidates(self, spec, planner, policy=None, first: bool = False):
        """(candidates in cuDNN's heuristic order, {name: why excluded}) under the model's policy or ``policy``;
        ``first``: the search tries only the first that passes (Note [the heuristic's one plan] in
        descriptors/graph.py)."""
        policy = policy or planner.policy
        return self.source(planner).candidates(planner.ctx.handle, spec, policy.cudnn(), policy.fused, first=first)

    def offers(self, spec, cand, planner) -> bool:
        return self.source(planner).offers(planner.ctx.handle, spec, cand, planner.policy.cudnn(),
                                           planner.policy.fused)

    def bind_conv(self, spec, cand, arrays, workspace, planner):
        return self.source(planner).bind(planner.ctx.handle, spec, cand, arrays, workspace)

    def close(self, state: dict) -> None:
        if "convs" in state:
            state.pop("convs").close()
        state.clear()
