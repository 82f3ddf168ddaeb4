"""Probe (GPU): what a small step would save as one persistent kernel. A step of ours at batch <= 256 is
a chain of kernels joined by programmatic dependent launch (PDL) in a CUDA graph; fused into one
persistent kernel, each edge of the chain becomes a grid-wide barrier. The work on either side is the
same, so the edge's cost decides: this times K dependent links of G blocks (each reads another block's
output of the link before, so every link depends on the whole grid) as

    chain       K kernels, each launched with PDL (griddepcontrol: trigger on entry, wait before reading),
                captured in a CUDA graph: what our step does (lenet/kernels/launch.py)
    persistent  one cooperative kernel (co-resident grid) running the K links with a grid barrier
                (a counter in global memory, release / acquire) between them, captured in a CUDA graph,
                in two forms: fenced (an atomic add that returns the count, then a __threadfence after the
                wait: a MEMBAR.SC in SASS) and light (a reduction that returns nothing, then acquiring loads
                alone: one MEMBAR.ALL before the reduction)

at grids from one block to two an SM and with links of no work and of about a microsecond, and prints
us per replay, the cost per edge of each and what each persistent form saves per edge (negative: it
loses). Every form's results are checked equal to the chain's.

    python3 scripts/probes/grid_barrier.py [--grids 1 8 64 132 264] [--links 2 8 12] [--iters 0 400]

Written for issue 33's "a step fused into a persistent kernel against the chain of launches": the
step's floor with every kernel emptied is 5.1 us at 1 image and 7.5 at 64 for about eight edges
(chain.py); a persistent step can save at most what an edge costs beyond a grid barrier.

Note [a barrier against an edge] (H100, 2026-11-27, docs/probes.md, grid_barrier.py): an edge of
the chain cost 0.75-0.92 us, the fenced barrier 1.11-1.83 and the light one 0.83-1.68 (one block to two
an SM): the light barrier loses 0.07 us an edge at one block, 0.2-0.4 at 8-132 blocks, 0.75 at 264.
PDL overlaps the next kernel's launch with the last one's tail; a barrier waits for the slowest block and
then pays a fence and an L2 round trip. So no persistent form of the step was built: the chain stays.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import sys

SRC = r"""
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;"); }

// One link: out[i] from in[] of the block after this one (another block's output of the link before).
__device__ __forceinline__ void link(const float* in, float* out, int iters) {
  const int n = gridDim.x * blockDim.x, i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = in[(i + blockDim.x) % n];
  for (int k = 0; k < iters; ++k) v = v * 0.999f + 0.001f;
  out[i] = v + 1.0f;
}

extern "C" __global__ void chain_kernel(const float* in, float* out, int iters) {
  pdl_trigger();
  pdl_wait();
  link(in, out, iters);
}

// Every block of a co-resident grid arrives; the count reaches target once all have. Thread 0 of each
// block releases the block's writes and acquires everyone's. fenced (light 0): an atomic add that returns
// the count, and a __threadfence after the wait; light: a reduction that returns nothing (red.release),
// the acquiring loads alone after it.
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned target, int light) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned arrived = 0;
    if (light) {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(count) : "memory");
    } else {
      asm volatile("atom.add.release.gpu.u32 %0, [%1], 1;" : "=r"(arrived) : "l"(count) : "memory");
      ++arrived;   // the count after this block's arrival
    }
    while (arrived < target) asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(arrived) : "l"(count) : "memory");
    if (!light) __threadfence();
  }
  __syncthreads();
}

// K links in one launch, a barrier between each two; bar[0] counts arrivals, bar[1] departures: the last
// block to leave resets both for the next launch (every block has left the last barrier's wait by then).
extern "C" __global__ void persistent_kernel(float* a, float* b, int iters, int links, unsigned* bar, int light) {
  for (int k = 0; k < links; ++k) {
    link(k & 1 ? b : a, k & 1 ? a : b, iters);
    if (k + 1 < links) grid_barrier(bar, (k + 1) * gridDim.x, light);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned left;
    asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;" : "=r"(left) : "l"(bar + 1) : "memory");
    if (left + 1 == gridDim.x) {
      bar[0] = 0;
      bar[1] = 0;
      __threadfence();
    }
  }
}
"""


def launch(fn, grid: int, stream, args: tuple, types: tuple, attr_id, field: str) -> None:
    from cuda.bindings import driver

    attr = driver.CUlaunchAttribute()
    attr.id = attr_id
    setattr(attr.value, field, 1)
    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = 256, 1, 1
    cfg.sharedMemBytes = 0
    cfg.hStream = driver.CUstream(stream.ptr)
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    err, = driver.cuLaunchKernelEx(cfg, driver.CUfunction(fn.kernel.ptr), (args, types), 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx: {err}")


def time_body(cp, stream, body, graph: bool, reps: int = 400) -> float:
    """us per run of body(): replays of it captured in a CUDA graph, or (graph False) plain launches."""
    with stream:
        body()
        stream.synchronize()
        run = body
        if graph:
            stream.begin_capture()
            body()
            run = stream.end_capture()
            run = functools.partial(run.launch, stream)
        for _ in range(20):
            run()
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        for _ in range(reps):
            run()
        b.record(stream)
        b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) * 1000 / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grids", type=int, nargs="+", default=[1, 8, 64, 132, 264])
    ap.add_argument("--links", type=int, nargs="+", default=[2, 8, 12])
    ap.add_argument("--iters", type=int, nargs="+", default=[0, 400], help="dependent FMAs a link and thread")
    ap.add_argument("--no-graph", action="store_true",
                    help="time plain stream launches (where a cooperative launch cannot be captured)")
    args = ap.parse_args()
    import cupy as cp
    from cuda.bindings import driver

    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    chain, persistent = mod.get_function("chain_kernel"), mod.get_function("persistent_kernel")
    pdl = (driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
           "programmaticStreamSerializationAllowed")
    coop = (driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE, "cooperative")
    stream = cp.cuda.Stream(non_blocking=True)
    P, I = ctypes.c_void_p, ctypes.c_int
    kinds = ("fenced", "light")
    print(f"{'grid':>4} {'iters':>5} {'K':>3} | {'chain':>7} " + " ".join(f"{k:>7}" for k in kinds)
          + " | an edge: chain " + " ".join(f"{k:>7}" for k in kinds) + " | saved: "
          + " ".join(f"{k:>7}" for k in kinds) + ("  (us, plain launches)" if args.no_graph else "  (us, CUDA graphs)"))
    K0 = args.links[0]
    for grid in args.grids:
        n = grid * 256
        bar = cp.zeros(2, cp.uint32)
        for iters in args.iters:
            base = None
            for K in args.links:
                a1, b1 = cp.ones(n, cp.float32), cp.ones(n, cp.float32)

                def chained(a=a1, b=b1, K=K, iters=iters, grid=grid):
                    for k in range(K):
                        src, dst = (b, a) if k & 1 else (a, b)
                        launch(chain, grid, stream, (src.data.ptr, dst.data.ptr, iters), (P, P, I), *pdl)
                times, same = [time_body(cp, stream, chained, not args.no_graph)], True
                for light in range(len(kinds)):
                    a2, b2 = cp.ones(n, cp.float32), cp.ones(n, cp.float32)

                    def fused(a=a2, b=b2, K=K, iters=iters, grid=grid, light=light):
                        launch(persistent, grid, stream, (a.data.ptr, b.data.ptr, iters, K, bar.data.ptr, light),
                               (P, P, I, I, P, I), *coop)
                    times.append(time_body(cp, stream, fused, not args.no_graph))
                    stream.synchronize()
                    same = same and bool(cp.array_equal(a1, a2)) and bool(cp.array_equal(b1, b2))
                edges = ""
                if base is not None:   # an edge's cost: the time K links take beyond K0's, per link
                    e = [(t - t0) / (K - K0) for t, t0 in zip(times, base)]
                    edges = (f" {e[0]:13.2f} " + " ".join(f"{x:7.2f}" for x in e[1:]) + " |        "
                             + " ".join(f"{e[0] - x:7.2f}" for x in e[1:]))
                print(f"{grid:>4} {iters:>5} {K:>3} | " + " ".join(f"{t:7.2f}" for t in times) + f" |{edges}"
                      + ("" if same else "  RESULTS DIFFER"), flush=True)
                base = base or times
    return 0


if __name__ == "__main__":
    sys.exit(main())
