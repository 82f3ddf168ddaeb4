// LeNet's head, fc1 (256 -> 120) + bias + ReLU and fc2 (120 -> 10) + bias, forward and backward, each
// direction one kernel for a group of G images per block iteration (plus the stage reduction of the
// per-block weight and bias gradients). Launchers: lenet/ops/fc.py (OursHead). The softmax
// cross-entropy between them stays lenet/kernels/softmax_ce.cu.
//
// Layouts: p2 (N, 256) the flattened stage output; h1 (N, 120) relu(fc1); logits, dlogits (N, 10);
// W1 (120, 256), W2 (10, 120) as PyTorch stores them. The backward writes dp2 masked by p2 > 0
// (Note [relu at the pooled level] in lenet/ops/conv.py) and, per block, one row of partial sums laid
// out as the flat gradient buffer from fc1.weight to fc2.bias (lenet/params.py: each tensor starts on
// a 64-float boundary, the padding between them written 0), which stage_reduce_kernel adds in block
// order: deterministic, no float atomics.

#define H_IN 256
#define H_HID 120
#define H_OUT 10
#define H_TILE 64
#define H_MAXG 8
#define H_W1 (H_HID * H_IN)

__device__ __forceinline__ float head_relu(float v) { return (v > 0.f || v != v) ? v : 0.f; }

// Forward. blockDim.x = 256, G (<= 8) images per block iteration. W2 is kept in shared memory; W1 goes
// through shared tiles of 64 inputs x 120 units, each loaded by all threads at once (30 loads in
// flight per thread) and stored transposed (stride 121: conflict-free both ways). Thread j < 120
// owns hidden unit j of the group's images (G sums in registers); then thread t < 10 G owns logit
// (t / 10, t % 10).
// Shared (dynamic): sw2 (1200) W2, sp (G x 256) the inputs, sh (G x 120) the hidden units, sw (64 x 121).
extern "C" __global__ void __launch_bounds__(256)
head_forward_kernel(const float* __restrict__ p2, const float* __restrict__ W1, const float* __restrict__ b1,
                    const float* __restrict__ W2, const float* __restrict__ b2, float* __restrict__ h1,
                    float* __restrict__ logits, int N, int G) {
  extern __shared__ float smem[];
  float* sw2 = smem;
  float* sp = sw2 + H_OUT * H_HID;
  float* sh = sp + G * H_IN;
  float* sw = sh + G * H_HID;
  const int t = threadIdx.x;
  for (int e = t; e < H_OUT * H_HID; e += 256) sw2[e] = W2[e];
  for (int n0 = blockIdx.x * G; n0 < N; n0 += gridDim.x * G) {
    const int count = min(G, N - n0);
    __syncthreads();
    for (int e = t; e < G * H_IN; e += 256) sp[e] = e < count * H_IN ? p2[(size_t)n0 * H_IN + e] : 0.f;
    float acc[H_MAXG];
#pragma unroll
    for (int g = 0; g < H_MAXG; ++g) acc[g] = 0.f;
    for (int i0 = 0; i0 < H_IN; i0 += H_TILE) {
      __syncthreads();   // the previous tile is read (and, first, sp and sw2 are written)
      constexpr int PER = H_TILE * H_HID / 256;   // 30
      float wv[PER];
#pragma unroll
      for (int u = 0; u < PER; ++u) {
        const int e = t + 256 * u;
        wv[u] = W1[(e / H_TILE) * H_IN + i0 + e % H_TILE];
      }
#pragma unroll
      for (int u = 0; u < PER; ++u) {
        const int e = t + 256 * u;
        sw[(e % H_TILE) * (H_HID + 1) + e / H_TILE] = wv[u];
      }
      __syncthreads();
      if (t < H_HID) {
#pragma unroll 8
        for (int ii = 0; ii < H_TILE; ++ii) {
          const float w = sw[ii * (H_HID + 1) + t];
#pragma unroll
          for (int g = 0; g < H_MAXG; ++g)
            if (g < G) acc[g] = fmaf(w, sp[g * H_IN + i0 + ii], acc[g]);
        }
      }
    }
    if (t < H_HID) {
      const float bj = b1[t];
#pragma unroll
      for (int g = 0; g < H_MAXG; ++g)
        if (g < count) {
          const float h = head_relu(acc[g] + bj);
          sh[g * H_HID + t] = h;
          h1[(size_t)(n0 + g) * H_HID + t] = h;
        }
    }
    __syncthreads();
    if (t < count * H_OUT) {
      const int g = t / H_OUT, c = t % H_OUT;
      float a = 0.f;
#pragma unroll 8
      for (int j = 0; j < H_HID; ++j) a = fmaf(sw2[c * H_HID + j], sh[g * H_HID + j], a);
      logits[(size_t)(n0 + g) * H_OUT + c] = a + b2[c];
    }
  }
}

// Backward. blockDim.x = 256, G (<= 8) images per iteration; W1 is copied into shared memory once
// per block (120 KB: the launcher raises the kernel's dynamic shared-memory limit). Per group:
//   dh1 = (W2^T dlogits) * (h1 > 0)                 thread j < 120, W2's column j in registers
//   dp2 = (W1^T dh1) * (p2 > 0)                     thread i < 256
//   partial dW1[j, i] += sum_g dh1[g, j] p2[g, i]   thread i, for every j
//   partial db1, dW2, db2 likewise (threads over their entries)
// into this block's row of `part` (width: fc1.weight .. fc2.bias in the flat layout; offsets below).
// Shared (dynamic): sw1 (120 x 256) W1, sp (G x 256), sh (G x 120), sdl (G x 10), sdh (G x 120).
extern "C" __global__ void __launch_bounds__(256)
head_backward_kernel(const float* __restrict__ p2, const float* __restrict__ h1, const float* __restrict__ dlogits,
                     const float* __restrict__ W1, const float* __restrict__ W2, float* __restrict__ dp2,
                     float* __restrict__ part, int width, int off_b1, int off_w2, int off_b2, int N, int G) {
  extern __shared__ float smem[];
  float* sw1 = smem;
  float* sp = sw1 + H_W1;
  float* sh = sp + G * H_IN;
  float* sdl = sh + G * H_HID;
  float* sdh = sdl + G * H_OUT;
  const int t = threadIdx.x;
  float* row = part + (size_t)blockIdx.x * width;
  for (int e = t; e < H_W1 / 4; e += 256)   // W1 starts on a 256-byte boundary (lenet/params.py)
    reinterpret_cast<float4*>(sw1)[e] = reinterpret_cast<const float4*>(W1)[e];
  float w2c[H_OUT];
  if (t < H_HID) {
#pragma unroll
    for (int c = 0; c < H_OUT; ++c) w2c[c] = W2[c * H_HID + t];
  }
  // Columns of the row that no gradient owns (the padding between tensors) are written 0 once.
  for (int e = H_W1 + t; e < width; e += 256) {
    const bool pad = (e < off_b1) || (e >= off_b1 + H_HID && e < off_w2) || (e >= off_w2 + H_OUT * H_HID && e < off_b2);
    if (pad) row[e] = 0.f;
  }
  bool first = true;
  for (int n0 = blockIdx.x * G; n0 < N; n0 += gridDim.x * G) {
    const int count = min(G, N - n0);
    __syncthreads();
    for (int e = t; e < G * H_IN; e += 256) sp[e] = e < count * H_IN ? p2[(size_t)n0 * H_IN + e] : 0.f;
    for (int e = t; e < G * H_HID; e += 256) sh[e] = e < count * H_HID ? h1[(size_t)n0 * H_HID + e] : 0.f;
    for (int e = t; e < G * H_OUT; e += 256) sdl[e] = e < count * H_OUT ? dlogits[(size_t)n0 * H_OUT + e] : 0.f;
    __syncthreads();
    if (t < H_HID) {
      for (int g = 0; g < G; ++g) {
        float a = 0.f;
#pragma unroll
        for (int c = 0; c < H_OUT; ++c) a = fmaf(w2c[c], sdl[g * H_OUT + c], a);
        sdh[g * H_HID + t] = sh[g * H_HID + t] > 0.f ? a : 0.f;
      }
    }
    __syncthreads();
    {   // dp2 and dW1: thread t owns input i = t
      const int i = t;
      float acc[H_MAXG];
#pragma unroll
      for (int g = 0; g < H_MAXG; ++g) acc[g] = 0.f;
#pragma unroll 4
      for (int j = 0; j < H_HID; ++j) {
        const float w = sw1[j * H_IN + i];
        float d = 0.f;
#pragma unroll
        for (int g = 0; g < H_MAXG; ++g)
          if (g < G) {
            const float dh = sdh[g * H_HID + j];
            acc[g] = fmaf(w, dh, acc[g]);
            d = fmaf(dh, sp[g * H_IN + i], d);
          }
        float* dst = row + j * H_IN + i;
        *dst = first ? d : *dst + d;
      }
#pragma unroll
      for (int g = 0; g < H_MAXG; ++g)
        if (g < count) dp2[(size_t)(n0 + g) * H_IN + i] = sp[g * H_IN + i] > 0.f ? acc[g] : 0.f;
    }
    if (t < H_HID) {
      float d = 0.f;
      for (int g = 0; g < G; ++g) d += sdh[g * H_HID + t];
      row[off_b1 + t] = first ? d : row[off_b1 + t] + d;
    }
    for (int e = t; e < H_OUT * H_HID; e += 256) {
      const int c = e / H_HID, j = e % H_HID;
      float d = 0.f;
      for (int g = 0; g < G; ++g) d = fmaf(sdl[g * H_OUT + c], sh[g * H_HID + j], d);
      row[off_w2 + e] = first ? d : row[off_w2 + e] + d;
    }
    if (t < H_OUT) {
      float d = 0.f;
      for (int g = 0; g < G; ++g) d += sdl[g * H_OUT + t];
      row[off_b2 + t] = first ? d : row[off_b2 + t] + d;
    }
    first = false;
  }
  if (first) {   // a block with no group: its row must still add nothing
    for (int e = t; e < width; e += 256) row[e] = 0.f;
  }
}
