// module stage1_forward: stage=conv1 direction=forward version=1 threads=144 images=1,2,4 smem=784*images uses=stage_common
// Stage 1 forward. blockDim.x = 144 * imgs: thread t works on image slot t / 144 of the block's
// current group of imgs images, at pooled position (pi, pj) = (t % 144 / 12, t % 144 % 12), for all
// 6 channels: its 6 x 6 input patch in registers, 4 conv outputs per channel, their max and argmax.
// Shared: sx (imgs * 784 floats, dynamic) the group's images; sw (150), sb (6) weights and bias.
extern "C" __global__ void __launch_bounds__(576)
stage1_forward_kernel(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                      float* __restrict__ p, unsigned char* __restrict__ arg, int N, int ps) {
  griddep_entry();
  PACK_MODEL(x, (size_t)N * S1_IMAGE); PACK_MODEL(w, ps); PACK_MODEL(b, ps);   // Note [model from the grid]
  PACK_MODEL(p, (size_t)N * S1_POOLED); PACK_MODEL(arg, (size_t)N * S1_POOLED);
  extern __shared__ float4 sx4[];   // Note [wide loads] in stage2_forward.cu
  float* sx = reinterpret_cast<float*>(sx4);
  __shared__ float sw[150];
  __shared__ float sb[6];
  const int t = threadIdx.x, imgs = blockDim.x / 144, slot = t / 144, pos = t % 144;
  const int pi = pos / 12, pj = pos % 12;
  for (int i = t; i < 150; i += blockDim.x) sw[i] = w[i];
  if (t < 6) sb[t] = b[t];
  for (int n0 = blockIdx.x * imgs; n0 < N; n0 += gridDim.x * imgs) {
    __syncthreads();   // every read of the previous group is done
    const int count = min(imgs, N - n0);
    {   // 196 float4s an image, 144 threads a slot: at most two a thread, both loaded before either is stored
      const float4* x4 = reinterpret_cast<const float4*>(x + (size_t)n0 * S1_IMAGE);
      const int total = count * (S1_IMAGE / 4), i0 = t, i1 = t + blockDim.x;
      float4 r0, r1;
      if (i0 < total) r0 = __ldg(x4 + i0);
      if (i1 < total) r1 = __ldg(x4 + i1);
      if (i0 < total) sx4[i0] = r0;
      if (i1 < total) sx4[i1] = r1;
    }
    __syncthreads();
    if (slot >= count) continue;
    const float* xs = sx + slot * S1_IMAGE + (2 * pi) * 28 + 2 * pj;
    float v[6][6];
#pragma unroll
    for (int r = 0; r < 6; ++r)
#pragma unroll
      for (int s = 0; s < 6; ++s) v[r][s] = xs[r * 28 + s];
    const size_t out = (size_t)(n0 + slot) * S1_POOLED + pos;
#pragma unroll
    for (int k = 0; k < 6; ++k) {
      float a0 = sb[k], a1 = a0, a2 = a0, a3 = a0;
#pragma unroll
      for (int r = 0; r < 5; ++r)
#pragma unroll
        for (int s = 0; s < 5; ++s) {
          const float wv = sw[k * 25 + r * 5 + s];
          a0 = fmaf(v[r][s], wv, a0);
          a1 = fmaf(v[r][s + 1], wv, a1);
          a2 = fmaf(v[r + 1][s], wv, a2);
          a3 = fmaf(v[r + 1][s + 1], wv, a3);
        }
      float best = a0;
      int q = 0;
      if (a1 > best) { best = a1; q = 1; }
      if (a2 > best) { best = a2; q = 2; }
      if (a3 > best) { best = a3; q = 3; }
      p[out + k * 144] = relu_keep_nan(best);
      arg[out + k * 144] = arg_byte(q, best);
    }
  }
}
