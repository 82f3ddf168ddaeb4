"""The policy: which engines compete (--engine), how each direction's candidate is chosen (--algo), what
filters the candidates, and how the step may run them (fusion, chunks). The flags of the programs and
``lenet.torch.LeNet``'s arguments, as one frozen value; its ``key()`` is what every stored choice names.

Per direction (fwd, bwd-data, bwd-filter):
  heuristic   each engine's first-ranked candidate (cuDNN's own ranking; ours by rule), the engines
              then timed against each other; where this GPU's generation has measured rows, the engine
              they name, untimed (Note [the heuristic's engine] in lenet/engines/registry.py)
  exhaustive  every candidate timed
  NAME        one fixed candidate: a descriptor-API algorithm as cuDNN names it (``implicit_gemm``,
              ``fft``, ``algo_1``...), a graph-API plan as train_step prints it (``eng18_k11=0``), or
              one of an engine's own (``fused-bwd-v2-g4``: Note [pinned candidates] in lenet/engines/ours.py)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from descriptors.algorithms import (POLICIES, AlgoPolicy, Direction, UnknownAlgorithmError, check_choice,
                                    check_filters, describe_policy, parse_choices)

from . import registry

_FIELD = {Direction.FORWARD: "fwd", Direction.BACKWARD_DATA: "bwd_data", Direction.BACKWARD_FILTER: "bwd_filter"}


def _check_choice(direction: Direction, value: str) -> str:
    v = str(value).strip().lower()
    theirs = registry.pins(v)
    if theirs:
        if str(direction) not in theirs:
            raise UnknownAlgorithmError(f"{v} is a candidate of engine {registry.owner(v)} for {', '.join(theirs)}, "
                                        f"not {direction}")
        return v
    return check_choice(direction, v)


@dataclass(frozen=True)
class Policy:
    """``engine``: "auto" or an engine's flag (registry.FLAGS); per direction a choice (above);
    ``workspace_limit`` in bytes (None: none); ``deterministic``: only deterministic candidates, chosen
    by rule where the heuristic decides (Note [reproducible choices] in lenet/plan.py); ``allow_winograd``,
    ``allow_tf32``: let the less exact candidates compete; ``chunk``: images per call of cuDNN's
    convolutions and pooling (None: chosen by timing); ``fused``: let operations fuse (our fused
    kernels, conv + bias + ReLU in one cuDNN call, cuBLASLt's epilogues)."""

    fwd: str = "heuristic"
    bwd_data: str = "heuristic"
    bwd_filter: str = "heuristic"
    workspace_limit: int | None = None
    deterministic: bool = False
    allow_winograd: bool = False
    allow_tf32: bool = False
    engine: str = "auto"
    chunk: int | None = None
    fused: bool = True

    def __post_init__(self):
        for d in Direction:
            object.__setattr__(self, _FIELD[d], _check_choice(d, getattr(self, _FIELD[d])))
        check_filters(self.workspace_limit)
        if self.engine not in registry.FLAGS:
            raise ValueError(f"unknown engine {self.engine!r}; use one of {', '.join(registry.FLAGS)}")
        if self.chunk is not None and (not isinstance(self.chunk, int) or self.chunk < 1):
            raise ValueError(f"chunk must be a number of images >= 1, got {self.chunk!r}")
        object.__setattr__(self, "fused", bool(self.fused))
        owners = {registry.owner(c) or "cuDNN" for c in self.fixed_choices()}
        if len(owners) > 1:
            raise ValueError(f"the algorithm spec names candidates of {' and '.join(sorted(owners))}: one engine "
                             f"runs a stage's convolution, so name candidates of one")
        for c in self.fixed_choices():
            theirs = registry.owner(c)
            if theirs is not None and self.engine not in ("auto", registry.BY_NAME[theirs].flag):
                raise ValueError(f"--algo {c} names a candidate of engine {theirs}, but the engine is {self.engine}")
            if theirs is None and not registry.runs_convolutions(self.engine):
                raise ValueError(f"--algo {c} names a cuDNN algorithm or plan, but engine {self.engine} runs no "
                                 f"cuDNN convolution; use heuristic, exhaustive or one of its own candidates")
        why = registry.flag_errors(self)   # the flags' rules: a Policy is a value, and loads no library
        if why:
            raise ValueError(why)

    def checked(self) -> "Policy":
        """This policy, once the engine it names can run here (its library loads); else a one-line
        ValueError. What the programs ask after the flags' parse (constructing a Policy loads nothing)."""
        why = registry.unavailable(self.engine)
        if why:
            raise ValueError(why)
        return self

    def choice(self, direction) -> str:
        return getattr(self, _FIELD[Direction(direction)])

    def fixed(self, direction) -> bool:
        return self.choice(direction) not in POLICIES

    def fixed_choices(self) -> list[str]:
        return [self.choice(d) for d in Direction if self.fixed(d)]

    def owners(self) -> dict:
        """Each fixed choice -> the engine whose own candidate it is (None: cuDNN's)."""
        return {c: registry.owner(c) for c in self.fixed_choices()}

    @property
    def heuristic(self) -> bool:
        return all(self.choice(d) == "heuristic" for d in Direction)

    @property
    def reproducible(self) -> bool:
        """Timing decides nothing: deterministic under the heuristic (Note [reproducible choices])."""
        return self.deterministic and self.heuristic

    def cudnn(self) -> AlgoPolicy:
        """What cuDNN's candidate sources filter by: the choices that are cuDNN's (another engine's pinned
        name leaves that direction to the heuristic there) and the filters."""
        kw = {_FIELD[d]: (self.choice(d) if registry.owner(self.choice(d)) is None else "heuristic")
              for d in Direction}
        return AlgoPolicy(**kw, workspace_limit=self.workspace_limit, deterministic=self.deterministic,
                          allow_winograd=self.allow_winograd, allow_tf32=self.allow_tf32)

    def replace(self, **changes) -> "Policy":
        return dataclasses.replace(self, **changes)

    def key(self) -> list:
        """What every stored choice made under this policy names of it."""
        return [*(self.choice(d) for d in Direction), self.engine, self.workspace_limit, self.deterministic,
                self.allow_winograd, self.allow_tf32, self.chunk, self.fused]

    @classmethod
    def parse(cls, spec: str, workspace_limit: int | None = None, deterministic: bool = False,
              allow_winograd: bool = False, *, engine: str = "auto", allow_tf32: bool = False,
              chunk: int | None = None, fused: bool = True) -> "Policy":
        """A Policy from an algorithm spec (descriptors.algorithms.parse_choices, with the names the
        registry's engines own) and the flags."""
        return cls(**parse_choices(spec, registry.pins), workspace_limit=workspace_limit,
                   deterministic=deterministic, allow_winograd=allow_winograd, allow_tf32=allow_tf32, engine=engine,
                   chunk=chunk, fused=fused)

    def __str__(self) -> str:
        extra = f" (engine {self.engine})" + (f" (chunks of {self.chunk})" if self.chunk is not None else "")
        return describe_policy(self, extra)


__all__ = ["Policy"]
