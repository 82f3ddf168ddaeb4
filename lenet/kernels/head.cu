// LeNet's head, fc1 (256 -> 120) + bias + ReLU and fc2 (120 -> 10) + bias, forward and backward, each
// direction one kernel for a group of G (<= 8) images per block iteration (plus the stage reduction of
// the per-block weight and bias gradients). Launchers: lenet/ops/fc.py (OursHead). This module is
// compiled after softmax_ce.cu, whose per-row loss (sce_row) the forward runs when it is given labels:
// in a training step the loss and dlogits come out of the head's forward, not a launch of their own.
//
// Layouts: p2 (N, 256) the flattened stage output; h1 (N, 120) relu(fc1); logits, dlogits (N, 10);
// W1 (120, 256), W2 (10, 120) as PyTorch stores them. The backward writes dp2 masked by p2 > 0
// (Note [relu at the pooled level] in lenet/ops/conv.py) and, per block, one row of partial sums laid
// out as the flat gradient buffer from fc1.weight to fc2.bias (lenet/params.py: each tensor starts on
// a 64-float boundary, the padding between them written 0), which stage_reduce_kernel adds in block
// order: deterministic, no float atomics. A grid of one block is handed the gradient buffer itself as
// its row (the same layout), and no reduction runs.
//
// Note [head latency]: at the batch sizes where these kernels win (up to a few hundred images) a
// launch is one or a few groups per block, so what counts is the chain of dependent memory accesses,
// not the multiply-adds (256 x 120 + 120 x 10 per image). The forward therefore reads W1 straight from
// global memory (L2), each warp a whole row of 1 KB per unit with two coalesced 16-byte loads per lane,
// five units' loads in flight at once, and sums across the warp with shuffles; the backward reads W1
// by columns from global memory as well (eight rows' loads in flight per thread) instead of first
// copying all 120 KB into shared memory behind a barrier.

#define H_IN 256
#define H_HID 120
#define H_OUT 10
#define H_MAXG 8
#define H_THREADS 256
#define H_WARPS (H_THREADS / 32)
#define H_UNITS_PER_WARP (H_HID / H_WARPS)   // 15

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

// Forward. blockDim.x = 256 (8 warps), G images per block iteration.
//   fc1: warp w owns hidden units j = w + 8 u (u < 15); lane l holds inputs 4l..4l+3 and 128+4l..128+4l+3
//        of each image in registers, multiplies them with W1[j]'s same columns (two float4 loads) and
//        the warp adds the 32 lanes' sums; lane 0 writes relu(sum + b1[j]).
//   fc2: warp w owns the (image g, class c) pairs w, w + 8, ...; lane l hidden units l, l + 32, l + 64,
//        l + 96; the warp adds them.
//   loss (labels not null): thread g < count runs sce_row on image g's logits, writes its dlogits and
//        keeps its loss and hit; the block's sums go through sce_finish (softmax_ce.cu), whose last
//        block adds every block's in order.
// Shared: sp (G x 256) the group's inputs, sh (G x 120) hidden units, sl (G x 10) logits; sv, sc (256)
// the loss's block sum.
extern "C" __global__ void __launch_bounds__(H_THREADS)
head_forward_kernel(const float* __restrict__ p2, const float* __restrict__ W1, const float* __restrict__ b1,
                    const float* __restrict__ W2, const float* __restrict__ b2, float* __restrict__ h1,
                    float* __restrict__ logits, int N, int G,
                    const int* __restrict__ labels, float* __restrict__ dlogits, float* __restrict__ out,
                    int* __restrict__ correct, float* __restrict__ partial_loss, int* __restrict__ partial_correct,
                    unsigned int* __restrict__ ticket, float* __restrict__ running, float grad_scale,
                    float loss_scale, float eps) {
  __shared__ __align__(16) float sp[H_MAXG * H_IN];
  __shared__ float sh[H_MAXG * H_HID];
  __shared__ float sl[H_MAXG * H_OUT];
  __shared__ float sv[H_THREADS];
  __shared__ int sc[H_THREADS];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const float4* W14 = reinterpret_cast<const float4*>(W1);   // W1 starts on a 256-byte boundary
  float loss = 0.f;
  int hits = 0;
  for (int n0 = blockIdx.x * G; n0 < N; n0 += gridDim.x * G) {
    const int count = min(G, N - n0);
    __syncthreads();   // the previous group's shared arrays are read
    const float4* src = reinterpret_cast<const float4*>(p2 + (size_t)n0 * H_IN);
    for (int e = t; e < G * (H_IN / 4); e += H_THREADS)
      reinterpret_cast<float4*>(sp)[e] = e < count * (H_IN / 4) ? src[e] : make_float4(0.f, 0.f, 0.f, 0.f);
    __syncthreads();
    float4 xa[H_MAXG], xb[H_MAXG];
#pragma unroll
    for (int g = 0; g < H_MAXG; ++g)
      if (g < G) {
        xa[g] = reinterpret_cast<const float4*>(sp)[g * 64 + lane];
        xb[g] = reinterpret_cast<const float4*>(sp)[g * 64 + 32 + lane];
      }
#pragma unroll 5
    for (int u = 0; u < H_UNITS_PER_WARP; ++u) {
      const int j = warp + H_WARPS * u;
      const float4 wa = __ldg(W14 + j * 64 + lane), wb = __ldg(W14 + j * 64 + 32 + lane);
      const float bj = __ldg(b1 + j);
#pragma unroll
      for (int g = 0; g < H_MAXG; ++g)
        if (g < G) {
          const float a = warp_sum(dot4(wb, xb[g], dot4(wa, xa[g], 0.f)));
          if (lane == 0 && g < count) {
            const float h = head_relu(a + bj);
            sh[g * H_HID + j] = h;
            h1[(size_t)(n0 + g) * H_HID + j] = h;
          }
        }
    }
    __syncthreads();
    for (int q = warp; q < count * H_OUT; q += H_WARPS) {
      const int g = q / H_OUT, c = q % H_OUT;
      float a = 0.f;
#pragma unroll
      for (int j = lane; j < H_HID; j += 32) a = fmaf(__ldg(W2 + c * H_HID + j), sh[g * H_HID + j], a);
      a = warp_sum(a);
      if (lane == 0) {
        const float z = a + __ldg(b2 + c);
        sl[g * H_OUT + c] = z;
        logits[(size_t)(n0 + g) * H_OUT + c] = z;
      }
    }
    if (labels) {   // the same for every thread of the grid
      __syncthreads();
      if (t < count) {
        int hit;
        loss += sce_row(sl + t * H_OUT, nullptr, labels[n0 + t], H_OUT, eps, dlogits + (size_t)(n0 + t) * H_OUT,
                        grad_scale, hit);
        hits += hit;
      }
    }
  }
  if (labels) {
    block_sum(loss, hits, sv, sc);
    sce_finish(loss, hits, partial_loss, partial_correct, ticket, out, correct, running, loss_scale, 0);
  }
}

// Backward. blockDim.x = 256, G (<= 8) images per iteration. Per group:
//   dh1 = (W2^T dlogits) * (h1 > 0)                 thread j < 120, W2's column j in registers
//   dp2 = (W1^T dh1) * (p2 > 0)                     thread i < 256, W1's column i read from global memory
//   partial dW1[j, i] += sum_g dh1[g, j] p2[g, i]   thread i, for every j
//   partial db1, dW2, db2 likewise (threads over their entries)
// into this block's row of `part` (width: fc1.weight .. fc2.bias in the flat layout; offsets below).
// Shared: sp (G x 256), sh (G x 120), sdl (G x 10), sdh (G x 120).
extern "C" __global__ void __launch_bounds__(H_THREADS)
head_backward_kernel(const float* __restrict__ p2, const float* __restrict__ h1, const float* __restrict__ dlogits,
                     const float* __restrict__ W1, const float* __restrict__ W2, float* __restrict__ dp2,
                     float* __restrict__ part, int width, int off_b1, int off_w2, int off_b2, int N, int G) {
  __shared__ __align__(16) float sp[H_MAXG * H_IN];
  __shared__ float sh[H_MAXG * H_HID];
  __shared__ float sdl[H_MAXG * H_OUT];
  __shared__ float sdh[H_MAXG * H_HID];
  const int t = threadIdx.x;
  float* row = part + (size_t)blockIdx.x * width;
  float w2c[H_OUT];
  if (t < H_HID) {
#pragma unroll
    for (int c = 0; c < H_OUT; ++c) w2c[c] = __ldg(W2 + c * H_HID + t);
  }
  // Columns of the row that no gradient owns (the padding between tensors) are written 0 once.
  for (int e = H_HID * H_IN + t; e < width; e += H_THREADS) {
    const bool pad = (e < off_b1) || (e >= off_b1 + H_HID && e < off_w2) || (e >= off_w2 + H_OUT * H_HID && e < off_b2);
    if (pad) row[e] = 0.f;
  }
  bool first = true;
  for (int n0 = blockIdx.x * G; n0 < N; n0 += gridDim.x * G) {
    const int count = min(G, N - n0);
    __syncthreads();
    const float4* src = reinterpret_cast<const float4*>(p2 + (size_t)n0 * H_IN);
    for (int e = t; e < G * (H_IN / 4); e += H_THREADS)
      reinterpret_cast<float4*>(sp)[e] = e < count * (H_IN / 4) ? src[e] : make_float4(0.f, 0.f, 0.f, 0.f);
    for (int e = t; e < G * H_HID; e += H_THREADS) sh[e] = e < count * H_HID ? h1[(size_t)n0 * H_HID + e] : 0.f;
    for (int e = t; e < G * H_OUT; e += H_THREADS) sdl[e] = e < count * H_OUT ? dlogits[(size_t)n0 * H_OUT + e] : 0.f;
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
      float xi[H_MAXG], acc[H_MAXG];
#pragma unroll
      for (int g = 0; g < H_MAXG; ++g) {
        xi[g] = g < G ? sp[g * H_IN + i] : 0.f;
        acc[g] = 0.f;
      }
#pragma unroll 8
      for (int j = 0; j < H_HID; ++j) {
        const float w = __ldg(W1 + j * H_IN + i);
        float d = 0.f;
#pragma unroll
        for (int g = 0; g < H_MAXG; ++g)
          if (g < G) {
            const float dh = sdh[g * H_HID + j];
            acc[g] = fmaf(w, dh, acc[g]);
            d = fmaf(dh, xi[g], d);
          }
        float* dst = row + j * H_IN + i;
        *dst = first ? d : *dst + d;
      }
#pragma unroll
      for (int g = 0; g < H_MAXG; ++g)
        if (g < count) dp2[(size_t)(n0 + g) * H_IN + i] = xi[g] > 0.f ? acc[g] : 0.f;
    }
    if (t < H_HID) {
      float d = 0.f;
      for (int g = 0; g < G; ++g) d += sdh[g * H_HID + t];
      row[off_b1 + t] = first ? d : row[off_b1 + t] + d;
    }
    for (int e = t; e < H_OUT * H_HID; e += H_THREADS) {
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
    for (int e = t; e < width; e += H_THREADS) row[e] = 0.f;
  }
}
