// module head: uses=softmax_ce_row,head_common
// LeNet's head, fc1 (256 -> 120) + bias + ReLU and fc2 (120 -> 10) + bias, on our kernels. Launchers:
// lenet/kernels/head.py (HeadLaunches). This module is compiled after softmax_ce_row.cu, whose per-row loss (sce_row)
// and reduction (block_sum, sce_finish) the forward runs in a training step, and head_common.cu (the
// shapes); the weights' kernel is a module of its own (head_weights.cu). The forward's second version,
// the same sums spread over two kernels of many blocks each for small batches, is head_split.cu's
// (Note [head split]).
//
//   head_forward_kernel   per group of G images: fc1, ReLU, fc2 (the logits); in a training step also
//                         the loss and dlogits, and the data gradients dh1 and dp2 (masked), all of which
//                         are local to an image
//   head_weights_kernel   (head_weights.cu) the weight and bias gradients, sums over images: block (j, s) owns hidden
//                         unit j's row of dW1 (and dW2's column j, db1[j]; block j = 0 also db2) over the
//                         s-th range of images
//
// Note [head latency]: at the batch sizes where these kernels win (up to a few hundred images) a
// launch is one or a few groups per block, so what counts is the chain of dependent memory accesses,
// not the multiply-adds (256 x 120 + 120 x 10 per image and direction). So: one kernel runs everything
// an image needs on the step's critical path (the forward, the loss, the gradients the layer below
// waits for), the weight gradients, which only the update reads, run beside it on the side stream
// (Note [side stream] in lenet/engines/context.py), and each phase issues its loads together: fc1's warps
// load five rows of W1 (1 KB each, two coalesced 16-byte loads per lane) before using any; W2 is staged
// in shared memory once per block; dp2 reads W1 by columns, from the L1 copy fc1's loads left.
// A weight gradient summed over a range of images per block needs no partial rows when one range
// covers the batch (small batches: the block writes the gradient itself); larger batches split the
// images into ranges whose rows one reduction adds in order. Deterministic, no float atomics.
//
// Layouts: p2 (N, 256) the flattened stage output; h1, dh1 (N, 120); logits, dlogits (N, 10);
// W1 (120, 256), W2 (10, 120) as PyTorch stores them. dp2 is masked by p2 > 0 (Note [relu at the
// pooled level] in lenet/engines/cudnn.py). A row of weight gradients is laid out as the flat gradient
// buffer from fc1.weight to fc2.bias (lenet/params.py: each tensor starts on a 64-float boundary, the
// padding written 0).
//
// Note [head compile]: fc1's loop over its three batches of five rows stays rolled. Unrolled (3 x 5 x 8
// warp sums), NVRTC took 1.3 s over this module against 0.65 s rolled, and on a first run on a fresh
// machine this module is the longest compile, which the first step waits for (Note [first run] in
// lenet/kernels/nvrtc.py); each batch's loads are issued together before any is used either way.

// dp2 = (W1^T dh1) * (p2 > 0) for a group's images: thread i (of 256) owns input i, summing over the 120
// hidden units in order (one FMA chain per image). NG images per thread: the group size G where it is
// one of 1, 2, 4 (a copy of the loop for each), else H_MAXG with the images past G skipped.
//
// Note [head dp2 per group]: with one loop for every G, each of its 120 iterations issued H_MAXG = 8
// shared loads and predicated FMAs whatever G was; at G = 1 (small batches) that loop was 73% of the
// forward's instructions (issue-bound, not waiting on memory). The sums are the same, in the same order
// (gradients bit-identical before and after, at groups of 1, 2, 4 and 8); the step is faster at 1 to 128
// images (docs/kernels.md, "The head").
template <int NG>
__device__ __forceinline__ void head_dp2(const float* __restrict__ W1, const float* sdh, const float* sp,
                                         float* __restrict__ dp2, int n0, int count, int G, int i) {
  const int groups = NG == H_MAXG ? G : NG;
  float acc[NG];
#pragma unroll
  for (int g = 0; g < NG; ++g) acc[g] = 0.f;
#pragma unroll 8
  for (int j = 0; j < H_HID; ++j) {
    const float w = __ldg(W1 + j * H_IN + i);
#pragma unroll
    for (int g = 0; g < NG; ++g)
      if (g < groups) acc[g] = fmaf(w, sdh[g * H_HID + j], acc[g]);
  }
#pragma unroll
  for (int g = 0; g < NG; ++g)
    if (g < count) dp2[(size_t)(n0 + g) * H_IN + i] = sp[g * H_IN + i] > 0.f ? acc[g] : 0.f;
}

// Forward. blockDim.x = 256 (8 warps), G images per block iteration.
//   fc1: warp w owns hidden units j = w + 8 u (u < 15); lane l holds inputs 4l..4l+3 and 128+4l..128+4l+3
//        of each image in registers, multiplies them with W1[j]'s same columns and the warp adds the
//        32 lanes' sums; lane 0 writes relu(sum + b1[j]).
//   fc2: warp w owns the (image g, class c) pairs w, w + 8, ...; lane l hidden units l, l + 32, l + 64,
//        l + 96; the warp adds them.
//   labels not null (a training step): thread g < count runs sce_row on image g's logits (dlogits into
//        sdl and dlogits); the block's loss sums go through sce_finish (softmax_ce_row.cu), whose last block
//        adds every block's in order. Then, when dp2 is not null, the data gradients:
//        dh1 = (W2^T dlogits) * (h1 > 0), thread j < 120;  dp2 = (W1^T dh1) * (p2 > 0), thread i < 256.
//   labels null, dp2 not null (a loss of the caller's): thread t < count * 10 reads the group's
//        dlogits[n0 * 10 + t] into sdl, then the same data gradients from them.
// Shared: sw2 (10 x 120) W2; sp (G x 256) the group's inputs; sh (G x 120) hidden units; sl, sdl (G x 10)
// logits and their gradient; sdh (G x 120) dh1; sv, sc (256) the loss's block sum.
extern "C" __global__ void __launch_bounds__(H_THREADS)
head_forward_kernel(const float* __restrict__ p2, const float* __restrict__ W1, const float* __restrict__ b1,
                    const float* __restrict__ W2, const float* __restrict__ b2, float* __restrict__ h1,
                    float* __restrict__ logits, int N, int G,
                    const int* __restrict__ labels, float* __restrict__ dlogits, float* __restrict__ out,
                    int* __restrict__ correct, float* __restrict__ partial_loss, int* __restrict__ partial_correct,
                    unsigned int* __restrict__ ticket, float* __restrict__ running, float grad_scale,
                    float loss_scale, float eps, float* __restrict__ dh1, float* __restrict__ dp2 HEAD_PACK_PARAMS) {
  griddep_entry();
#ifdef LENET_PACK
  {   // model m = blockIdx.y (head_common.cu); part_stride is the weights kernel's
    const unsigned m = blockIdx.y;
    HEAD_MODEL(p2, N * H_IN, m); HEAD_MODEL(h1, N * H_HID, m); HEAD_MODEL(logits, N * H_OUT, m);
    HEAD_MODEL(W1, ps, m); HEAD_MODEL(b1, ps, m); HEAD_MODEL(W2, ps, m); HEAD_MODEL(b2, ps, m);
    HEAD_MODEL(labels, N, m); HEAD_MODEL(dlogits, N * H_OUT, m); HEAD_MODEL(dh1, N * H_HID, m);
    HEAD_MODEL(dp2, N * H_IN, m); HEAD_MODEL(out, 1, m); HEAD_MODEL(correct, 1, m); HEAD_MODEL(running, 1, m);
    HEAD_MODEL(ticket, 1, m); HEAD_MODEL(partial_loss, gridDim.x, m); HEAD_MODEL(partial_correct, gridDim.x, m);
    if (eps_models) eps = eps_models[m];
  }
#endif
  __shared__ float sw2[H_OUT * H_HID];
  __shared__ __align__(16) float sp[H_MAXG * H_IN];
  __shared__ float sh[H_MAXG * H_HID];
  __shared__ float sl[H_MAXG * H_OUT];
  __shared__ float sdl[H_MAXG * H_OUT];
  __shared__ float sdh[H_MAXG * H_HID];
  __shared__ float sv[H_THREADS];
  __shared__ int sc[H_THREADS];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const float4* W14 = reinterpret_cast<const float4*>(W1);   // W1 starts on a 256-byte boundary
  for (int e = t; e < H_OUT * H_HID; e += H_THREADS) sw2[e] = __ldg(W2 + e);
  float loss = 0.f;
  int hits = 0;
  for (int n0 = blockIdx.x * G; n0 < N; n0 += gridDim.x * G) {
    const int count = min(G, N - n0);
    __syncthreads();   // the previous group's shared arrays are read (and, first, sw2 is written)
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
#pragma unroll 1   // Note [head compile]
    for (int u0 = 0; u0 < H_UNITS_PER_WARP; u0 += H_BATCH) {
      float4 wa[H_BATCH], wb[H_BATCH];
      float bj[H_BATCH];
#pragma unroll
      for (int k = 0; k < H_BATCH; ++k) {
        const int j = warp + H_WARPS * (u0 + k);
        wa[k] = __ldg(W14 + j * 64 + lane);
        wb[k] = __ldg(W14 + j * 64 + 32 + lane);
        bj[k] = __ldg(b1 + j);
      }
#pragma unroll
      for (int k = 0; k < H_BATCH; ++k) {
        const int j = warp + H_WARPS * (u0 + k);
#pragma unroll
        for (int g = 0; g < H_MAXG; ++g)
          if (g < G) {
            const float a = warp_sum(dot4(wb[k], xb[g], dot4(wa[k], xa[g], 0.f)));
            if (lane == 0 && g < count) {
              const float h = head_relu(a + bj[k]);
              sh[g * H_HID + j] = h;
              h1[(size_t)(n0 + g) * H_HID + j] = h;
            }
          }
      }
    }
    __syncthreads();
    head_fc2(sw2, sh, b2, sl, logits + (size_t)n0 * H_OUT, count);
    if (!labels && !dp2) continue;   // the logits only; the same for every thread of the grid
    __syncthreads();
    if (labels) {
      if (t < count) {
        int hit;
        loss += sce_row(sl + t * H_OUT, nullptr, labels[n0 + t], H_OUT, eps, sdl + t * H_OUT, grad_scale, hit);
        hits += hit;
      }
      __syncthreads();
      if (t < count * H_OUT) dlogits[(size_t)n0 * H_OUT + t] = sdl[t];
      if (!dp2) continue;
    } else {   // dlogits given (a loss of the caller's: lenet/torch.py)
      if (t < count * H_OUT) sdl[t] = dlogits[(size_t)n0 * H_OUT + t];
      __syncthreads();
    }
    if (t < H_HID) {
      for (int g = 0; g < count; ++g) {
        float a = 0.f;
#pragma unroll
        for (int c = 0; c < H_OUT; ++c) a = fmaf(sw2[c * H_HID + t], sdl[g * H_OUT + c], a);
        const float d = sh[g * H_HID + t] > 0.f ? a : 0.f;
        sdh[g * H_HID + t] = d;
        dh1[(size_t)(n0 + g) * H_HID + t] = d;
      }
    }
    __syncthreads();
    switch (G) {   // Note [head dp2 per group]
      case 1: head_dp2<1>(W1, sdh, sp, dp2, n0, count, G, t); break;
      case 2: head_dp2<2>(W1, sdh, sp, dp2, n0, count, G, t); break;
      case 4: head_dp2<4>(W1, sdh, sp, dp2, n0, count, G, t); break;
      default: head_dp2<H_MAXG>(W1, sdh, sp, dp2, n0, count, G, t);
    }
  }
  if (labels) {
    block_sum(loss, hits, sv, sc);
    sce_finish(loss, hits, partial_loss, partial_correct, ticket, out, correct, running, loss_scale, 0);
  }
}
