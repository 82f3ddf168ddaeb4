// What the head's modules share (lenet/kernels/__init__.py: SOURCES): its shapes, block size and arithmetic.
// head.cu and head_split.cu hold the forward's two versions (with the loss and the data gradients),
// head_weights.cu the weight and bias gradients: modules of their own, so that no compile waits for
// another on a first run (Note [first run] in lenet/kernels/nvrtc.py).

#define H_IN 256
#define H_HID 120
#define H_OUT 10
#define H_MAXG 8
#define H_THREADS 256
#define H_WARPS (H_THREADS / 32)
#define H_UNITS_PER_WARP (H_HID / H_WARPS)   // 15
#define H_BATCH 5                            // W1 rows a warp loads before using any

// The two forwards' arithmetic (head.cu, head_split.cu), term for term the same in both.
__device__ __forceinline__ float head_relu(float v) { return (v > 0.f || v != v) ? v : 0.f; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

// fc2 over a group's hidden units sh (count x 120) with W2 in sw2 (10 x 120): warp w of the block owns the
// (image g, class c) pairs w, w + 8, ...; lane l sums units l, l + 32, l + 64, l + 96 and the warp adds
// the lanes. The logits go to sl (count x 10) and, unless logits is null, to logits (the group's rows).
__device__ __forceinline__ void head_fc2(const float* sw2, const float* sh, const float* __restrict__ b2,
                                         float* sl, float* __restrict__ logits, int count) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int q = warp; q < count * H_OUT; q += H_WARPS) {
    const int g = q / H_OUT, c = q % H_OUT;
    float a = 0.f;
#pragma unroll
    for (int j = lane; j < H_HID; j += 32) a = fmaf(sw2[c * H_HID + j], sh[g * H_HID + j], a);
    a = warp_sum(a);
    if (lane == 0) {
      const float z = a + __ldg(b2 + c);
      sl[g * H_OUT + c] = z;
      if (logits) logits[g * H_OUT + c] = z;
    }
  }
}

// A pack of K models (lenet sweep) runs each kernel of the head once for all K, model m on blockIdx.y of
// head.cu's forward and blockIdx.z of head_split.cu's kernels and the weights' kernel (Note [model from
// the grid] in stage_common.cu): its images N rows after model m - 1's, its weights and gradients ps
// floats after (the flat buffers are (K, ps)), its loss totals, ticket and label smoothing its own. These
// are the pack versions' extra parameters and offsets (modules head__pack, head_split__pack and
// head_weights__pack, compiled with LENET_PACK); the one-model modules compile without them. Each model's
// grid is its lone run's, so a model of a pack sums in the order of its lone run (Note [a pack and a lone
// run] in lenet/pack.py).
#ifdef LENET_PACK
#define HEAD_PACK_PARAMS , int ps, const float* __restrict__ eps_models, long long part_stride
#define HEAD_MODEL(ptr, per, m) ((ptr) = (ptr) ? (ptr) + (size_t)(m) * (size_t)(per) : (ptr))
#else
#define HEAD_PACK_PARAMS
#endif
