"""Probe (GPU): the rate of warp-level tensor-core products (mma.sync) against FFMA on this GPU, per SM
and cycle, for the shapes a stage kernel of ours could use.

    python3 scripts/probes/mma_rate.py

Every warp of a full grid runs independent chains of one instruction (8 accumulator sets, so that
latency is hidden); the time of a CUDA-event-timed launch gives instructions per SM per cycle at the
clock the driver reports, and multiply-adds per SM per cycle.
"""

from __future__ import annotations

import sys

SRC = r"""
extern "C" __global__ void __launch_bounds__(256) rate(float* out, int iters) {
  float c[8][4];
  for (int i = 0; i < 8; ++i) for (int j = 0; j < 4; ++j) c[i][j] = threadIdx.x * 1e-3f + i + j;
  unsigned a0 = __float_as_uint(1.0f + threadIdx.x), a1 = a0 ^ 1, a2 = a0 ^ 2, a3 = a0 ^ 3, b0 = a0 ^ 5, b1 = a0 ^ 7;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#if KIND == 0   // m16n8k8 tf32: 1,024 multiply-adds
      asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
          : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#elif KIND == 1   // m16n8k4 tf32: 512
      asm volatile("mma.sync.aligned.m16n8k4.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
          : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3]) : "r"(a0), "r"(a1), "r"(b0));
#elif KIND == 2   // m16n8k16 bf16: 2,048
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
          : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else             // FFMA: 32 a warp instruction, 4 of them here
      for (int j = 0; j < 4; ++j) c[i][j] = fmaf(c[i][j], 0.999f, 1e-3f);
#endif
    }
  }
  float s = 0.f;
  for (int i = 0; i < 8; ++i) for (int j = 0; j < 4; ++j) s += c[i][j];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""
KINDS = {0: ("mma m16n8k8 tf32", 1024, 1), 1: ("mma m16n8k4 tf32", 512, 1), 2: ("mma m16n8k16 bf16", 2048, 1),
         3: ("ffma", 32, 4)}


def main() -> int:
    import cupy

    dev = cupy.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    clock = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, dev.id) * 1e3
    iters, blocks = 4096, sms * 8
    out = cupy.empty(blocks * 256, cupy.float32)
    for kind, (name, fma, per) in KINDS.items():
        k = cupy.RawModule(code=SRC, options=("-DKIND=%d" % kind,)).get_function("rate")
        k((blocks,), (256,), (out, cupy.int32(iters)))
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        k((blocks,), (256,), (out, cupy.int32(iters)))
        stop.record()
        stop.synchronize()
        s = cupy.cuda.get_elapsed_time(start, stop) * 1e-3
        instr = blocks * 8 * iters * 8 * per   # warp instructions
        per_sm_cycle = instr / s / sms / clock
        print(f"{name:<20} {per_sm_cycle:6.3f} warp instructions per SM and cycle, "
              f"{per_sm_cycle * fma:7.1f} multiply-adds per SM and cycle ({s * 1e3:.2f} ms at {clock / 1e9:.2f} GHz)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
