// module head_split: uses=softmax_ce_row,head_common
// LeNet's head split over many blocks (the second version of head.cu's forward, for small batches):
// the same outputs from two kernels whose grids spread W1 over the GPU. Launchers: lenet/kernels/head.py
// (HeadLaunches, a HeadShape with split=True). The weight gradients are head_weights.cu's, as for head.cu.
//
//   head_split_hidden_kernel  grid (15, S, models): block (u, s) runs fc1 + ReLU for hidden units
//                             8u .. 8u + 7 (one a warp) over slice s of G images (h1)
//   head_split_out_kernel     grid (8, S, models): block (b, s) runs, for slice s's images, fc2 (the
//                             logits), in a training step the loss and dlogits, then dh1 (each block of
//                             the slice all of these again: a few thousand multiply-adds) and dp2 for
//                             inputs 32b .. 32b + 31; block b = 0 writes the logits, dlogits and dh1 and
//                             the slice's loss sums (one slice: the totals themselves)
//   head_split_loss_kernel    grid (models), one warp: the slices' loss sums added in slice order into the
//                             totals (Note [the loss beside the step])
//
// Note [head split]: head.cu's forward runs an image group's whole head in one block, and at small
// batches that is a chain of dependent steps on one SM: three rounds of W1 loads (123 KB) for fc1, fc2,
// the loss, then dp2's 120 rounds over W1's columns (docs/kernels.md, "The head"). Here each block loads what it needs in one round: a warp its row of W1 and
// its images; a block of the second kernel its 32 columns of W1, W2 and the slice's h1, into shared
// memory. Every input of dp2 sums over all 120 hidden units, which no block of the first kernel holds:
// hence two launches. A first version ran fc2 and the loss in the slice's last fc1 block (an atomic
// ticket a slice) and only the data gradients in the second kernel: the ticket's fences and atomics were
// on the path.
// Every sum runs in head.cu's order (fc1: the same lane sums and warp tree; fc2: the same; dh1 over the
// 10 classes and dp2 over the 120 units in order), so the two versions' logits, dlogits and gradients
// are bit-identical, and the loss too where head.cu's group is the slice (both sum it a group at a
// time, then the groups in order; tests/test_head_gpu.py).
//
// Note [the loss beside the step]: nothing in a training step reads the loss's totals, only the host after
// it. When the slices' sums were added in the second kernel (block 0 of each slice: its part stored, a
// fence, an atomic ticket, and the last slice's block adding the parts), those round trips ended the
// kernel after its work and held up the stage below (scripts/probes/chain.py; docs/kernels.md, "The
// head"). Now block 0 of each
// slice stores its part, and head_split_loss_kernel adds the parts on a stream beside the step (lane 1 of
// lenet.engines.context.SideStream), joined with the side stream's other work before the step ends. A slice's sums
// are its first warp's (the images are threads 0 .. count - 1 < 32), added in block_sum's tree order
// (softmax_ce_row.cu), so the loss keeps head.cu's bits.
//
// Layouts as head.cu's; partial_loss and partial_correct hold one part per slice.

#define HS_MAXG 16            // images a slice holds at most
#define HS_COLS 32            // dp2's inputs a block owns

// fc1 + ReLU: warp w of block (u, s) owns hidden unit j = 8u + w; lane l holds W1[j]'s inputs 4l..4l+3
// and 128+4l..128+4l+3, loads 8 images' same inputs at a time and the warp adds the 32 lanes' sums
// (head.cu's fc1, term for term).
extern "C" __global__ void __launch_bounds__(H_THREADS)
head_split_hidden_kernel(const float* __restrict__ p2, const float* __restrict__ W1, const float* __restrict__ b1,
                         float* __restrict__ h1, int N, int G HEAD_PACK_PARAMS) {
  griddep_entry();
#ifdef LENET_PACK
  {   // model m = blockIdx.z (head_common.cu)
    const unsigned m = blockIdx.z;
    HEAD_MODEL(p2, N * H_IN, m); HEAD_MODEL(h1, N * H_HID, m); HEAD_MODEL(W1, ps, m); HEAD_MODEL(b1, ps, m);
  }
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = blockIdx.y * G, count = min(G, N - n0);
  const int j = blockIdx.x * H_WARPS + warp;
  const float4* W14 = reinterpret_cast<const float4*>(W1);   // W1 starts on a 256-byte boundary
  const float4* x4 = reinterpret_cast<const float4*>(p2 + (size_t)n0 * H_IN);
  const float4 wa = __ldg(W14 + j * 64 + lane), wb = __ldg(W14 + j * 64 + 32 + lane);
  const float bj = __ldg(b1 + j);
  for (int g0 = 0; g0 < count; g0 += 8) {
    float4 xa[8], xb[8];
#pragma unroll
    for (int g = 0; g < 8; ++g)
      if (g0 + g < count) {
        xa[g] = __ldg(x4 + (g0 + g) * 64 + lane);
        xb[g] = __ldg(x4 + (g0 + g) * 64 + 32 + lane);
      }
#pragma unroll
    for (int g = 0; g < 8; ++g)
      if (g0 + g < count) {
        const float a = warp_sum(dot4(wb, xb[g], dot4(wa, xa[g], 0.f)));
        if (lane == 0) h1[(size_t)(n0 + g0 + g) * H_HID + j] = head_relu(a + bj);
      }
  }
}

// Slice s = blockIdx.y (G images from n0 = s G), dp2's inputs i0 = 32 blockIdx.x onward. Three uses:
//   labels given (a training step): logits, the loss and dlogits, dh1 and dp2
//   labels and dp2 null (logits only, grid (1, S)): the logits
//   labels null, dp2 given (a loss of the caller's: dlogits read): dh1 and dp2
// fc2: head_fc2 (head_common.cu); the loss: thread g < count runs sce_row on image g; then
//   dh1[n, j] = (W2[:, j] . dlogits[n]) * (h1[n, j] > 0)      thread e < count * 120, e = 120 g + j
//   dp2[n, i] = (W1[:, i] . dh1[n])     * (p2[n, i] > 0)      thread (warp w, lane l): i = i0 + l,
//                                                              images w and w + 8
// Shared: sw1 (120 x 32) W1's columns i0.., sw2 (10 x 120) W2, sh and sdh (G x 120) h1 and dh1, sl and
// sdl (G x 10) logits and dlogits.
extern "C" __global__ void __launch_bounds__(H_THREADS)
head_split_out_kernel(const float* __restrict__ p2, const float* __restrict__ W1, const float* __restrict__ W2,
                      const float* __restrict__ b2, const float* __restrict__ h1, float* __restrict__ logits,
                      int N, int G, const int* __restrict__ labels, float* __restrict__ dlogits,
                      float* __restrict__ out, int* __restrict__ correct, float* __restrict__ partial_loss,
                      int* __restrict__ partial_correct, float* __restrict__ running, float grad_scale, float loss_scale, float eps,
                      float* __restrict__ dh1, float* __restrict__ dp2 HEAD_PACK_PARAMS) {
  griddep_entry();
#ifdef LENET_PACK
  {   // model m = blockIdx.z (head_common.cu)
    const unsigned m = blockIdx.z;
    HEAD_MODEL(p2, N * H_IN, m); HEAD_MODEL(W1, ps, m); HEAD_MODEL(W2, ps, m); HEAD_MODEL(b2, ps, m);
    HEAD_MODEL(h1, N * H_HID, m); HEAD_MODEL(logits, N * H_OUT, m); HEAD_MODEL(labels, N, m);
    HEAD_MODEL(dlogits, N * H_OUT, m); HEAD_MODEL(out, 1, m); HEAD_MODEL(correct, 1, m);
    HEAD_MODEL(running, 1, m); HEAD_MODEL(partial_loss, gridDim.y, m);
    HEAD_MODEL(partial_correct, gridDim.y, m); HEAD_MODEL(dh1, N * H_HID, m); HEAD_MODEL(dp2, N * H_IN, m);
    if (eps_models) eps = eps_models[m];
  }
#endif
  __shared__ float sw1[H_HID * HS_COLS];
  __shared__ float sw2[H_OUT * H_HID];
  __shared__ float sh[HS_MAXG * H_HID];
  __shared__ float sdh[HS_MAXG * H_HID];
  __shared__ float sl[HS_MAXG * H_OUT];
  __shared__ float sdl[HS_MAXG * H_OUT];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int i0 = blockIdx.x * HS_COLS, n0 = blockIdx.y * G, count = min(G, N - n0);
  const bool first = blockIdx.x == 0, given = !labels;   // given: dlogits are read (or, without dp2, unused)
  if (dp2) {
#pragma unroll
    for (int k = 0; k < H_HID / H_WARPS; ++k) {
      const int j = warp + H_WARPS * k;
      sw1[j * HS_COLS + lane] = __ldg(W1 + j * H_IN + i0 + lane);
    }
  }
  for (int e = t; e < H_OUT * H_HID; e += H_THREADS) sw2[e] = __ldg(W2 + e);
  for (int e = t; e < count * H_HID; e += H_THREADS) sh[e] = __ldg(h1 + (size_t)n0 * H_HID + e);
  if (given && dp2 && t < count * H_OUT) sdl[t] = __ldg(dlogits + (size_t)n0 * H_OUT + t);
  const int i = i0 + lane, ga = warp, gb = warp + H_WARPS;
  const float pa = dp2 && ga < count ? __ldg(p2 + (size_t)(n0 + ga) * H_IN + i) : 0.f;
  const float pb = dp2 && gb < count ? __ldg(p2 + (size_t)(n0 + gb) * H_IN + i) : 0.f;
  __syncthreads();
  float loss = 0.f;
  int hits = 0;
  if (!given || !dp2) {
    head_fc2(sw2, sh, b2, sl, first ? logits + (size_t)n0 * H_OUT : nullptr, count);
    if (!dp2) return;   // the logits only
    __syncthreads();
    if (t < count) loss = sce_row(sl + t * H_OUT, nullptr, labels[n0 + t], H_OUT, eps, sdl + t * H_OUT, grad_scale, hits);
    __syncthreads();
    if (first && t < count * H_OUT) dlogits[(size_t)n0 * H_OUT + t] = sdl[t];
  }
  for (int e = t; e < count * H_HID; e += H_THREADS) {
    const int g = e / H_HID, k = e % H_HID;
    float a = 0.f;
#pragma unroll
    for (int c = 0; c < H_OUT; ++c) a = fmaf(sw2[c * H_HID + k], sdl[g * H_OUT + c], a);
    const float d = sh[e] > 0.f ? a : 0.f;
    sdh[e] = d;
    if (first) dh1[(size_t)n0 * H_HID + e] = d;
  }
  __syncthreads();
  if (ga < count) {
    float acc_a = 0.f, acc_b = 0.f;
    if (gb < count) {
#pragma unroll 8
      for (int k = 0; k < H_HID; ++k) {
        const float w = sw1[k * HS_COLS + lane];
        acc_a = fmaf(w, sdh[ga * H_HID + k], acc_a);
        acc_b = fmaf(w, sdh[gb * H_HID + k], acc_b);
      }
      dp2[(size_t)(n0 + gb) * H_IN + i] = pb > 0.f ? acc_b : 0.f;
    } else {
#pragma unroll 8
      for (int k = 0; k < H_HID; ++k) acc_a = fmaf(sw1[k * HS_COLS + lane], sdh[ga * H_HID + k], acc_a);
    }
    dp2[(size_t)(n0 + ga) * H_IN + i] = pa > 0.f ? acc_a : 0.f;
  }
  if (given || !first || warp != 0) return;   // the slice's loss: block 0's first warp, after its stores
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {   // block_sum's tree: the other threads' sums are 0
    loss += __shfl_down_sync(0xffffffffu, loss, o);
    hits += __shfl_down_sync(0xffffffffu, hits, o);
  }
  if (lane != 0) return;
  if (gridDim.y == 1) {   // one slice: its sums are the totals (as sce_finish_at's one part)
    out[0] = 0.f + loss * loss_scale;
    correct[0] = hits;
    if (running) running[0] += loss * loss_scale;
  } else {
    partial_loss[blockIdx.y] = loss;
    partial_correct[blockIdx.y] = hits;
  }
}

// Model m = blockIdx.x: its `parts` slices' sums (partial_*, m * parts on) added in slice order into out[m],
// correct[m] and running[m] (Note [the loss beside the step]; sce_finish_at's sum: lane j loads part b0 + j,
// lane 0 adds them in order). One warp a block.
extern "C" __global__ void __launch_bounds__(32)
head_split_loss_kernel(const float* __restrict__ partial_loss, const int* __restrict__ partial_correct, int parts,
                       float* __restrict__ out, int* __restrict__ correct, float* __restrict__ running,
                       float loss_scale) {
  griddep_entry();
  const int m = blockIdx.x, lane = threadIdx.x;
  partial_loss += (size_t)m * parts;
  partial_correct += (size_t)m * parts;
  float total = 0.f;
  int total_hits = 0;
  for (int b0 = 0; b0 < parts; b0 += 32) {
    const int b = b0 + lane, count = min(32, parts - b0);
    const float v = b < parts ? partial_loss[b] : 0.f;
    const int c = b < parts ? partial_correct[b] : 0;
    for (int j = 0; j < count; ++j) {
      total += __shfl_sync(0xffffffffu, v, j);
      total_hits += __shfl_sync(0xffffffffu, c, j);
    }
  }
  if (lane != 0) return;
  out[m] = 0.f + total * loss_scale;
  correct[m] = total_hits;
  if (running) running[m] += total * loss_scale;
}
