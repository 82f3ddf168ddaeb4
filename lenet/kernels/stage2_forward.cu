// module stage2_forward: stage=conv2 direction=forward version=1 threads=256 images=1,2 smem=2400+864*images uses=stage_common
// Stage 2 forward. blockDim.x = 256 * imgs: thread t works on image slot t / 256 at pooled output
// o = t % 256 = (k, pi, pj): 4 conv outputs in registers over 6 channels x 25 taps, then max and argmax.
// Shared (dynamic): sw (2400) the weights, then sx (imgs * 864) the group's images; sb (16) the bias.
// Note [wide loads]: the weights and each image group come in as float4s, loaded into registers before any
// is stored (every tensor starts on a 256-byte boundary: lenet/params.py, and an image is 216 float4s), a
// weight load at most 3 a thread and an image's 1. At one image a block the scalar loop (10 weight loads a
// thread, then 4 of the image) was the forward's longest part; at batch 1 a step is faster with 512
// threads a block than with 256 (docs/kernels.md, "The forwards").
extern "C" __global__ void __launch_bounds__(512)
stage2_forward_kernel(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                      float* __restrict__ p, unsigned char* __restrict__ arg, int N, int ps) {
  griddep_entry();
  PACK_MODEL(x, (size_t)N * S2_IMAGE); PACK_MODEL(w, ps); PACK_MODEL(b, ps);   // Note [model from the grid]
  PACK_MODEL(p, (size_t)N * S2_POOLED); PACK_MODEL(arg, (size_t)N * S2_POOLED);
  extern __shared__ float4 smem4[];
  float* sw = reinterpret_cast<float*>(smem4);
  float* sx = sw + S2_WEIGHTS;
  __shared__ float sb[16];
  const int t = threadIdx.x, imgs = blockDim.x / 256, slot = t / 256, o = t % 256;
  const int k = o >> 4, pi = (o >> 2) & 3, pj = o & 3;
  {   // Note [wide loads]: 600 float4s over at least 256 threads
    const float4* w4 = reinterpret_cast<const float4*>(w);
    float4 r[3];
#pragma unroll
    for (int j = 0; j < 3; ++j)
      if (t + j * (int)blockDim.x < S2_WEIGHTS / 4) r[j] = __ldg(w4 + t + j * blockDim.x);
#pragma unroll
    for (int j = 0; j < 3; ++j)
      if (t + j * (int)blockDim.x < S2_WEIGHTS / 4) smem4[t + j * blockDim.x] = r[j];
  }
  if (t < 16) sb[t] = b[t];
  for (int n0 = blockIdx.x * imgs; n0 < N; n0 += gridDim.x * imgs) {
    __syncthreads();
    const int count = min(imgs, N - n0);
    if (t < count * (S2_IMAGE / 4))   // one float4 a thread: 216 an image, 256 threads a slot
      reinterpret_cast<float4*>(sx)[t] = __ldg(reinterpret_cast<const float4*>(x + (size_t)n0 * S2_IMAGE) + t);
    __syncthreads();
    if (slot >= count) continue;
    float a00 = sb[k], a01 = a00, a10 = a00, a11 = a00;
    for (int c = 0; c < 6; ++c) {
      const float* xc = sx + slot * S2_IMAGE + c * 144 + (2 * pi) * 12 + 2 * pj;
      const float* wc = sw + (k * 6 + c) * 25;
#pragma unroll
      for (int r = 0; r < 5; ++r) {
        float x0[6], x1[6];
#pragma unroll
        for (int s = 0; s < 6; ++s) { x0[s] = xc[r * 12 + s]; x1[s] = xc[(r + 1) * 12 + s]; }
#pragma unroll
        for (int s = 0; s < 5; ++s) {
          const float wv = wc[r * 5 + s];
          a00 = fmaf(x0[s], wv, a00);
          a01 = fmaf(x0[s + 1], wv, a01);
          a10 = fmaf(x1[s], wv, a10);
          a11 = fmaf(x1[s + 1], wv, a11);
        }
      }
    }
    float best = a00;
    int q = 0;
    if (a01 > best) { best = a01; q = 1; }
    if (a10 > best) { best = a10; q = 2; }
    if (a11 > best) { best = a11; q = 3; }
    const size_t out = (size_t)(n0 + slot) * S2_POOLED + o;
    p[out] = relu_keep_nan(best);
    arg[out] = arg_byte(q, best);
  }
}
