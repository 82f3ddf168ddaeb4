// module stage2_forward_tiled: stage=conv2 direction=forward version=2 threads=64 images=4,8 smem=2400+864*images uses=stage_common
// Stage 2 forward, tiled over output channels: blockDim.x = 64 * imgs, thread t works on image slot
// t / 64 at pooled position (pi, pj) = (t % 16 / 4, t % 4) for the 4 output channels
// k = 4 kg + 0..3, kg = t % 64 / 16: 16 conv outputs in registers. Per input channel and filter row
// a thread loads the next input row (3 aligned 8-byte loads; the row before stays in registers) and
// 5 float4s of weights (the 4 channels' taps, one address per 16 lanes: a broadcast), then does 80
// multiply-adds: the one-output-per-thread kernel above does 20 per 17 loads and waits on shared
// memory, this one on its multiply-adds.
// Shared (dynamic): swt (2400) the weights as [c][r][s][k] (k innermost, 16-byte aligned groups of
// 4), then sx (imgs * 864) the group's images.
extern "C" __global__ void __launch_bounds__(512)
stage2_forward_tiled_kernel(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                            float* __restrict__ p, unsigned char* __restrict__ arg, int N, int ps) {
  griddep_entry();
  PACK_MODEL(x, (size_t)N * S2_IMAGE); PACK_MODEL(w, ps); PACK_MODEL(b, ps);   // Note [model from the grid]
  PACK_MODEL(p, (size_t)N * S2_POOLED); PACK_MODEL(arg, (size_t)N * S2_POOLED);
  extern __shared__ float4 smem4[];
  float* swt = reinterpret_cast<float*>(smem4);
  float* sx = swt + S2_WEIGHTS;
  const int t = threadIdx.x, imgs = blockDim.x / 64, slot = t / 64, u = t % 64;
  const int kg = u >> 4, pi = (u >> 2) & 3, pj = u & 3;
  for (int i = t; i < S2_WEIGHTS; i += blockDim.x) swt[(i % 150) * 16 + i / 150] = w[i];
  float bias[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) bias[q] = b[4 * kg + q];
  for (int n0 = blockIdx.x * imgs; n0 < N; n0 += gridDim.x * imgs) {
    __syncthreads();
    const int count = min(imgs, N - n0);
    for (int i = t; i < count * S2_IMAGE; i += blockDim.x) sx[i] = x[(size_t)n0 * S2_IMAGE + i];
    __syncthreads();
    if (slot >= count) continue;
    float a00[4], a01[4], a10[4], a11[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) a00[q] = a01[q] = a10[q] = a11[q] = bias[q];
    for (int c = 0; c < 6; ++c) {
      const float2* xc = reinterpret_cast<const float2*>(sx + slot * S2_IMAGE + c * 144 + (2 * pi) * 12 + 2 * pj);
      const float4* wc = reinterpret_cast<const float4*>(swt) + c * 100 + kg;   // (c, r, s) at wc[(r * 5 + s) * 4]
      float x0[6], x1[6];
#pragma unroll
      for (int h = 0; h < 3; ++h) { const float2 v = xc[h]; x0[2 * h] = v.x; x0[2 * h + 1] = v.y; }
#pragma unroll
      for (int r = 0; r < 5; ++r) {
#pragma unroll
        for (int h = 0; h < 3; ++h) { const float2 v = xc[(r + 1) * 6 + h]; x1[2 * h] = v.x; x1[2 * h + 1] = v.y; }
#pragma unroll
        for (int s = 0; s < 5; ++s) {
          const float4 wv = wc[(r * 5 + s) * 4];
          const float wq[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            a00[q] = fmaf(x0[s], wq[q], a00[q]);
            a01[q] = fmaf(x0[s + 1], wq[q], a01[q]);
            a10[q] = fmaf(x1[s], wq[q], a10[q]);
            a11[q] = fmaf(x1[s + 1], wq[q], a11[q]);
          }
        }
#pragma unroll
        for (int s = 0; s < 6; ++s) x0[s] = x1[s];
      }
    }
    const size_t out = (size_t)(n0 + slot) * S2_POOLED + (4 * kg) * 16 + pi * 4 + pj;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float best = a00[q];
      int qa = 0;
      if (a01[q] > best) { best = a01[q]; qa = 1; }
      if (a10[q] > best) { best = a10[q]; qa = 2; }
      if (a11[q] > best) { best = a11[q]; qa = 3; }
      p[out + q * 16] = relu_keep_nan(best);
      arg[out + q * 16] = arg_byte(qa, best);
    }
  }
}
