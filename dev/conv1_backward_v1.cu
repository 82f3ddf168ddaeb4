// module stage1_backward: stage=conv1 direction=backward version=1 threads=192 uses=stage_common
// Stage 1 backward: the weight and bias gradients (nothing needs conv1's data gradient).
// blockDim.x = 192, one warp per output channel k = t / 32, one image per block iteration: lane
// l < 25 owns weight (k, r, s) = (k, l / 5, l % 5), lane 25 the bias of channel k (in step with the
// others, reading 1 for x); each sums its images in registers and writes its block's row
// part[blockIdx.x * 156 + i] (dw 150, then db 6).
// Shared: sx (28 x S1_RS) the image, row y at y * S1_RS; sgo (864) each window's pooled gradient
// and its argmax as an offset y * S1_RS + x into sx, in one 8-byte record (Note [stage backward
// through the argmax]). The next image's inputs are loaded into registers while this one is
// computed (Note [prefetch]).
// A warp's step reads one record (the same for every lane: one wavefront) and one word of sx per
// lane at that record's offset plus the lane's tap r * S1_RS + s: with S1_RS = 45 (13 mod 32) the 25
// taps fall in 25 banks, one wavefront (Note [shared-memory banks]). The earlier layout (160 threads,
// tap t, 28-float rows, two channels per warp at two offsets, gradient and offset in two arrays)
// took about 4.5 wavefronts per step.
#define S1B_THREADS 192
#define S1B_X 5   // ceil(784 / 192)
#define S1B_G 5   // ceil(864 / 192)
#ifndef S1_RS
#define S1_RS 45
#endif
extern "C" __global__ void __launch_bounds__(S1B_THREADS)
stage1_backward_kernel(const float* __restrict__ x, const unsigned char* __restrict__ arg,
                       const float* __restrict__ dp, float* __restrict__ part, float* __restrict__ dw,
                       float* __restrict__ db, int N, int ps) {
  griddep_entry();
  PACK_MODEL(x, (size_t)N * S1_IMAGE); PACK_MODEL(arg, (size_t)N * S1_POOLED);   // Note [model from the grid]
  PACK_MODEL(dp, (size_t)N * S1_POOLED); PACK_MODEL(part, (size_t)gridDim.x * 156);
  PACK_MODEL(dw, ps); PACK_MODEL(db, ps);
  __shared__ float sx[28 * S1_RS];
  __shared__ float2 sgo[S1_POOLED];
  const int t = threadIdx.x, k = t >> 5, lane = t & 31;
  const bool bias = lane >= 25;   // lane 25 sums the gradient alone (lanes 26..31 idle along)
  const int tap = bias ? 0 : (lane / 5) * S1_RS + lane % 5;
  float nx[S1B_X], ng[S1B_G];
  int nq[S1B_G], sxi[S1B_X];   // sxi: where the image's element t + 192 j goes in sx
#pragma unroll
  for (int j = 0; j < S1B_X; ++j) {
    const int i = t + S1B_THREADS * j;
    sxi[j] = (i / 28) * S1_RS + i % 28;
  }
  auto fetch = [&](int n) {
#pragma unroll
    for (int j = 0; j < S1B_X; ++j) {
      const int i = t + S1B_THREADS * j;
      if (i < S1_IMAGE) nx[j] = x[(size_t)n * S1_IMAGE + i];
    }
#pragma unroll
    for (int j = 0; j < S1B_G; ++j) {
      const int i = t + S1B_THREADS * j;
      if (i < S1_POOLED) { nq[j] = arg[(size_t)n * S1_POOLED + i]; ng[j] = dp[(size_t)n * S1_POOLED + i]; }
    }
  };
  float acc = 0.f;
  if (blockIdx.x < N) fetch(blockIdx.x);
  for (int n = blockIdx.x; n < N; n += gridDim.x) {
    __syncthreads();   // every read of the previous image is done
#pragma unroll
    for (int j = 0; j < S1B_X; ++j) {
      const int i = t + S1B_THREADS * j;
      if (i < S1_IMAGE) sx[sxi[j]] = nx[j];
    }
#pragma unroll
    for (int j = 0; j < S1B_G; ++j) {
      const int i = t + S1B_THREADS * j;
      if (i < S1_POOLED) {
        const int q = arg_q(nq[j]), pos = i % 144;
        const int off = (2 * (pos / 12) + (q >> 1)) * S1_RS + 2 * (pos % 12) + (q & 1);
        sgo[i] = make_float2(arg_g(nq[j], ng[j]), __int_as_float(off));
      }
    }
    __syncthreads();
    if (n + gridDim.x < N) fetch(n + gridDim.x);
    const float2* g = sgo + k * 144;
    float a = 0.f;
#pragma unroll 8
    for (int i = 0; i < 144; ++i) {   // every lane in step: the bias lane reads lane 0's word (a broadcast)
      const float2 v = g[i];
      const float xv = sx[__float_as_int(v.y) + tap];
      a = fmaf(v.x, bias ? 1.f : xv, a);
    }
    acc += a;
  }
  const int col = lane < 25 ? k * 25 + lane : 150 + k;   // this lane's column: dw, then db
  if (lane < 26) {
    if (gridDim.x == 1) {   // the block's sums are the gradients
      if (lane < 25) dw[col] = acc; else db[k] = acc;
    } else {
      part[(size_t)blockIdx.x * 156 + col] = acc;
    }
  }
}
