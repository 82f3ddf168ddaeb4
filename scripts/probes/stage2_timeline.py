"""Probe (GPU): where a launch of stage 2's two-role backward (version 7) spends its time, block by
block: %globaltimer stamps at each block's start, after its prologue (weights and first copies), where
its tensor warps finish and where its last warp finishes, from one launch at each batch size.

    python3 scripts/probes/stage2_timeline.py --batch 2112 8192 65536

The stamps are put in by rewriting the module's source here (no hook in the product's kernels); the
launch is the engine's own (lenet.kernels.stages.stage_backward), run once to warm up, then stamped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STAMPS = """
__device__ unsigned long long tl_stamp[8192 * 5];
__device__ __forceinline__ unsigned long long tl_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
"""


def stamped(source: str) -> str:
    """The roles kernel's source with the four stamps put in (fails loudly if the source moved on)."""
    edits = [
        ("  griddep_entry();\n  PACK_MODEL(x,",
         "  griddep_entry();\n  if (threadIdx.x == 0) {\n    unsigned sm;\n    asm(\"mov.u32 %0, %%smid;\" : \"=r\"(sm));\n"
         "    tl_stamp[blockIdx.x * 5] = tl_now();\n    tl_stamp[blockIdx.x * 5 + 4] = sm;\n  }\n  PACK_MODEL(x,"),
        ("  __syncthreads();\n  const bool direct",
         "  __syncthreads();\n  if (threadIdx.x == 0) tl_stamp[blockIdx.x * 5 + 1] = tl_now();\n  const bool direct"),
        ("#pragma unroll\n    for (int i = 0; i < 5; ++i) s2d_store_tile",
         "    if (t == 0) tl_stamp[blockIdx.x * 5 + 2] = tl_now();\n"
         "#pragma unroll\n    for (int i = 0; i < 5; ++i) s2d_store_tile"),
        ("      }\n    }\n  }\n}\n",
         "      }\n    }\n  }\n  if ((threadIdx.x & 31) == 0) atomicMax(&tl_stamp[blockIdx.x * 5 + 3], tl_now());\n}\n"),
    ]
    for old, new in edits:
        if source.count(old) != 1:
            raise SystemExit(f"stage2_timeline: the source no longer holds {old!r} once")
        source = source.replace(old, new)
    return STAMPS + source


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[2112, 8192, 65536])
    ap.add_argument("--per-sm", type=int, nargs="+", default=[4],
                    help="blocks per SM of the grids launched (any count: 1 shows a block alone on its SM)")
    ap.add_argument("--define", default="", help="macros NAME[=VALUE] joined by commas, the module compiled with them")
    args = ap.parse_args()
    import cupy
    import numpy as np

    from lenet import kernels
    from lenet.kernels import stages as ours

    stream = cupy.cuda.Stream(non_blocking=True)
    ks = next(k for k in ours.kernels().values() if k.stage == "conv2")
    mods = {}
    orig = ours.kernel

    def patched(module, name):
        if module not in mods:
            mods[module] = cupy.RawModule(code=stamped(kernels.source(module)), options=kernels.options(module)
                                         + tuple(f"-D{d}" for d in args.define.split(",") if d))
        return mods[module].get_function(name)

    name = "stage2_backward_roles"
    ours.kernel = lambda module, kname: patched(module, kname) if module == name else orig(module, kname)
    rng = cupy.random.default_rng(0)
    try:
        for n in args.batch:
            x = cupy.maximum(rng.standard_normal((n, 864), dtype=cupy.float32), 0)
            w = rng.standard_normal(ks.mw, dtype=cupy.float32) * 0.2
            b = rng.standard_normal(ks.mb, dtype=cupy.float32) * 0.1
            y = cupy.empty((n, 256), cupy.float32)
            arg = cupy.empty((n, 256), cupy.uint8)
            dy = rng.standard_normal((n, 256), dtype=cupy.float32)
            dx = cupy.empty_like(x)
            dw, db = cupy.empty(ks.mw, cupy.float32), cupy.empty(ks.mb, cupy.float32)
            part = cupy.empty((max(args.per_sm) * ours.sm_count(), ks.width), cupy.float32)
            cupy.cuda.runtime.deviceSynchronize()
            ours.stage_forward(ks, ks.forward_candidates()[0], n, stream, x, w, b, y, arg)()
            version = next(m.version - 1 for m in ks.backward if m.name == name)
            for per_sm in args.per_sm:
                cand = ours.Backward(per_sm, version)
                run = ours.stage_backward(ks, cand, n, stream, part, x, w, arg, dy, dw, db, dx)
                run()
                stream.synchronize()
                stamp = cupy.ndarray((8192 * 5,), cupy.uint64, mods[name].get_global("tl_stamp"))
                stamp.fill(0)
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                run()
                end.record(stream)
                end.synchronize()
                ms = cupy.cuda.get_elapsed_time(start, end)
                grid = cand.grid(n)
                s = cupy.asnumpy(stamp[: 5 * grid]).reshape(grid, 5).astype(np.int64)
                sm = s[:, 4]
                s = s[:, :4]
                t0 = s[:, 0].min()
                rel = (s - t0) / 1e3   # us from the first block's start
                count = np.array([(n - 1 - i) // grid + 1 for i in range(grid)])
                pro = rel[:, 1] - rel[:, 0]
                per = (rel[:, 3] - rel[:, 1]) / count

                def q(v):
                    return f"{v.min():7.2f} {np.median(v):7.2f} {v.max():7.2f}"

                print(f"{name} {cand.name} n={n} grid={grid} images a block {count.min()}-{count.max()}: "
                      f"launch (events, with the reduction) {ms * 1e3:.1f} us; first start to last end "
                      f"{rel[:, 3].max():.1f} us", flush=True)
                print(f"   min / median / max (us):  start {q(rel[:, 0])}  prologue {q(pro)}  "
                      f"tensor end {q(rel[:, 2])}  block end {q(rel[:, 3])}  us an image after the prologue {q(per)}",
                      flush=True)
                # each SM's blocks: how many, and how far apart their ends are
                sms = np.unique(sm)
                ends = [np.sort(rel[sm == i, 3]) for i in sms]
                blocks = [np.flatnonzero(sm == i)[np.argsort(rel[sm == i, 3])] for i in sms]
                spread = np.array([e[-1] - e[0] for e in ends])
                last = np.array([e[-1] for e in ends])
                first = np.array([e[0] for e in ends])
                print(f"   {len(sms)} SMs, blocks an SM {min(map(len, ends))}-{max(map(len, ends))}; an SM's first block "
                      f"end {q(first)}, last {q(last)}, last - first {q(spread)}", flush=True)
                for i in np.argsort(last)[:: max(1, len(sms) // 6)]:
                    print(f"     SM {sms[i]:3d}: ends (block) " + " ".join(f"{e:7.1f} ({b})" for e, b in zip(ends[i], blocks[i])),
                          flush=True)
    finally:
        ours.kernel = orig
    return 0


if __name__ == "__main__":
    sys.exit(main())
