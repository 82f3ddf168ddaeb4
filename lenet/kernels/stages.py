"""Our stage kernels (stage*.cu): each stage's versions as their files declare them (Note [module
declarations] in lenet/kernels/__init__.py), their launch shapes with the names train_step prints and
--algo takes, and their launchers, which own the grid math.

    stage_forward(kernels, Forward(images=1, per_sm=8), n, stream, x, w, b, y, arg)   # a Launch
    stage_backward(kernels, Backward(per_sm=4, version=2), n, stream, part, x, w, arg, dy, dw, db, dx)

A forward's launch shape is its version, the images a block takes per iteration and its blocks per SM;
a backward's, its version and blocks per SM. The heuristic's order: each list's first, with the shape
HEURISTIC names for the batch's images per SM moved first.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import declared, kernel, pack_module, sm_count
from .launch import Launch, resident


def kernel_arch() -> int:
    """lenet.kernels.arch(), looked up at each call (a name bound at import would keep what a test had put
    there then)."""
    from . import arch

    return arch()


BACKWARD_BLOCKS_PER_SM = (4, 3, 2, 8, 16)   # the launch shapes a search times (scripts/probes/stage_kernels.py)
FORWARD_BLOCKS_PER_SM = (8, 4, 16)
# The heuristic's first candidate, per stage and direction: the first row whose bound the batch's images
# per SM are below, chosen on whole steps, not kernels alone (scripts/probes/heuristic_rows.py; the
# measurements: docs/kernels.md, "The heuristic's rows", and each version's section).
INF = float("inf")
# The rows of each generation, keyed by the lowest compute capability they are for: ``table`` takes those
# of the newest generation at most the GPU's (or LENET_KERNEL_ARCH's). From 90, with programmatic launch
# between the kernels. Below 90 there is none, and below 80 no tensor-core version of stage 2's backward
# (cp.async and TF32 products: versions 7 and 8 declare arch=80), so generation 75's rows take versions 3-5:
# the fallback where the faster versions cannot run. The rows below 90 were measured on an sm_90 GPU running each
# generation's code, our kernels compiled as PTX for it (scripts/probes/generations.sh). The forwards' rows
# are those of 90 in each, but that below 80 stage 2's from 6 images an SM is version 2 (float32), not 4 (the
# tensor cores, arch=80). Every stage version that ships is taken by some generation's rows; the others
# are in dev/ (docs/kernels.md, "What ships"; tests/test_kernel_versions_cpu.py).
ROWS_FROM_90 = {
    ("conv1", "forward"): ((0.015, "fused-fwd-v1-i2-g8"), (0.5, "fused-fwd-v1-i1-g8"), (1, "fused-fwd-v1-i2-g8"),
                           (INF, "fused-fwd-v1-i1-g8")),
    ("conv2", "forward"): ((0.015, "fused-fwd-v1-i2-g8"), (0.5, "fused-fwd-v1-i1-g8"), (1, "fused-fwd-v1-i2-g8"),
                           (6, "fused-fwd-v1-i1-g8"), (INF, "fused-fwd-v4-i4-g16")),
    ("conv1", "backward"): ((INF, "fused-bwd-v2-g2"),),
    ("conv2", "backward"): ((2, "fused-bwd-v7-g4"), (32, "fused-bwd-v7-g2"), (INF, "fused-bwd-v8-g3")),
}
ROWS_FROM_80 = {**ROWS_FROM_90, ("conv2", "backward"): (
    (0.015, "fused-bwd-v7-g4"), (4, "fused-bwd-v8-g3"), (32, "fused-bwd-v7-g2"), (INF, "fused-bwd-v8-g3"))}
ROWS_FROM_75 = {**ROWS_FROM_90, ("conv2", "backward"): (
    (0.015, "fused-bwd-v4-g2"), (4, "fused-bwd-v3-g4"), (256, "fused-bwd-v5-g2"), (INF, "fused-bwd-v5-g4")),
    ("conv2", "forward"): ROWS_FROM_90[("conv2", "forward")][:-1] + ((INF, "fused-fwd-v2-i4-g8"),)}
HEURISTIC = {75: ROWS_FROM_75, 80: ROWS_FROM_80, 90: ROWS_FROM_90}


def table(arch: int | None = None) -> dict:
    """The heuristic's rows for compute capability ``arch`` (default: what our kernels are compiled for
    in this process, lenet.kernels.arch()): those of the newest generation at most it."""
    arch = kernel_arch() if arch is None else int(arch)
    return HEURISTIC[max((g for g in HEURISTIC if g <= arch), default=min(HEURISTIC))]


# The stage shapes our kernels are written for (stage_common.cu's constants): (x, w, dx) -> stage.
SHAPES = {((1, 28, 28), (6, 1, 5, 5), False): "conv1", ((6, 12, 12), (16, 6, 5, 5), True): "conv2"}


# Note [one wave for a pack]: a launch shape's grid is per_sm blocks on every SM, one wave, each block
# taking its share of the images in turn. A pack of K models shares that wave: each model gets
# per_sm * SMs // K blocks, rounded down. Rounded up, the blocks overflowed one wave and the last few ran
# as a second one, each stage 13-30% slower than one model's (docs/kernels.md, "Note [one wave for a
# pack]"); the head's tail grid is shared the same way (lenet/kernels/head.py, tail_blocks).
@dataclass(frozen=True)
class Forward:
    images: int       # per block iteration
    per_sm: int       # blocks per SM (the grid is at most per_sm * SMs, and at most what the batch needs)
    version: int = 0  # the version's number less one (its name's v{version + 1}); StageKernels.module finds it
    engine: ClassVar[None] = None   # a candidate of one engine's own loop: the planner's table names it by its name

    @property
    def name(self) -> str:
        return f"fused-fwd-v{self.version + 1}-i{self.images}-g{self.per_sm}"

    def grid(self, n: int, models: int = 1, resident: int | None = None) -> int:
        """Blocks per model (Note [model from the grid] in stage_common.cu): a pack shares the SMs
        (Note [one wave for a pack]); at most ``resident`` blocks an SM, what the GPU holds at once (Note
        [launch shapes from the device] in lenet/kernels/launch.py)."""
        per_sm = self.per_sm if resident is None else max(1, min(self.per_sm, resident))
        return max(1, min(-(-n // self.images), per_sm * sm_count() // models))


@dataclass(frozen=True)
class Backward:
    per_sm: int
    version: int = 0   # the version's number less one (its name's v{version + 1}); StageKernels.module finds it
    engine: ClassVar[None] = None   # as Forward's

    @property
    def name(self) -> str:
        return f"fused-bwd-v{self.version + 1}-g{self.per_sm}"

    def grid(self, n: int, models: int = 1, resident: int | None = None) -> int:
        """Blocks per model (Note [model from the grid] in stage_common.cu): a pack shares the SMs
        (Note [one wave for a pack]); at most ``resident`` blocks an SM (as Forward.grid)."""
        per_sm = self.per_sm if resident is None else max(1, min(self.per_sm, resident))
        return max(1, min(n, per_sm * sm_count() // models))

    def one_block(self) -> int:
        """The ``share`` (models sharing the SMs) whose grid is one block: one block sums every image (the
        plan-time check's second run, Note [checking a stage] in lenet/engines/reference.py)."""
        return self.per_sm * sm_count()


@dataclass(frozen=True)
class StageKernels:
    """One stage shape's kernels: its forward and backward versions (lenet.kernels.Module, in version
    order; the numbers of those that ship, which need not be 1, 2, ...: docs/kernels.md, "What ships") and
    the widths of a block's partial-sum row."""

    stage: str
    forward: tuple
    backward: tuple
    mw: int            # weight-gradient columns of a block's partial row (K * C * R * S)
    mb: int            # bias-gradient columns (K)

    @property
    def width(self) -> int:
        return self.mw + self.mb

    def heuristic(self, direction: str, n: int):
        """The launch shape the heuristic's rows (``table``) name for this stage at batch n."""
        rows = table()[(self.stage, direction)]
        return parse_name(next(name for below, name in rows if n < below * sm_count()))

    def _ordered(self, cands: list, direction: str, n: int | None) -> list:
        if n is not None:
            first = self.heuristic(direction, n)
            cands.sort(key=lambda c: c != first)   # stable: the rest keep their order
        return cands

    def forward_candidates(self, n: int | None = None) -> list:
        """Every forward launch shape this GPU runs, the heuristic's first at batch n (``table``)."""
        arch = kernel_arch()
        cands = [Forward(i, g, m.version - 1) for m in self.forward if m.runs_on(arch)
                 for g in FORWARD_BLOCKS_PER_SM for i in m.images]
        return self._ordered(cands, "forward", n)

    def backward_candidates(self, n: int | None = None) -> list:
        """Every backward launch shape this GPU runs, the heuristic's first at batch n (``table``)."""
        arch = kernel_arch()
        cands = [Backward(g, m.version - 1) for m in self.backward if m.runs_on(arch) for g in BACKWARD_BLOCKS_PER_SM]
        return self._ordered(cands, "backward", n)

    def _version(self, cand):
        """The module of ``cand``'s version, or None (a version this package does not ship)."""
        versions = self.forward if isinstance(cand, Forward) else self.backward
        return next((m for m in versions if m.version == cand.version + 1), None)

    def offers(self, cand) -> bool:
        """Whether ``cand`` is a launch shape of this stage (whatever the GPU: ``refuses`` says that)."""
        m = self._version(cand)
        if m is None or cand.per_sm < 1:
            return False
        return not isinstance(cand, Forward) or cand.images in m.images

    def module(self, cand):
        """The module (lenet.kernels.Module) a launch shape of this stage runs."""
        m = self._version(cand)
        if m is None:
            raise ValueError(f"stage {self.stage} has no version {cand.version + 1}: {names()}")
        return m

    def refuses(self, cand, arch: int | None = None) -> str | None:
        """None where this GPU (compute capability ``arch``, default lenet.kernels.arch()) runs ``cand``, else
        why not, in words."""
        arch = kernel_arch() if arch is None else int(arch)
        m = self.module(cand)
        if m.runs_on(arch):
            return None
        return (f"{cand.name} needs compute capability {m.arch // 10}.{m.arch % 10} or newer; this GPU's kernels are "
                f"{arch // 10}.{arch % 10}")

    def modules(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.forward + self.backward)


@functools.lru_cache(maxsize=None)
def kernels() -> dict[tuple, StageKernels]:
    """(x, w, dx) of a stage -> its kernels, from the declarations."""
    out = {}
    for shape, stage in SHAPES.items():
        mods = [m for m in declared().values() if m.stage == stage and m.folder is None]   # dev/'s never ship
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
    return "; ".join(out) + " (N blocks per SM, N >= 1; a version not listed is dev/'s, not shipped)"


def modules() -> tuple[str, ...]:
    """Every module our stage kernels may launch."""
    return tuple(dict.fromkeys([m for ks in kernels().values() for m in ks.modules()] + ["stage_reduce"]))


def heuristic_modules(batches=None) -> tuple[str, ...]:
    """The modules of the launch shapes the heuristic takes first: each stage's backward versions for these
    batch sizes, its forward versions for every row up to the largest's (a forward also runs a split's
    last, smaller batch of an evaluation or an epoch), all of them without batch sizes, and the reduction.
    Not the forward rows past the largest batch: stage 2's tensor-core forward is the longest compile of all
    (docs/performance.md, "Notes' numbers"), and a program that never runs it would not wait for it, or
    leave before it was cached."""
    out = []
    for ks in kernels().values():
        for direction in ("forward", "backward"):
            rows = table()[(ks.stage, direction)]
            if direction == "backward" and batches:
                picks = [ks.heuristic(direction, n) for n in batches]
            elif batches:
                last = max(batches) / sm_count()   # a row is reached where the bound before it is
                picks = [parse_name(name) for (before, _), (_, name) in zip(((0, None),) + rows, rows) if before <= last]
            else:
                picks = [parse_name(name) for _, name in rows]
            out += [ks.module(c).name for c in picks]
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
    m = ks.module(cand)
    for name, a in (("input", x), ("weights", w)):   # Note [wide loads] in stage2_forward.cu
        if getattr(getattr(a, "data", None), "ptr", 0) % 16:
            raise ValueError(f"our stage forward reads its {name} as float4s: they must start on a 16-byte boundary")
    fn, threads, smem = function(m, models), m.threads * cand.images, m.smem_bytes(cand.images)
    grid = cand.grid(n, models if share is None else share, resident(function(m, models if share != 1 else 1),
                                                                      threads, smem))
    return Launch(fn, (grid, models), (threads,), (x, w, b, y, arg, np.int32(n), np.int32(ps)), stream, smem)


def stage_backward(ks: StageKernels, cand: Backward, n: int, stream, part, x, w, arg, dy, dw, db, dx=None,
                   side=None, models: int = 1, ps: int = 0, share: int | None = None):
    """A zero-argument launch of the stage's backward on ``stream``, then the reduction of its partial
    sums: on ``side`` (lenet.engines.context.SideStream, Note [side stream]) when given, else on ``stream``. A grid
    of one block writes dw and db itself, and no reduction runs. ``share`` as for stage_forward: each
    model's weight gradients are summed over its grid's blocks, so a lone run's grid (1) sums them as the
    lone run does (Note [a pack and a lone run] in lenet/pack.py)."""
    m = ks.module(cand)
    for name, a in (("input", x), ("input gradient", dx), ("argmax bytes", arg), ("output gradient", dy)):
        if getattr(getattr(a, "data", None), "ptr", 0) % 16:   # conv2's versions 7 and 8 move 16 bytes at a time
            raise ValueError(f"our stage backward moves its {name} 16 bytes at a time: it must start on a 16-byte "
                             "boundary")
    fn = function(m, models)   # each model on its lone run's grid (share 1): the plain build's residency, its grid
    grid = cand.grid(n, models if share is None else share,
                     resident(function(m, models if share != 1 else 1), m.threads, m.smem_bytes(0)))
    reduce = kernel(pack_module("stage_reduce", models), "stage_reduce_kernel")
    if part.shape[0] < grid * models:
        raise ValueError(f"partial-sum buffer has {part.shape[0]} rows, the launch needs {grid * models}")
    args = ((x, arg, dy, part, dw, db, np.int32(n), np.int32(ps)) if dx is None else
            (x, w, arg, dy, dx, part, dw, db, np.int32(n), np.int32(ps)))
    red = (part, dw, db, np.int32(grid), np.int32(ks.mw), np.int32(ks.mb), np.int32(ps))
    backward = Launch(fn, (grid, models), (m.threads,), args, stream, m.smem_bytes(0))
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
