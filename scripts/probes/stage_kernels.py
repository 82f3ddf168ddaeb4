"""Probe (GPU): our stage kernels (lenet/kernels/stage*.cu) under compile-time variants and launch
shapes, ns per image at several batch sizes, CUDA-event timed inside a CUDA graph.

    python3 scripts/probes/stage_kernels.py --batch 64 8192 65536 --define none S2B_MIN_BLOCKS=6

Each variant is the same source compiled with other -D options (a register budget, say); every
launch shape the engine offers is timed for each direction. Prints one line per (variant, kernel,
shape, batch) and writes JSON with --out. With --once each launch shape runs once, untimed: every
version of every stage kernel under a sanitizer (scripts/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def variant_kernel(extra: tuple, mods: dict, module: str, name: str):
    """lenet.kernels.kernel for a compile-time variant: ``module`` built with the -D options ``extra`` (once
    per ``mods``, a variant's modules), its function ``name``. Stands in for lenet.kernels.stages.kernel."""
    import cupy

    from lenet import kernels
    if module not in mods:
        mods[module] = cupy.RawModule(code=kernels.source(module), options=kernels.options(module) + extra)
    return mods[module].get_function(name)


def once(run, stream) -> float:
    """One untimed launch (0 ms reported)."""
    run()
    stream.synchronize()
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 8192, 65536])
    ap.add_argument("--define", nargs="+", default=["none"],
                    help="one variant per value: none, or macros NAME[=VALUE] joined by commas (S2B_MIN_BLOCKS=6)")
    ap.add_argument("--kernel", nargs="+", default=None,
                    help="time only the kernels whose names hold one of these (stage2_backward_even)")
    ap.add_argument("--same", action="store_true",
                    help="say whether each backward's outputs (dw, db, dx) are bit-identical to those of the first "
                         "backward timed on the same inputs at the same grid (blocks per SM): across variants, and "
                         "across versions that keep the same sums")
    ap.add_argument("--per-sm", type=int, nargs="+", default=None,
                    help="the backward launch shapes' blocks per SM to time (default: those a search times, "
                         "lenet.kernels.stages.BACKWARD_BLOCKS_PER_SM)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--once", action="store_true", help="run each launch shape once, untimed (for compute-sanitizer)")
    args = ap.parse_args()
    import cupy

    from lenet.timing import time_launcher
    from lenet.kernels import stages as ours

    if args.per_sm:
        ours.BACKWARD_BLOCKS_PER_SM = tuple(args.per_sm)   # read by backward_candidates and the part's rows below
    stream = cupy.cuda.Stream(non_blocking=True)
    rows, first_out = [], {}
    for define in args.define:
        rng = cupy.random.default_rng(0)   # the same inputs for every variant (--same)
        extra = tuple(f"-D{d}" for d in define.split(",") if define != "none")
        orig = ours.kernel
        if extra:   # its modules, each compiled when first launched; none: our own compile path (LENET_KERNEL_ARCH too)
            ours.kernel = functools.partial(variant_kernel, extra, {})
        try:
            for n in args.batch:
                for ks in ours.kernels().values():
                    first = ks.forward[0].name.startswith("stage1")
                    c_in, k_out = (784, 864) if first else (864, 256)
                    x = cupy.maximum(rng.standard_normal((n, c_in), dtype=cupy.float32), 0)
                    w = rng.standard_normal(ks.mw, dtype=cupy.float32) * 0.2
                    b = rng.standard_normal(ks.mb, dtype=cupy.float32) * 0.1
                    y = cupy.empty((n, k_out), cupy.float32)
                    arg = cupy.empty((n, k_out), cupy.uint8)
                    dy = rng.standard_normal((n, k_out), dtype=cupy.float32)
                    dx = None if first else cupy.empty_like(x)
                    dw, db = cupy.empty(ks.mw, cupy.float32), cupy.empty(ks.mb, cupy.float32)
                    part = cupy.empty((max(ours.BACKWARD_BLOCKS_PER_SM) * ours.sm_count(), ks.width), cupy.float32)
                    start = len(rows)

                    def wanted(name: str) -> bool:
                        return args.kernel is None or any(k in name for k in args.kernel)

                    for cand in ks.forward_candidates():
                        if not wanted(ks.module(cand).name):
                            continue
                        run = ours.stage_forward(ks, cand, n, stream, x, w, b, y, arg)
                        ms = once(run, stream) if args.once else time_launcher(run, stream)
                        rows.append({"define": define, "kernel": ks.module(cand).name, "shape": cand.name, "n": n,
                                     "us": ms * 1e3, "ns_per_image": ms * 1e6 / n})
                    cupy.cuda.runtime.deviceSynchronize()   # the inputs (made on the null stream) are ready
                    # the backward's argmax bytes from a forward, whichever forwards were timed
                    ours.stage_forward(ks, ks.forward_candidates()[0], n, stream, x, w, b, y, arg)()
                    for cand in ks.backward_candidates():
                        if not wanted(ks.module(cand).name):
                            continue
                        run = ours.stage_backward(ks, cand, n, stream, part, x, w, arg, dy, dw, db, dx)
                        ms = once(run, stream) if args.once else time_launcher(run, stream)
                        rows.append({"define": define, "kernel": ks.module(cand).name, "shape": cand.name, "n": n,
                                     "us": ms * 1e3, "ns_per_image": ms * 1e6 / n})
                        if args.same:
                            got = [cupy.asnumpy(a) for a in (dw, db, dx) if a is not None]
                            ref = first_out.setdefault((ks.stage, cand.per_sm, n), got)
                            rows[-1]["same"] = all((a.view("u4") == b.view("u4")).all() for a, b in zip(got, ref))   # bits, -0 != +0
                    for r in rows[start:]:
                        print(f"{r['define'] or '-':<22} {r['kernel']:<24} {r['shape']:<20} n={r['n']:<6} "
                              f"{r['us']:9.1f} us {r['ns_per_image']:8.2f} ns/img"
                              + ("" if "same" not in r else " bits same" if r["same"] else " bits DIFFER"), flush=True)
        finally:
            ours.kernel = orig
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
