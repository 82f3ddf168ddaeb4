"""The workbench's harness (dev/README.md): a kernel version kept here is compiled with the package's own
NVRTC machinery (lenet.kernels.declare: its file here, the files it uses the package's), checked against
cuDNN's exact result as the planner checks a candidate, and timed beside the versions that ship.

    python dev/conv2_backward_v6.py [--batch 64 1024 8192 65536] [--check-only]

``main`` does it for one .cu file of this folder and one stage, each version beside its direction's:
  check   every launch shape of each version here (lenet/kernels/stages.py's blocks per SM; a backward on its
          own grid and on one block that sums every image; a forward at each of its images a block), against
          cuDNN's exact result (lenet/engines/reference.py,
          Note [checking a stage]) on three sets of operands: the planner's check (random normals and
          quantized pictures on constant backgrounds: exact ties in the pooling windows, exact zeros after a
          ReLU), random normals alone, and constant images (every window an exact four-way tie; all-zero
          images, and all-zero output gradients for some). Prints "OK" or "FAIL" a line, llm.c's way.
  time    each version here and each shipped one (every launch shape, CUDA-event timed in a graph:
          lenet.timing.time_launcher) on random inputs at a few batch sizes, and the shape the shipped
          heuristic takes at each, in us.
Exits 1 when a check fails, 0 otherwise (2 where there is no GPU or its generation cannot run the versions here).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPECS = {"conv1": ((1, 28, 28), (6, 1, 5, 5), False), "conv2": ((6, 12, 12), (16, 6, 5, 5), True)}
BATCHES = (64, 1024, 8192, 65536)
CHECK_BATCHES = (256, 7)


def spec(stage: str):
    from lenet.ops import StageSpec

    x, w, dx = SPECS[stage]
    return StageSpec(stage, x, w, dx=dx)


def workbench(cu_file: str, stage: str):
    """(the shipped StageKernels of ``stage`` with this file's versions added, the versions added): each
    version beside the shipped ones of its direction."""
    from lenet import kernels
    from lenet.kernels import stages

    ks = next(k for k in stages.kernels().values() if k.stage == stage)   # the shipped ones: before declare
    mine = [m for m in kernels.declare(Path(__file__).resolve().parent / cu_file) if m.stage == stage]
    for direction in ("forward", "backward"):
        shipped = getattr(ks, direction)
        added = tuple(m for m in mine if m.direction == direction)
        clash = [m.name for m in added if m.version in {s.version for s in shipped}]
        if clash:
            raise SystemExit(f"{cu_file}: {', '.join(clash)} has the number of a shipped {direction} version")
        ks = replace(ks, **{direction: tuple(sorted(shipped + added, key=lambda m: m.version))})
    return ks, mine


def _random(spec_, m: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    f32 = np.float32
    x = rng.standard_normal((m, *spec_.x), dtype=f32)
    x = np.maximum(x, f32(0)) if spec_.dx else x
    w = rng.standard_normal(spec_.w, dtype=f32) * f32(0.2)
    b = rng.standard_normal(spec_.w[0], dtype=f32) * f32(0.1)
    return x, w, b, rng.standard_normal((m, *spec_.y), dtype=f32)


def _constant(spec_, m: int, seed: int):
    """Images of one level each (a third of them 0), so every pooling window is an exact four-way tie; the
    output gradient 0 for every fourth image."""
    import numpy as np

    x, w, b, dy = _random(spec_, m, seed)
    levels = np.random.default_rng(seed + 1).integers(0, 3, m).astype(np.float32) * np.float32(0.5)
    x = np.broadcast_to(levels.reshape(m, 1, 1, 1), x.shape).astype(np.float32).copy()
    dy[::4] = 0
    return x, w, b, dy


@contextlib.contextmanager
def operands(make):
    """lenet.engines.reference's operands replaced by ``make`` (None: the planner's own) while inside."""
    from lenet.engines import reference

    real = reference.operands
    if make is not None:
        reference.operands = lambda spec_, m, seed=0: make(spec_, m, seed)
    try:
        yield
    finally:
        reference.operands = real


OPERANDS = (("check operands (normals + pictures)", None), ("random normals", _random),
            ("constant images, zeros", _constant))


def _references(spec_, handle):
    """(the operands' label, m, cuDNN's exact result at m images) for every set of operands and check batch."""
    from lenet.engines import reference

    for label, make in OPERANDS:
        for m in CHECK_BATCHES:
            with operands(make):
                ref = reference.stage_reference(handle, spec_, m)
            yield label, m, ref


def check_forward(ks, versions, spec_, handle) -> int:
    """Every launch shape of the forward ``versions`` against cuDNN's exact result, as the planner checks a
    forward candidate (lenet/engines/ours_check.py: outputs preset to NaN and 255); the failures' count."""
    import cupy
    import numpy as np

    from lenet.engines import reference
    from lenet.kernels import stages

    failures = 0
    for label, m, ref in _references(spec_, handle):
        for mod in versions:
            for per_sm in stages.FORWARD_BLOCKS_PER_SM:
                for images in mod.images:
                    cand = stages.Forward(images, per_sm, mod.version - 1)
                    with handle.stream:
                        y, arg = cupy.empty(ref.y.shape, cupy.float32), cupy.empty(ref.arg.shape, np.uint8)
                        y.data.memset_async(0xFF, y.nbytes)
                        arg.data.memset_async(0xFF, arg.nbytes)
                    stages.stage_forward(ks, cand, m, handle.stream, ref.x, ref.w, ref.b, y, arg)()
                    handle.stream.synchronize()
                    err, ties, why = reference.check_forward(ref, y, arg)
                    ok = why is None
                    failures += not ok
                    print(f"{'OK  ' if ok else 'FAIL'} {cand.name:<22} {label:<36} m={m:<4} grid {cand.grid(m):<6} "
                          f"err {err:.1e}, {ties} near-ties decided otherwise" + ("" if ok else f": {why}"),
                          flush=True)
    return failures


def _inputs(spec_, n: int, stream, rng):
    """Random operands of a stage at n images on the GPU, and its outputs' buffers: (x, w, b, y, arg)."""
    import cupy

    with stream:
        x = rng.standard_normal((n, *spec_.x), dtype=cupy.float32)
        x = cupy.maximum(x, 0) if spec_.dx else x
        w = rng.standard_normal(spec_.w, dtype=cupy.float32) * 0.2
        b = rng.standard_normal(spec_.w[0], dtype=cupy.float32) * 0.1
        y, arg = cupy.empty((n, *spec_.y), cupy.float32), cupy.empty((n, *spec_.y), cupy.uint8)
    return x, w, b, y, arg


def check(ks, versions, spec_, handle) -> int:
    """Every launch shape of the backward ``versions`` against cuDNN's exact result; the failures' count."""
    import cupy

    from lenet.engines import reference
    from lenet.kernels import stages

    failures = 0
    for label, m, ref in _references(spec_, handle):
        for mod in versions:
            for per_sm in stages.BACKWARD_BLOCKS_PER_SM:
                cand = stages.Backward(per_sm, mod.version - 1)
                for share in (1, cand.one_block()):
                    with handle.stream:
                        part = cupy.zeros((max(1, cand.grid(m, share)), ks.width), cupy.float32)
                        dw = cupy.full(spec_.w, cupy.nan, cupy.float32)
                        db = cupy.full(spec_.w[0], cupy.nan, cupy.float32)
                        dx = cupy.full(ref.x.shape, cupy.nan, cupy.float32) if spec_.dx else None
                    stages.stage_backward(ks, cand, m, handle.stream, part, ref.x, ref.w, ref.arg, ref.dy, dw, db,
                                          dx, share=share)()
                    handle.stream.synchronize()
                    err, why = reference.check_backward(ref, dw, db, dx)
                    grid = "one block" if share != 1 else f"grid {cand.grid(m)}"
                    ok = why is None
                    failures += not ok
                    print(f"{'OK  ' if ok else 'FAIL'} {cand.name:<18} {label:<36} m={m:<4} {grid:<10} "
                          f"err {err:.1e}" + ("" if ok else f": {why}"), flush=True)
    return failures


def bench(ks, direction: str, versions, spec_, batches) -> None:
    """us a launch of every launch shape of the ``direction`` versions here (``versions``) and of the shipped
    ones (a backward with its reduction), on random operands at each batch size; the best shape of each."""
    import cupy

    from lenet.kernels import sm_count, stages
    from lenet.timing import time_launcher

    stream = cupy.cuda.Stream(non_blocking=True)
    rng = cupy.random.default_rng(0)
    mine = {m.name for m in versions}
    arch = stages.kernel_arch()
    for n in batches:
        x, w, b, y, arg = _inputs(spec_, n, stream, rng)
        if direction == "forward":
            def shapes(mod):
                return [stages.Forward(i, g, mod.version - 1) for g in stages.FORWARD_BLOCKS_PER_SM for i in mod.images]

            def launch(cand):
                return stages.stage_forward(ks, cand, n, stream, x, w, b, y, arg)
        else:
            with stream:
                dy = rng.standard_normal((n, *spec_.y), dtype=cupy.float32)
                dx = cupy.empty_like(x) if spec_.dx else None
                dw, db = cupy.empty(spec_.w, cupy.float32), cupy.empty(spec_.w[0], cupy.float32)
                part = cupy.empty((max(stages.BACKWARD_BLOCKS_PER_SM) * sm_count(), ks.width), cupy.float32)
            stages.stage_forward(ks, ks.forward_candidates()[0], n, stream, x, w, b, y, arg)()   # the argmax bytes

            def shapes(mod):
                return [stages.Backward(g, mod.version - 1) for g in stages.BACKWARD_BLOCKS_PER_SM]

            def launch(cand):
                return stages.stage_backward(ks, cand, n, stream, part, x, w, arg, dy, dw, db, dx)
        stream.synchronize()
        best: dict = {}
        for mod in getattr(ks, direction):
            if not mod.runs_on(arch):
                continue
            for cand in shapes(mod):
                us = time_launcher(launch(cand), stream) * 1e3
                if us < best.get(mod.name, (float("inf"),))[0]:
                    best[mod.name] = (us, cand.name)
        first = ks.heuristic(direction, n)
        print(f"n={n:<6} " + "  ".join(f"{name}{' (dev)' if name in mine else ''} {c} {us:.1f} "
                                       f"({us * 1e3 / n:.2f} ns an image)" for name, (us, c) in best.items())
              + f"  | the shipped heuristic takes {first.name}", flush=True)


def main(cu_file: str, stage: str, doc: str) -> int:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=list(BATCHES), help="batch sizes to time")
    ap.add_argument("--check-only", action="store_true", help="check, do not time")
    args = ap.parse_args()
    from descriptors import Handle, NoGpuError, require_gpu
    from lenet.kernels import stages

    try:
        require_gpu()
    except NoGpuError as e:   # one line where no GPU runs the workbench, not CUDA's traceback
        print(f"{cu_file}: {e}", file=sys.stderr)
        return 2

    ks, mine = workbench(cu_file, stage)
    arch = stages.kernel_arch()
    runs = [m for m in mine if m.runs_on(arch)]
    if not runs:
        print(f"{cu_file}: its versions need compute capability {min(m.arch for m in mine) / 10:.1f}; this GPU's "
              f"kernels are {arch / 10:.1f}")
        return 2
    print(f"{cu_file}: {', '.join(f'{m.name} (v{m.version})' for m in runs)} on compute capability {arch / 10:.1f}, "
          f"{stages.sm_count()} SMs")
    forward = [m for m in runs if m.direction == "forward"]
    backward = [m for m in runs if m.direction == "backward"]
    handle = Handle()
    failures = (check_forward(ks, forward, spec(stage), handle) if forward else 0) + \
        (check(ks, backward, spec(stage), handle) if backward else 0)
    if failures:
        print(f"{failures} checks failed")
        return 1
    print("All results match. Starting benchmarks." if not args.check_only else "All results match.")
    if not args.check_only:
        for direction, mods in (("forward", forward), ("backward", backward)):
            if mods:
                bench(ks, direction, mods, spec(stage), args.batch)
    return 0
