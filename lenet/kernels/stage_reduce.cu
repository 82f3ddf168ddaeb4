// module stage_reduce: uses=stage_common
// The blocks' rows of partial sums added in a fixed order (deterministic): column i < mw goes to
// dw[i], the rest to db[i - mw]. blockDim.x = 256 (8 warps): block (x, m) owns model m's 32 columns, lane = column;
// warp w sums rows w, w + 8, w + 16, ... in order, then warp 0 adds the 8 warps' sums in order.
// Shared: sums (8 x 32) the warps' sums. Many rows (a large grid of partials) are read in parallel:
// one thread per column looping over every row was slow (docs/kernels.md, "Launches and compiles").
extern "C" __global__ void __launch_bounds__(256)
stage_reduce_kernel(const float* __restrict__ part, float* __restrict__ dw, float* __restrict__ db,
                    int rows, int mw, int mb, int ps) {
  griddep_entry();
  PACK_MODEL(part, (size_t)rows * (mw + mb)); PACK_MODEL(dw, ps); PACK_MODEL(db, ps);   // Note [model from the grid]
  __shared__ float sums[8][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, m = mw + mb;
  const int i = blockIdx.x * 32 + lane;
  float a = 0.f;
  if (i < m)
    for (int b = warp; b < rows; b += 8) a += part[(size_t)b * m + i];
  sums[warp][lane] = a;
  __syncthreads();
  if (warp == 0 && i < m) {
    float total = sums[0][lane];
#pragma unroll
    for (int w = 1; w < 8; ++w) total += sums[w][lane];
    if (i < mw) dw[i] = total; else db[i - mw] = total;
  }
}
