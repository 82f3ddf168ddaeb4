"""Our stage engine: each direction of a stage fused into one kernel of lenet/kernels/stage*.cu (the
backward plus one reduction of the per-block weight and bias gradients), each kernel a module of its
own (compiled in parallel on a first run: Note [first run] in descriptors/modules.py).

Candidates are launch shapes: the forward's images per block iteration and its blocks per SM, the
backward's blocks per SM. ``heuristic`` takes the first of each list (a rule: no timing),
``exhaustive`` times them all, each as the step runs it. Every candidate is checked against cuDNN's
exact result before it may run (Note [checking a stage] in lenet/stages/check.py), once per
model (its search's memo). Our kernels are exact float32 (FMA, no TF32) and deterministic: a fixed
launch shape sums the gradients in a fixed order (Note [stage backward through the argmax] in the kernel file).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from descriptors.algorithms import AlgorithmNotSupportedError, Direction
from descriptors.timing import time_launcher

from ..kernels import kernel, prefetch
from ..kernels.launch import Launch
from ..kernels import sm_count as _sms
from . import check

BACKWARD_BLOCKS_PER_SM = (4, 2, 8, 16)   # the first is the heuristic's (scripts/probes/stage_kernels.py)
FORWARD_BLOCKS_PER_SM = (8, 4, 16)
# From this many images per SM on, the heuristic takes a stage's large-batch forward version first.
# scripts/probes/stage_kernels.py on an H100 (132 SMs), conv2's best v1 against best v2: 6.9 / 10.5 us
# at 256 images, 9.2 / 15.8 at 512, 16.1 / 12.5 at 1024, 28.5 / 19.1 at 2048, 103.6 / 75.7 at 8192.
LARGE_BATCH_PER_SM = 6
# Up to this many images per SM, the heuristic takes a stage's small-batch backward version first,
# above it its large-batch version. scripts/probes/stage_kernels.py on an H100 (132 SMs), conv2's best
# v1 / v2 / v3: 14.0 / 10.6 / 9.7 us at 64 images, 17.1 / 17.3 / 10.3 at 128, 27.0 / 25.1 / 28.3 at
# 512; and at 4 blocks per SM (the heuristic's shape) v1 / v2: 27.1 / 27.1 us at 512, 47.5 / 47.3 at
# 1000, 330.5 / 319.4 at 8192, 2533.7 / 2446.0 at 65536. v2 and v3 also compile in less than half of
# v1's time, which a first run waits for (Note [first run] in descriptors/modules.py): v1 compiles only
# when a search times it.
SMALL_BATCH_PER_SM = 2


@dataclass(frozen=True)
class Kernels:
    """The kernels of one stage shape: names, threads, shared memory, partial-sum widths."""

    forward: tuple             # the forward's versions: (module, threads per image, images per block iteration)
    backward: tuple            # the backward's versions: (module, threads per block)
    fwd_smem: object           # images -> dynamic shared memory bytes of the forward (every version)
    mw: int                    # weight-gradient columns of a block's partial row
    mb: int                    # bias-gradient columns
    large_fwd: int = 0         # the forward version the heuristic takes at large batches (LARGE_BATCH_PER_SM)
    small_bwd: int = 0         # the backward version the heuristic takes at small batches (SMALL_BATCH_PER_SM)
    large_bwd: int = 0         # and above them

    @property
    def width(self) -> int:
        return self.mw + self.mb

    def forward_candidates(self, n: int | None = None) -> list:
        """Every forward launch shape, the heuristic's first: for a batch of n >= LARGE_BATCH_PER_SM
        images per SM, those of version ``large_fwd`` come first."""
        cands = [Forward(i, g, v) for v, (_, _, images) in enumerate(self.forward)
                 for g in FORWARD_BLOCKS_PER_SM for i in images]
        if n is not None and n >= LARGE_BATCH_PER_SM * _sms():
            cands.sort(key=lambda c: c.version != self.large_fwd)   # stable: each version's order stays
        return cands

    def backward_candidates(self, n: int | None = None) -> list:
        """Every backward launch shape, the heuristic's first: for a batch of n <= SMALL_BATCH_PER_SM
        images per SM, those of version ``small_bwd`` come first, for a larger one those of ``large_bwd``."""
        cands = [Backward(g, v) for v in range(len(self.backward)) for g in BACKWARD_BLOCKS_PER_SM]
        if n is not None:
            first = self.small_bwd if n <= SMALL_BATCH_PER_SM * _sms() else self.large_bwd
            cands.sort(key=lambda c: c.version != first)   # stable: each version's order stays
        return cands


# Keyed by (x, w, dx) of a StageSpec: LeNet's two stages. Stage 2's forward: one conv output per
# thread (v1) or 4 output channels per thread (v2, stage2_forward_tiled). Each version is a module of
# lenet.kernels holding one kernel, its name the module's plus "_kernel" (``function``).
KERNELS = {
    ((1, 28, 28), (6, 1, 5, 5), False): Kernels((("stage1_forward", 144, (1, 2, 4)),),
                                                (("stage1_backward", 192),),
                                                lambda i: 4 * 784 * i, 150, 6),
    ((6, 12, 12), (16, 6, 5, 5), True): Kernels((("stage2_forward", 256, (1, 2)),
                                                 ("stage2_forward_tiled", 64, (4, 8))),
                                                (("stage2_backward", 160),
                                                 ("stage2_backward_split", 320),
                                                 ("stage2_backward_split4", 640)),
                                                lambda i: 4 * (2400 + 864 * i), 2400, 16, large_fwd=1, small_bwd=2,
                                                large_bwd=1),
}


@dataclass(frozen=True)
class Forward:
    images: int       # per block iteration
    per_sm: int       # blocks per SM (the grid is at most per_sm * SMs, and at most what the batch needs)
    version: int = 0  # index into Kernels.forward

    @property
    def name(self) -> str:
        return f"fused-fwd-v{self.version + 1}-i{self.images}-g{self.per_sm}"

    def grid(self, n: int) -> int:
        return max(1, min(-(-n // self.images), self.per_sm * _sms()))


@dataclass(frozen=True)
class Backward:
    per_sm: int
    version: int = 0   # index into Kernels.backward

    @property
    def name(self) -> str:
        return f"fused-bwd-v{self.version + 1}-g{self.per_sm}"

    def grid(self, n: int) -> int:
        return max(1, min(n, self.per_sm * _sms()))


# Our candidates' names, as train_step prints them and --algo takes them (Note [pinned candidates]).
_NAME = re.compile(r"fused-(fwd)-v(\d+)-i(\d+)-g(\d+)|fused-(bwd)-v(\d+)-g(\d+)")


def parse_name(name: str):
    """The Forward or Backward a candidate name stands for, or None (not one of ours)."""
    m = _NAME.fullmatch(str(name).strip().lower())
    if m is None:
        return None
    if m.group(1):
        return Forward(int(m.group(3)), int(m.group(4)), int(m.group(2)) - 1)
    return Backward(int(m.group(7)), int(m.group(6)) - 1)


def pins(name: str) -> tuple[str, ...]:
    """The policy directions a candidate name of ours fixes: a forward's, "fwd"; a backward's, both
    backward directions (one kernel computes the stage's data and weight gradients)."""
    c = parse_name(name)
    return () if c is None else ("fwd",) if isinstance(c, Forward) else ("bwd-data", "bwd-filter")


def function(module: str):
    """The kernel of one of our stage modules (each holds one, named after it)."""
    return kernel(module, f"{module}_kernel")


def modules() -> tuple[str, ...]:
    """Every module our stage engine may launch."""
    return tuple(dict.fromkeys([v[0] for ks in KERNELS.values() for v in ks.forward + ks.backward]
                               + ["stage_reduce"]))


def heuristic_modules(batches=None) -> tuple[str, ...]:
    """The modules of the candidates the heuristic takes first: each stage's forward versions for
    small and large batches (small modules), its backward versions for these batch sizes (without
    them, for any batch), and the reduction."""
    out = []
    for ks in KERNELS.values():
        out += [ks.forward[0][0], ks.forward[ks.large_fwd][0]]
        out += ([ks.backward[ks.backward_candidates(n)[0].version][0] for n in batches] if batches else
                [ks.backward[ks.large_bwd][0], ks.backward[ks.small_bwd][0]])
    return tuple(dict.fromkeys(out + ["stage_reduce"]))


def forward_launcher(ks: Kernels, cand: Forward, n: int, stream, x, w, b, y, arg):
    """A zero-argument launch of the stage's forward on the first n images, on ``stream``."""
    module, per_image, _ = ks.forward[cand.version]
    grid, threads, smem = cand.grid(n), per_image * cand.images, ks.fwd_smem(cand.images)
    return Launch(function(module), (grid,), (threads,), (x, w, b, y, arg, np.int32(n)), stream, smem)


def backward_launcher(ks: Kernels, cand: Backward, n: int, stream, part, x, w, arg, dy, dw, db, dx=None,
                      side=None):
    """A zero-argument launch of the stage's backward on ``stream``, then the reduction of its partial
    sums: on ``side`` (a lenet.ops.context.SideStream, Note [side stream]) when given, else on
    ``stream``. A grid of one block writes dw and db itself, and no reduction runs."""
    module, threads = ks.backward[cand.version]
    fn, reduce, grid = function(module), function("stage_reduce"), cand.grid(n)
    if part.shape[0] < grid:
        raise ValueError(f"partial-sum buffer has {part.shape[0]} rows, the launch needs {grid}")
    args = ((x, arg, dy, part, dw, db, np.int32(n)) if dx is None else
            (x, w, arg, dy, dx, part, dw, db, np.int32(n)))
    red = (part, dw, db, np.int32(grid), np.int32(ks.mw), np.int32(ks.mb))
    backward = Launch(fn, (grid,), (threads,), args, stream)
    if grid == 1:
        return backward
    summed = Launch(reduce, (-(-ks.width // 32),), (256,), red, stream if side is None else side.stream)

    def run():
        backward()
        if side is None:
            summed()
        else:
            side.run(summed)
    return run


class OursPlan:
    engine = "ours"
    workspace_bytes = 0

    def __init__(self, spec, n, fwd: Forward, bwd: Backward, forward, backward, errors: dict, times: dict):
        self.spec, self.n, self.fwd, self.bwd = spec, n, fwd, bwd
        self.forward, self.backward = forward, backward
        self.errors, self.times = errors, times

    def describe(self) -> list[dict]:
        name = self.spec.name
        e = self.errors
        return [
            {"layer": name, "op": "fwd+bias_relu_pool", "engine": "ours", "algo": self.fwd.name, "fused": True,
             "chunk": self.n, "chunks": 1, "time_ms": self.times.get("fwd"), "workspace_bytes": 0,
             "error": e.get("fwd"), "ties": e.get("ties"), "deterministic": True, "math": "fp32"},
            {"layer": name, "op": "bwd" + ("+data" if self.spec.dx else "") + "+filter+bias", "engine": "ours",
             "algo": self.bwd.name, "fused": True, "chunk": self.n, "chunks": 1, "time_ms": self.times.get("bwd"),
             "workspace_bytes": 0, "error": e.get("bwd"), "deterministic": True, "math": "fp32"},
        ]

    def choice(self) -> dict:
        return {"fwd": [self.fwd.images, self.fwd.per_sm, self.fwd.version],
                "bwd": [self.bwd.per_sm, self.bwd.version], "errors": self.errors}


class OursStage:
    """Note [pinned candidates]: --algo may name one of our candidates as train_step prints it:
    ``fused-fwd-v1-i1-g8`` pins the stages' forward, ``fused-bwd-v1-g4`` their backward (both
    backward directions of the policy). A pinned candidate still passes the check against cuDNN's
    exact result; one a stage does not offer (``fused-fwd-v2-...``, ``fused-bwd-v2-...``,
    ``fused-bwd-v3-...``: only conv2 has more than one version) is an error naming those it has.
    """

    name = "ours"
    pins = staticmethod(pins)

    def serves(self, engine: str) -> bool:
        """Whether --engine ``engine`` lets this engine compete."""
        return engine in ("auto", self.name)

    def warm(self, batches=None) -> None:
        """Start compiling the kernels the heuristic runs at these batch sizes (or reading them from
        the kernel cache) on threads of their own (Note [first run] in descriptors/modules.py); the rest
        compile when a plan asks for them: versions only a search times would share the CPU with
        the compiles a first step waits for."""
        prefetch(heuristic_modules(batches))

    def refuses(self, spec, ctx) -> str | None:
        p = ctx.policy
        if not self.serves(p.engine):
            return f"engine {p.engine} runs cuDNN only"
        if not ctx.fused:
            return "fusion is off (--no-fused), and our stages are fused kernels"
        if p.chunk is not None:
            return "runs the whole batch in one launch, and --chunk fixes cuDNN's calls"
        fixed = [p.choice(d) for d in Direction if p.fixed(d) and parse_name(p.choice(d)) is None]
        if fixed:
            return f"--algo names cuDNN's {fixed[0]}"
        if (spec.x, spec.w, spec.dx) not in KERNELS:
            return f"no kernel of ours for x {spec.x}, w {spec.w}"
        return None

    def candidates(self, spec, policy, n: int | None = None) -> tuple[list[Forward], list[Backward]]:
        """(forward candidates, backward candidates) for the stage under ``policy`` at batch n: the
        first of each (heuristic), all (exhaustive), or the one --algo names (Note [pinned candidates])."""
        ks = KERNELS[(spec.x, spec.w, spec.dx)]
        fwd, bwd = ks.forward_candidates(n), ks.backward_candidates(n)
        out = []
        for cands, directions in ((fwd, ("fwd",)), (bwd, ("bwd-filter", "bwd-data"))):
            named = {policy.choice(d) for d in directions if policy.fixed(d)}
            if len(named) > 1:
                raise AlgorithmNotSupportedError(f"--algo pins two backwards of ours ({', '.join(sorted(named))}); "
                                                 f"one kernel runs both gradients: name one")
            if named:
                pick = parse_name(named.pop())
                if not self._offered(ks, pick):
                    raise AlgorithmNotSupportedError(
                        f"stage {spec.name} has no candidate {pick.name}; it offers "
                        f"{', '.join(c.name for c in cands[:3])} ... ({len(cands)} in all, as train_step "
                        f"--algo exhaustive lists the winners)")
                cands = [pick]
            elif all(policy.choice(d) == "heuristic" for d in directions):
                cands = cands[:1]
            out.append(cands)
        return out[0], out[1]

    @staticmethod
    def _offered(ks: Kernels, cand) -> bool:
        if isinstance(cand, Forward):
            return (0 <= cand.version < len(ks.forward) and cand.images in ks.forward[cand.version][2]
                    and cand.per_sm >= 1)
        return 0 <= cand.version < len(ks.backward) and cand.per_sm >= 1

    # ---------------------------------------------------------------- the check

    @staticmethod
    def _reference(memo: dict, handle, spec):
        key = ("ours reference", handle.device_id, spec)
        if key not in memo:
            memo[key] = check.stage_reference(handle, spec)
        return memo[key]

    def check(self, memo: dict, handle, spec, cand) -> tuple[float, int, str | None]:
        """(distance from cuDNN's exact result, near-tie decisions taken otherwise, why it fails or None),
        once per candidate and model (kept in ``memo``, the model's search's: Note [checking a stage])."""
        key = ("ours check", handle.device_id, spec, cand)
        if key in memo:
            return memo[key]
        import cupy

        ks = KERNELS[(spec.x, spec.w, spec.dx)]
        ref = self._reference(memo, handle, spec)
        m = ref.x.shape[0]

        def unset(shape, dtype=np.float32):
            """Every bit set, as the search marks its outputs: NaN as float32, 255 as a byte, what a
            kernel that does not write there leaves; a memset, no fill kernel to compile (Note [no
            generic kernels in the check])."""
            a = cupy.empty(shape, dtype)
            a.data.memset_async(0xFF, a.nbytes)
            return a
        with handle.stream:
            if isinstance(cand, Forward):
                y = unset(ref.y.shape)
                arg = unset(ref.arg.shape, np.uint8)
                forward_launcher(ks, cand, m, handle.stream, ref.x, ref.w, ref.b, y, arg)()
                result = check.check_forward(ref, y, arg)
            else:
                part = cupy.empty((cand.grid(m), ks.width), cupy.float32)
                dw = unset(spec.w)
                db = unset(spec.w[0])
                dx = unset(ref.x.shape) if spec.dx else None
                backward_launcher(ks, cand, m, handle.stream, part, ref.x, ref.w, ref.arg, ref.dy, dw, db, dx)()
                err, why = check.check_backward(ref, dw, db, dx)
                result = (err, 0, why)
        handle.stream.synchronize()
        memo[key] = result
        return result

    # ---------------------------------------------------------------- planning

    def plan(self, ctx, stage, n: int, stored: dict | None = None) -> OursPlan:
        import cupy

        spec, handle = stage.spec, ctx.handle
        ks = KERNELS[(spec.x, spec.w, spec.dx)]
        rows = max(BACKWARD_BLOCKS_PER_SM) * _sms()

        def make():
            return {"arg": cupy.empty((stage.max_batch, *spec.y), cupy.uint8),   # (N, K, H/2, W/2) argmax bytes
                    "part": cupy.empty((rows, ks.width), cupy.float32)}        # (blocks, mw + mb) partial sums
        own = stage.scratch(self.name, make)
        t = stage.tensors.rows(n)
        arg = own["arg"][:n]

        def fwd_of(c):
            run = forward_launcher(ks, c, n, handle.stream, t.x, t.w, t.b, t.y, arg)
            return run, run

        def bwd_of(c):
            # The reduction goes to the side stream only while the backward leaves SMs idle (Note [side stream]).
            side = ctx.side if ctx.side.fits(c.grid(n)) else None
            run = backward_launcher(ks, c, n, handle.stream, own["part"], t.x, t.w, arg, t.dy, t.dw, t.db, t.dx,
                                    side)
            return run, ctx.side.joined(run)

        if stored is not None:   # checked when it was stored (Note [checking a stage])
            fwd, bwd = Forward(*stored["fwd"]), Backward(*stored["bwd"])
            if bwd.version >= len(ks.backward) or not self._offered(ks, fwd):
                raise ValueError(f"stored candidates {fwd.name}, {bwd.name} do not exist")
            errors = stored.get("errors") if isinstance(stored.get("errors"), dict) else {}
            return OursPlan(spec, n, fwd, bwd, fwd_of(fwd)[0], bwd_of(bwd)[0], errors, {})
        fwds, bwds = self.candidates(spec, ctx.policy, n)
        prefetch({ks.forward[c.version][0] for c in fwds} | {ks.backward[c.version][0] for c in bwds})   # at once
        errors, times, chosen = {}, {}, {}
        for d, cands, launcher in (("fwd", fwds, fwd_of), ("bwd", bwds, bwd_of)):
            best, dropped = None, []
            for c in cands:
                err, ties, why = self.check(ctx.search.memo, handle, spec, c)
                if why is not None:
                    dropped.append(f"{c.name} {why}")
                    continue
                run, timed = launcher(c)
                if d == "bwd" and "fwd" in chosen:
                    chosen["fwd"][1]()   # the backward reads what the chosen forward leaves (the argmax)
                ms = time_launcher(timed, handle.stream, graph=ctx.captured) if len(cands) > 1 else None
                if best is None or (ms is not None and ms < best[2]):
                    best = (c, run, ms if ms is not None else math.inf, err, ties)
            if best is None:
                raise AlgorithmNotSupportedError(f"no {d} kernel of ours passed the check for {spec.name}: "
                                                 + "; ".join(dropped[:3]))
            chosen[d] = best
            errors[d] = best[3]
            if d == "fwd":
                errors["ties"] = best[4]
            times[d] = None if best[2] == math.inf else best[2]
        (fc, frun, *_), (bc, brun, *_) = chosen["fwd"], chosen["bwd"]
        return OursPlan(spec, n, fc, bc, frun, brun, errors, times)
