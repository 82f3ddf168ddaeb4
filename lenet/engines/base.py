"""The protocol every engine follows, and what the planner hands back and forth with it.

An engine is whatever can run operations of the network (lenet/ops.py: a stage, the head, the loss,
the update) or the parts of one (a convolution direction, a max pooling): one class in one file of
this package, listed once in lenet/engines/registry.py. The planner (lenet/plan.py) asks every engine
the registry lists for an operation, and chooses by measurement:

    class Engine(Protocol):
        name: str                                    # what stored choices and describe() say
        flag: str | None                             # the --engine value that runs it (None: it runs beside)
        kinds: tuple[str, ...]                       # the operations (and parts) it offers
        def refuses(self, op, policy) -> str | None      # None, or why it cannot run op under policy
        def candidates(self, op, n, planner) -> list     # its ways to run op at batch n: named, each bound by bind
        def check(self, op, candidate, planner)          # -> Check: its distance from the exact reference
        def bind(self, op, n, candidate, planner)        # -> a PlannedOp on op's tensors, at batch n
        def recall(self, op, n, stored, planner)         # -> the candidate a stored choice names, if offered still

A planned operation holds its tensors, plans and workspace share, runs with no arguments (so a step
can be captured in a CUDA graph) and describes itself for the programs:

    class PlannedOp(Protocol):
        workspace_bytes: int
        def forward(self) -> None: ...               # (a stage's, the head's; the loss and update run
        def backward(self) -> None: ...              #  as their own kinds say)
        def describe(self) -> list[dict]: ...        # engine, plan or kernel, chunk, time, workspace, error
        masks_dy: bool                               # a stage's: its backward masks dy by its own ReLU, so the
                                                     # head above may leave it unmasked (lenet/ops.py: Head)
        masks_dx: bool                               # the head's: it masked dx by x > 0 itself

An engine keeps nothing mutable of its own: what it makes for a model (cuDNN's descriptors and graphs,
scratch buffers, its checks) lives in ``planner.state(engine)``, which the model owns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


LONE_SUMS_PER_SM = 4   # a pack's images per SM up to which its models sum as their lone runs (measured below)


def sums_as_lone(models: int, n: int, policy, sms: int | None = None) -> bool:
    """Whether each model of a pack of ``models`` at n images each sums as its lone run does: its lone
    run's launch shapes and matmuls (Note [a pack and a lone run] in lenet/pack.py). Always under
    --deterministic; otherwise while the pack holds at most LONE_SUMS_PER_SM images per SM, where the
    lone runs' grids cost what a shared one does (an H100, 128 images a model, us per step shared /
    lone: 3 models 85.8 / 86.3, 4 93.1 / 94.2, 16 201.0 / 277.6, 64 594.6 / 1081.8). ``sms``: the
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


@dataclass(frozen=True)
class Named:
    """A candidate that is its name (an engine with one way to run an operation)."""

    engine: str
    name: str

    def encode(self) -> dict:
        return {"name": self.name}


class PlannedOp(Protocol):
    workspace_bytes: int
    masks_dy: bool   # a stage's only
    masks_dx: bool   # the head's only

    def describe(self) -> list[dict]: ...


class Engine(Protocol):
    name: str
    flag: str | None
    kinds: tuple

    def refuses(self, op, policy) -> str | None: ...

    def candidates(self, op, n: int, planner) -> list: ...

    def check(self, op, candidate, planner) -> Check: ...

    def bind(self, op, n: int, candidate, planner): ...

    def recall(self, op, n: int, stored: dict, planner): ...


class ConvEngine:
    """What an engine offering convolution directions from one of cuDNN's candidate sources does (the
    descriptor API's LegacyConvs, the graph API's GraphConvs: ``Source``), its rules aside: the source is
    the model's (``planner.state``), made on first use and closed with the model."""

    name = ""
    Source = None
    kinds = ("conv",)
    cudnn_stage = True   # a stage it runs calls cuDNN (registry.cudnn_stages)

    def source(self, planner):
        state = planner.state(self.name)
        if "convs" not in state:
            state["convs"] = self.Source()
        return state["convs"]

    def conv_candidates(self, spec, planner, policy=None):
        """(candidates in cuDNN's heuristic order, {name: why excluded}) under the model's policy or ``policy``."""
        policy = policy or planner.policy
        return self.source(planner).candidates(planner.handle, spec, policy.cudnn(), policy.fused)

    def offers(self, spec, cand, planner) -> bool:
        return self.source(planner).offers(planner.handle, spec, cand, planner.policy.cudnn(), planner.policy.fused)

    def bind_conv(self, spec, cand, arrays, workspace, planner):
        return self.source(planner).bind(planner.handle, spec, cand, arrays, workspace)

    def close(self, state: dict) -> None:
        if "convs" in state:
            state.pop("convs").close()
