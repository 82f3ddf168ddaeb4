"""A stage's problem, its tensors, and the protocol every stage engine follows."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol

from descriptors.engines import ConvSpec


@dataclass(frozen=True)
class StageSpec:
    """conv (K x C x R x S, valid, stride 1) + bias + ReLU + 2x2/2 max-pool on (C, H, W) inputs:
    pointer-free, so it keys caches and stored choices. ``dx``: the stage computes its input's
    gradient, masked by the input being > 0 (the input is the previous stage's ReLU output)."""

    name: str       # the parameters' prefix: "conv1"
    x: tuple        # (C, H, W)
    w: tuple        # (K, C, R, S)
    dx: bool = False

    def __post_init__(self):
        object.__setattr__(self, "x", tuple(int(v) for v in self.x))
        object.__setattr__(self, "w", tuple(int(v) for v in self.w))
        if len(self.x) != 3 or len(self.w) != 4 or self.x[0] != self.w[1]:
            raise ValueError(f"stage {self.name}: x must be (C, H, W) and w (K, C, R, S) with the same C, "
                             f"got {self.x} and {self.w}")
        h, w = self.conv_hw
        if h < 2 or w < 2 or h % 2 or w % 2:
            raise ValueError(f"stage {self.name}: the {h}x{w} convolution output cannot be pooled 2x2/2")

    @property
    def conv_hw(self) -> tuple[int, int]:
        return self.x[1] - self.w[2] + 1, self.x[2] - self.w[3] + 1

    @property
    def conv_chw(self) -> tuple[int, int, int]:
        return (self.w[0], *self.conv_hw)

    @property
    def y(self) -> tuple[int, int, int]:
        """The pooled output's (K, H / 2, W / 2)."""
        h, w = self.conv_hw
        return self.w[0], h // 2, w // 2

    def conv(self, direction: str, n: int, epilogue: str = "") -> ConvSpec:
        """The ConvSpec of one direction of this stage's convolution at batch n."""
        return ConvSpec(direction, int(n), self.x, self.w, epilogue=epilogue)

    def key(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class StageTensors:
    """The full-batch arrays a stage reads and writes (a batch of n uses their first n rows).

    x (N, C, H, W) input; y (N, K, H/2, W/2) pooled output; dy its gradient, already masked by
    y > 0 (Note [relu at the pooled level] in lenet/ops/conv.py); dx the input's gradient (or None),
    masked by x > 0; w, b the parameters; dw, db their gradients (views into the flat buffers)."""

    x: object
    y: object
    dy: object
    w: object
    b: object
    dw: object
    db: object
    dx: object = None

    def rows(self, n: int) -> "StageTensors":
        cut = (lambda a: None if a is None else a[:n])
        return dataclasses.replace(self, x=cut(self.x), y=cut(self.y), dy=cut(self.dy), dx=cut(self.dx))


class EnginePlan(Protocol):
    """One engine's way to run a stage at one batch size, bound to its tensors."""

    engine: str
    forward: Callable[[], None]
    backward: Callable[[], None]
    workspace_bytes: int

    def describe(self) -> list[dict]: ...

    def choice(self) -> dict: ...   # what rebuilds this plan without a search (a stored choice)


class StageEngine(Protocol):
    """A source of stage plans: one class in one file, listed in lenet.stages.ENGINES."""

    name: str

    def serves(self, engine: str) -> bool: ...     # whether --engine ``engine`` lets it compete

    def warm(self, batches=None) -> None: ...      # compile what it will launch at these batch sizes (start-up calls it)

    def refuses(self, spec: StageSpec, ctx) -> str | None: ...   # None, or why it cannot run the stage

    def plan(self, ctx, stage, n: int, stored: dict | None = None) -> EnginePlan: ...
