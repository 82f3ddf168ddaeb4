// module stage1_backward_dense: stage=conv1 direction=backward version=2 threads=240 uses=stage_common
// Stage 1 backward in register tiles (Note [dense stage backward] in stage2_backward_dense.cu): the
// pooled gradient expanded once into the conv gradient (6 x 24 x 24, one nonzero per 2 x 2 window),
// then the weight gradient as a dense sum over it. Same arguments, partial rows and determinism as
// version 1 (dev/conv1_backward_v1.cu, which routes each pooled gradient through its argmax).
//   A block (240 threads) owns images blockIdx.x, blockIdx.x + gridDim.x, ... of its model, one per
//   iteration, and row blockIdx.x of part (its weight and bias sums over those images).
//   Weight gradient: thread t owns (k, r, part) = (t / 40, t / 8 % 5, t % 8): for the conv-gradient
//   rows y = 3 part .. 3 part + 2 of channel k, the sums over y and x of d[k, y, x] x[y + r, x + s]
//   for s = 0..4, in registers (two per s: even and odd x), summed over the block's images. At the
//   block's end the 8 parts of (k, r, s) are added in part order.
//   Bias gradient: thread t owns windows t + 240 j (j < 4) over the block's images; at the end thread
//   150 + k adds channel k's 144 windows in order.
// Shared: sx (28 x 28) the image; sd (6 x S1D_DS) the conv gradient, channel k's row y at
// k * S1D_DS + y * 28 (rows of 24 floats, 4 apart so that a warp's 8 parts lie in 8 bank quads).
// Per image: 86,400 multiply-adds (4 x the routed kernel's 21,600), each thread's operands loaded
// as half rows (3 x 16 bytes of the conv gradient, 4 x 16 bytes of x) per 60 multiply-adds.
// Faster than the routed version 1 at every batch: every generation's rows take it (HEURISTIC in
// lenet/kernels/stages.py), and version 1 is dev/'s (docs/kernels.md, "Stage 1's backward").
#define S1D_THREADS 240
#define S1D_X 4   // ceil(784 / 240)
#define S1D_G 4   // ceil(864 / 240)
#define S1D_DS (24 * 28)
#ifndef S1D_MIN_BLOCKS
#define S1D_MIN_BLOCKS 4   // blocks per SM the register budget is fitted to
#endif

extern "C" __global__ void __launch_bounds__(S1D_THREADS, S1D_MIN_BLOCKS)
stage1_backward_dense_kernel(const float* __restrict__ x, const unsigned char* __restrict__ arg,
                             const float* __restrict__ dp, float* __restrict__ part, float* __restrict__ dw,
                             float* __restrict__ db, int N, int ps) {
  griddep_entry();
  PACK_MODEL(x, (size_t)N * S1_IMAGE); PACK_MODEL(arg, (size_t)N * S1_POOLED);   // Note [model from the grid]
  PACK_MODEL(dp, (size_t)N * S1_POOLED); PACK_MODEL(part, (size_t)gridDim.x * 156);
  PACK_MODEL(dw, ps); PACK_MODEL(db, ps);
  __shared__ __align__(16) float sx[S1_IMAGE];
  __shared__ __align__(16) float sd[6 * S1D_DS];
  const int t = threadIdx.x, k = t / 40, r = t / 8 % 5, yp = t % 8;
  float acc[2][5];
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int s = 0; s < 5; ++s) acc[e][s] = 0.f;
  float bsum[S1D_G];
  float nx[S1D_X], ng[S1D_G];
  int nq[S1D_G];
#pragma unroll
  for (int j = 0; j < S1D_G; ++j) bsum[j] = 0.f;
  auto fetch = [&](int n) {
#pragma unroll
    for (int j = 0; j < S1D_X; ++j) {
      const int i = t + S1D_THREADS * j;
      if (i < S1_IMAGE) nx[j] = x[(size_t)n * S1_IMAGE + i];
    }
#pragma unroll
    for (int j = 0; j < S1D_G; ++j) {
      const int i = t + S1D_THREADS * j;
      if (i < S1_POOLED) { nq[j] = arg[(size_t)n * S1_POOLED + i]; ng[j] = dp[(size_t)n * S1_POOLED + i]; }
    }
  };
  if (blockIdx.x < N) fetch(blockIdx.x);
  for (int n = blockIdx.x; n < N; n += gridDim.x) {
    __syncthreads();   // every read of the previous image is done
#pragma unroll
    for (int j = 0; j < S1D_X; ++j) {
      const int i = t + S1D_THREADS * j;
      if (i < S1_IMAGE) sx[i] = nx[j];
    }
#pragma unroll
    for (int j = 0; j < S1D_G; ++j) {
      const int i = t + S1D_THREADS * j;
      if (i < S1_POOLED) {   // window (k, pi, pj) = (i / 144, i % 144 / 12, i % 12): its 2 x 2 conv gradient
        const int q = arg_q(nq[j]), pos = i % 144;
        const float g = arg_g(nq[j], ng[j]);
        float* d = sd + (i / 144) * S1D_DS + (pos / 12) * 56 + (pos % 12) * 2;
        *reinterpret_cast<float2*>(d) = make_float2(q == 0 ? g : 0.f, q == 1 ? g : 0.f);
        *reinterpret_cast<float2*>(d + 28) = make_float2(q == 2 ? g : 0.f, q == 3 ? g : 0.f);
        bsum[j] += g;
      }
    }
    __syncthreads();
    if (n + gridDim.x < N) fetch(n + gridDim.x);
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      const int y = 3 * yp + j;
      const float* drow = sd + k * S1D_DS + y * 28;
      const float* xrow = sx + (y + r) * 28;
#pragma unroll
      for (int h = 0; h < 2; ++h) {   // columns x = 12 h .. 12 h + 11, reading x's columns 12 h .. 12 h + 15
        float d[12], v[16];
#pragma unroll
        for (int q = 0; q < 3; ++q) {
          const float4 a = *reinterpret_cast<const float4*>(drow + 12 * h + 4 * q);
          d[4 * q] = a.x; d[4 * q + 1] = a.y; d[4 * q + 2] = a.z; d[4 * q + 3] = a.w;
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float4 a = *reinterpret_cast<const float4*>(xrow + 12 * h + 4 * q);
          v[4 * q] = a.x; v[4 * q + 1] = a.y; v[4 * q + 2] = a.z; v[4 * q + 3] = a.w;
        }
#pragma unroll
        for (int xx = 0; xx < 12; ++xx)
#pragma unroll
          for (int s = 0; s < 5; ++s) acc[xx & 1][s] = fmaf(d[xx], v[xx + s], acc[xx & 1][s]);
      }
    }
  }
  __syncthreads();   // every read of sd is done: it holds the block's partial sums now
  float* red = sd;   // (k, r, s)'s 8 parts at ((k * 5 + r) * 5 + s) * 8, then the 864 windows' bias sums
#pragma unroll
  for (int s = 0; s < 5; ++s) red[((k * 5 + r) * 5 + s) * 8 + yp] = acc[0][s] + acc[1][s];
#pragma unroll
  for (int j = 0; j < S1D_G; ++j) {
    const int i = t + S1D_THREADS * j;
    if (i < S1_POOLED) red[1200 + i] = bsum[j];
  }
  __syncthreads();
  const bool direct = gridDim.x == 1;   // the block's sums are the gradients
  float* mine = direct ? dw : part + (size_t)blockIdx.x * 156;
  if (t < 150) {   // t = k * 25 + r * 5 + s: dw's own order
    float v = 0.f;
#pragma unroll
    for (int p = 0; p < 8; ++p) v += red[t * 8 + p];
    mine[t] = v;
  } else if (t < 156) {
    const int c = t - 150;
    float v = 0.f;
    for (int i = 0; i < 144; ++i) v += red[1200 + c * 144 + i];
    (direct ? db : mine + 150)[c] = v;
  }
}
