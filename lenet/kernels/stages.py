"""Our stage kernels (stage*.cu): each stage's versions as their files declare them (Note [module
declarations] in lenet/kernels/__init__.py), their launch shapes with the names train_step prints and
--algo takes, and their launchers, which own the grid math.

    stage_forward(kernels, Forward(images=1, per_sm=8), n, stream, x, w, b, y, arg)   # a Launch
    stage_backward(kernels, Backward(per_sm=4, version=2), n, stream, part, x, w, arg, dy, dw, db, dx)

A forward's launch shape is its version, the images a block takes per iteration and its blocks per SM;
a backward's, its version and blocks per SM. The heuristic's order: each list's first, with the
versions a file declares ``prefer=large`` (from LARGE_BATCH_PER_SM images per SM on) or ``prefer=small``
(up to SMALL_BATCH_PER_SM) moved first at those batches.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np

from . import declared, kernel, pack_module, sm_count
from .launch import Launch

BACKWARD_BLOCKS_PER_SM = (4, 2, 8, 16)   # the first is the heuristic's (scripts/probes/stage_kernels.py)
FORWARD_BLOCKS_PER_SM = (8, 4, 16)
# From this many images per SM on, the heuristic takes a stage's ``prefer=large`` forward first.
# scripts/probes/stage_kernels.py on an H100 (132 SMs), conv2's best v1 against best v2: 6.9 / 10.5 us
# at 256 images, 9.2 / 15.8 at 512, 16.1 / 12.5 at 1024, 28.5 / 19.1 at 2048, 103.6 / 75.7 at 8192.
LARGE_BATCH_PER_SM = 6
# Up to this many images per SM, the heuristic takes a stage's ``prefer=small`` backward first, above it
# its ``prefer=large`` one. scripts/probes/stage_kernels.py on an H100 (132 SMs), conv2's best
# v1 / v2 / v3 / v4: 14.0 / 10.6 / 9.7 / 10.6 us at 64 images, 17.1 / 17.3 / 10.3 / 14.0 at 128; and at
# 4 blocks per SM (the heuristic's shape) v2 / v3 / v4: 47.4 / 54.8 / 47.5 us at 1024 (v4 at 2 per SM:
# 37.0), 318.9 / 345.2 / 164 at 8192, 2465 / 2604 / 1169 at 65536 (v4, the dense version: Note [dense
# stage backward] in stage2_backward_dense.cu); conv1's v1 / v2 (its dense version) 9.06 / 6.96 ns per image
# at 8192, 8.55 / 6.26 at 65536. conv2's v1 compiles in twice v2's time, which a first run
# waits for (Note [first run] in lenet/kernels/nvrtc.py): it compiles only when a search times it.
SMALL_BATCH_PER_SM = 2
# The stage shapes our kernels are written for (stage_common.cu's constants): (x, w, dx) -> stage.
SHAPES = {((1, 28, 28), (6, 1, 5, 5), False): "conv1", ((6, 12, 12), (16, 6, 5, 5), True): "conv2"}


@dataclass(frozen=True)
class Forward:
    images: int       # per block iteration
    per_sm: int       # blocks per SM (the grid is at most per_sm * SMs, and at most what the batch needs)
    version: int = 0  # index into StageKernels.forward

    @property
    def name(self) -> str:
        return f"fused-fwd-v{self.version + 1}-i{self.images}-g{self.per_sm}"

    def grid(self, n: int, models: int = 1) -> int:
        """Blocks per model (Note [model from the grid] in stage_common.cu): a pack shares the SMs."""
        return max(1, min(-(-n // self.images), -(-self.per_sm * sm_count() // models)))


@dataclass(frozen=True)
class Backward:
    per_sm: int
    version: int = 0   # index into StageKernels.backward

    @property
    def name(self) -> str:
        return f"fused-bwd-v{self.version + 1}-g{self.per_sm}"

    def grid(self, n: int, models: int = 1) -> int:
        """Blocks per model (Note [model from the grid] in stage_common.cu): a pack shares the SMs."""
        return max(1, min(n, -(-self.per_sm * sm_count() // models)))


@dataclass(frozen=True)
class StageKernels:
    """One stage shape's kernels: its forward and backward versions (lenet.kernels.Module, in version
    order) and the widths of a block's partial-sum row."""

    stage: str
    forward: tuple
    backward: tuple
    mw: int            # weight-gradient columns of a block's partial row (K * C * R * S)
    mb: int            # bias-gradient columns (K)

    @property
    def width(self) -> int:
        return self.mw + self.mb

    @staticmethod
    def _first(versions, prefer: str) -> int:
        return next((i for i, m in enumerate(versions) if m.prefer == prefer), 0)

    def forward_candidates(self, n: int | None = None) -> list:
        """Every forward launch shape, the heuristic's first (see the module's docstring)."""
        cands = [Forward(i, g, v) for v, m in enumerate(self.forward) for g in FORWARD_BLOCKS_PER_SM for i in m.images]
        if n is not None and n >= LARGE_BATCH_PER_SM * sm_count():
            large = self._first(self.forward, "large")
            cands.sort(key=lambda c: c.version != large)   # stable: each version's order stays
        return cands

    def backward_candidates(self, n: int | None = None) -> list:
        """Every backward launch shape, the heuristic's first (see the module's docstring)."""
        cands = [Backward(g, v) for v in range(len(self.backward)) for g in BACKWARD_BLOCKS_PER_SM]
        if n is not None:
            first = self._first(self.backward, "small" if n <= SMALL_BATCH_PER_SM * sm_count() else "large")
            cands.sort(key=lambda c: c.version != first)   # stable: each version's order stays
        return cands

    def offers(self, cand) -> bool:
        if isinstance(cand, Forward):
            return 0 <= cand.version < len(self.forward) and cand.images in self.forward[cand.version].images \
                and cand.per_sm >= 1
        return 0 <= cand.version < len(self.backward) and cand.per_sm >= 1

    def modules(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.forward + self.backward)


@functools.lru_cache(maxsize=None)
def kernels() -> dict[tuple, StageKernels]:
    """(x, w, dx) of a stage -> its kernels, from the declarations."""
    out = {}
    for shape, stage in SHAPES.items():
        mods = [m for m in declared().values() if m.stage == stage]
        by = {d: tuple(sorted((m for m in mods if m.direction == d), key=lambda m: m.version))
              for d in ("forward", "backward")}
        k, c, r, s = shape[1]
        out[shape] = StageKernels(stage, by["forward"], by["backward"], k * c * r * s, k)
    return out


def for_spec(spec) -> StageKernels | None:
    """The kernels of a StageSpec's shape, or None (no kernel of ours for it)."""
    return kernels().get((spec.x, spec.w, spec.dx))


# Our candidates' names, as train_step prints them and --algo takes them (Note [pinned candidates] in
# lenet/engines/ours.py).
_NAME = re.compile(r"fused-(fwd)-v(\d+)-i(\d+)-g(\d+)|fused-(bwd)-v(\d+)-g(\d+)")


def parse_name(name: str):
    """The Forward or Backward a candidate name stands for, or None (not one of ours)."""
    m = _NAME.fullmatch(str(name).strip().lower())
    if m is None:
        return None
    if m.group(1):
        return Forward(int(m.group(3)), int(m.group(4)), int(m.group(2)) - 1)
    return Backward(int(m.group(7)), int(m.group(6)) - 1)


def names() -> str:
    """Every launch shape's name pattern, per stage, from the declarations (for messages)."""
    out = []
    for ks in kernels().values():
        fwd = ", ".join(f"fused-fwd-v{m.version}-i{{{','.join(map(str, m.images))}}}-gN" for m in ks.forward)
        bwd = ", ".join(f"fused-bwd-v{m.version}-gN" for m in ks.backward)
        out.append(f"{ks.stage}: {fwd}, {bwd}")
    return "; ".join(out) + " (N blocks per SM, N >= 1)"


def modules() -> tuple[str, ...]:
    """Every module our stage kernels may launch."""
    return tuple(dict.fromkeys([m for ks in kernels().values() for m in ks.modules()] + ["stage_reduce"]))


def heuristic_modules(batches=None) -> tuple[str, ...]:
    """The modules of the launch shapes the heuristic takes first: each stage's forward versions for small
    and large batches (small modules), its backward versions for these batch sizes (without them, for
    any batch), and the reduction."""
    out = []
    for ks in kernels().values():
        out += [ks.forward[0].name, ks.forward[ks._first(ks.forward, "large")].name]
        out += ([ks.backward[ks.backward_candidates(n)[0].version].name for n in batches] if batches else
                [ks.backward[ks._first(ks.backward, p)].name for p in ("large", "small")])
    return tuple(dict.fromkeys(out + ["stage_reduce"]))


def function(module, models: int = 1):
    """The kernel of one of our stage modules (each holds one, named after it), its pack version for a pack
    of ``models`` > 1 (Note [model from the grid] in stage_common.cu)."""
    return kernel(pack_module(module.name, models), module.kernel)


def stage_forward(ks: StageKernels, cand: Forward, n: int, stream, x, w, b, y, arg, models: int = 1,
                  ps: int = 0, share: int | None = None) -> Launch:
    """A launch of the stage's forward on the first n images of each of ``models`` models (their
    parameters ``ps`` floats apart: Note [model from the grid] in stage_common.cu), on ``stream``; each
    model's grid as ``share`` models (default: all of them) share the SMs, 1 for a lone run's grid."""
    m = ks.forward[cand.version]
    grid, threads = cand.grid(n, models if share is None else share), m.threads * cand.images
    return Launch(function(m, models), (grid, models), (threads,), (x, w, b, y, arg, np.int32(n), np.int32(ps)), stream,
                  m.smem_bytes(cand.images))


def stage_backward(ks: StageKernels, cand: Backward, n: int, stream, part, x, w, arg, dy, dw, db, dx=None,
                   side=None, models: int = 1, ps: int = 0, share: int | None = None):
    """A zero-argument launch of the stage's backward on ``stream``, then the reduction of its partial
    sums: on ``side`` (lenet.plan.SideStream, Note [side stream]) when given, else on ``stream``. A grid
    of one block writes dw and db itself, and no reduction runs. ``share`` as for stage_forward: each
    model's weight gradients are summed over its grid's blocks, so a lone run's grid (1) sums them as the
    lone run does (Note [a pack and a lone run] in lenet/pack.py)."""
    m = ks.backward[cand.version]
    fn, grid = function(m, models), cand.grid(n, models if share is None else share)
    reduce = kernel(pack_module("stage_reduce", models), "stage_reduce_kernel")
    if part.shape[0] < grid * models:
        raise ValueError(f"partial-sum buffer has {part.shape[0]} rows, the launch needs {grid * models}")
    args = ((x, arg, dy, part, dw, db, np.int32(n), np.int32(ps)) if dx is None else
            (x, w, arg, dy, dx, part, dw, db, np.int32(n), np.int32(ps)))
    red = (part, dw, db, np.int32(grid), np.int32(ks.mw), np.int32(ks.mb), np.int32(ps))
    backward = Launch(fn, (grid, models), (m.threads,), args, stream)
    if grid == 1:
        return backward
    summed = Launch(reduce, (-(-ks.width // 32), models), (256,), red, stream if side is None else side.stream)

    def run():
        backward()
        if side is None:
            summed()
        else:
            side.run(summed)
    return run
