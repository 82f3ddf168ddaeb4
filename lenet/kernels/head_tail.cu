// module head_tail: uses=softmax_ce_row,head_common
// LeNet's head at large batches: fc1 and its two big products on cuBLASLt (lenet/kernels/head.py,
// HeadLaunches with a HeadShape of form "tail"), everything after fc1 here, in one pass over h1.
//
//   head_tail_kernel   warp per image: fc2 (the logits), in a training step the loss and dlogits, dh1
//                      (masked by h1 > 0), and the sums of db1, dW2 and db2 over the warp's images;
//                      a block's warps add theirs in warp order into the block's row of partial sums
//   head_mask_kernel   dx *= (x > 0), elementwise: the pooled input's ReLU mask on the data gradient
//
// Note [head tail]: on cuBLASLt the head is six matmuls, each with a bias, ReLU or bias-gradient
// epilogue, and the loss kernel between them: at large batches five times the time of the head's
// multiply-adds (ncu, scripts/profile_step.py; docs/kernels.md, "The head"). Everything but fc1, dW1 and dp2 touches 130 numbers an
// image (h1's 120, the 10 logits) and 1,330 weights that fit in a warp's registers: one pass over h1
// reads 480 bytes an image and writes dh1's 480, a tenth of the time of the six kernels it replaces. fc1 then runs with the plain bias + ReLU epilogue (h1 > 0 is the
// mask: no bits to keep), and dW1 with none (db1 is summed here).
//
// A block of 8 warps owns images 8 blockIdx.x .. 8 blockIdx.x + 7 of every 8 gridDim.x and row blockIdx.x
// of the partial sums (its shared sums[w] hold warp w's until they are added); a model of a pack is
// blockIdx.y. A warp owns image n = (8 blockIdx.x + warp) + 8 gridDim.x i, i = 0, 1, ...: lane l holds W2's columns
// j = l, l + 32, l + 64, l + 96 (< 120) for the 10 classes in registers, h1[n, j] and dh1[n, j] for
// its j, and its part of dW2[:, j] and db1[j]; lane c < 10 holds db2[c]. Each logit is a warp sum; the
// loss runs in every lane on the 10 logits (sce_row, softmax_ce_row.cu: the loss kernel's arithmetic).
// The block's row (width floats in the flat layout from fc1.bias: db1, then dW2 at off_w2 and db2 at
// off_b2, padding 0) sums its warps in warp order; stage_reduce adds the blocks' rows in block order, or
// a grid of one block writes the gradients themselves: a fixed grid sums in a fixed order.
//
// Modes as head_split_out_kernel's: labels given (a training step): logits, loss, dlogits, dh1, sums;
// labels and dh1 null: the logits only; labels null, dh1 given: dlogits read (a loss of the caller's).

#define HT_WARPS 8
#define HT_THREADS (HT_WARPS * 32)
#define HT_J 4                 // hidden units a lane owns (the last lanes own 3)
#define HT_WIDTH_MAX 1360      // the row's floats (db1 .. db2 with the flat layout's padding: 1354)

extern "C" __global__ void __launch_bounds__(HT_THREADS, 2)
head_tail_kernel(const float* __restrict__ h1, const float* __restrict__ W2, const float* __restrict__ b2,
                 float* __restrict__ logits, int N, const int* __restrict__ labels, float* __restrict__ dlogits,
                 float* __restrict__ out, int* __restrict__ correct, float* __restrict__ partial_loss,
                 int* __restrict__ partial_correct, unsigned int* __restrict__ ticket, float* __restrict__ running,
                 float grad_scale, float loss_scale, float eps, float* __restrict__ dh1, float* __restrict__ rows,
                 int width, int off_w2, int off_b2 HEAD_PACK_PARAMS) {
  griddep_entry();
#ifdef LENET_PACK
  {   // model m = blockIdx.y (head_common.cu): its rows (or its gradients) part_stride floats apart
    const unsigned m = blockIdx.y;
    HEAD_MODEL(h1, N * H_HID, m); HEAD_MODEL(W2, ps, m); HEAD_MODEL(b2, ps, m);
    HEAD_MODEL(logits, N * H_OUT, m); HEAD_MODEL(labels, N, m); HEAD_MODEL(dlogits, N * H_OUT, m);
    HEAD_MODEL(out, 1, m); HEAD_MODEL(correct, 1, m); HEAD_MODEL(running, 1, m); HEAD_MODEL(ticket, 1, m);
    HEAD_MODEL(partial_loss, gridDim.x, m); HEAD_MODEL(partial_correct, gridDim.x, m);
    HEAD_MODEL(dh1, N * H_HID, m); HEAD_MODEL(rows, part_stride, m);
    if (eps_models) eps = eps_models[m];
  }
#endif
  __shared__ float sums[HT_WARPS][HT_WIDTH_MAX];
  __shared__ float sv[HT_WARPS];
  __shared__ int sc[HT_WARPS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool train = labels != nullptr, grads = train || dh1 != nullptr;
  __shared__ float sb2[H_OUT];
  float w2[H_OUT][HT_J], dw2[H_OUT][HT_J], db1[HT_J], db2 = 0.f, loss = 0.f;
  int hits = 0;
#pragma unroll
  for (int c = 0; c < H_OUT; ++c) {
#pragma unroll
    for (int k = 0; k < HT_J; ++k) {
      const int j = lane + 32 * k;
      w2[c][k] = j < H_HID ? __ldg(W2 + c * H_HID + j) : 0.f;
      dw2[c][k] = 0.f;
    }
  }
#pragma unroll
  for (int k = 0; k < HT_J; ++k) db1[k] = 0.f;
  if (threadIdx.x < H_OUT) sb2[threadIdx.x] = __ldg(b2 + threadIdx.x);
  __syncthreads();
  const int stride = HT_WARPS * gridDim.x;
  auto fetch = [&](int n, float* h) {
#pragma unroll
    for (int k = 0; k < HT_J; ++k) {
      const int j = lane + 32 * k;
      h[k] = n < N && j < H_HID ? __ldg(h1 + (size_t)n * H_HID + j) : 0.f;
    }
  };
  float next[HT_J];
  int n = HT_WARPS * blockIdx.x + warp;
  fetch(n, next);
  for (; n < N; n += stride) {
    float h[HT_J], z[H_OUT], d[H_OUT];
#pragma unroll
    for (int k = 0; k < HT_J; ++k) h[k] = next[k];
    fetch(n + stride, next);   // the next image's loads in flight while this one is computed
    const int y = train ? __ldg(labels + n) : 0;
    const float given = !train && grads && lane < H_OUT ? __ldg(dlogits + (size_t)n * H_OUT + lane) : 0.f;
#pragma unroll
    for (int c = 0; c < H_OUT; ++c) {
      float a = 0.f;
#pragma unroll
      for (int k = 0; k < HT_J; ++k) a = fmaf(w2[c][k], h[k], a);
      z[c] = warp_sum(a) + sb2[c];
    }
    float zl = 0.f;   // lane c < 10: logit c (selected with constant indices: z stays in registers)
#pragma unroll
    for (int c = 0; c < H_OUT; ++c) zl = lane == c ? z[c] : zl;
    if (lane < H_OUT) logits[(size_t)n * H_OUT + lane] = zl;
    if (!grads) continue;
    if (train) {
      int hit;
      const float li = sce_row(z, nullptr, y, H_OUT, eps, d, grad_scale, hit);
      loss += li;   // every lane holds the same; lane 0's is the warp's
      hits += hit;
    } else {
#pragma unroll
      for (int c = 0; c < H_OUT; ++c) d[c] = __shfl_sync(0xffffffffu, given, c);
    }
    float dl = 0.f;
#pragma unroll
    for (int c = 0; c < H_OUT; ++c) dl = lane == c ? d[c] : dl;
    if (train && lane < H_OUT) dlogits[(size_t)n * H_OUT + lane] = dl;
    db2 += dl;
#pragma unroll
    for (int k = 0; k < HT_J; ++k) {
      const int j = lane + 32 * k;
      float a = 0.f;
#pragma unroll
      for (int c = 0; c < H_OUT; ++c) a = fmaf(w2[c][k], d[c], a);
      const float g = h[k] > 0.f ? a : 0.f;
      if (j < H_HID) dh1[(size_t)n * H_HID + j] = g;
      db1[k] += g;
#pragma unroll
      for (int c = 0; c < H_OUT; ++c) dw2[c][k] = fmaf(d[c], h[k], dw2[c][k]);
    }
  }
  if (!grads) return;
  __syncthreads();   // every warp's reads of the loop done before any writes of the block's row
  // The block's row: each warp's sums into sums[warp], then column i adds the warps in order.
  float* mine = sums[warp];
  for (int i = lane; i < width; i += 32) mine[i] = 0.f;   // padding columns stay 0
  __syncwarp();
#pragma unroll
  for (int k = 0; k < HT_J; ++k) {
    const int j = lane + 32 * k;
    if (j < H_HID) {
      mine[j] = db1[k];
#pragma unroll
      for (int c = 0; c < H_OUT; ++c) mine[off_w2 + c * H_HID + j] = dw2[c][k];
    }
  }
  if (lane < H_OUT) mine[off_b2 + lane] = db2;
  if (lane == 0) { sv[warp] = loss; sc[warp] = hits; }
  __syncthreads();
  float* row = gridDim.x == 1 ? rows : rows + (size_t)blockIdx.x * width;
  for (int i = threadIdx.x; i < width; i += HT_THREADS) {
    float a = sums[0][i];
#pragma unroll
    for (int w = 1; w < HT_WARPS; ++w) a += sums[w][i];
    row[i] = a;
  }
  if (!train) return;
  float total = sv[0];
  int total_hits = sc[0];
#pragma unroll
  for (int w = 1; w < HT_WARPS; ++w) { total += sv[w]; total_hits += sc[w]; }
  sce_finish_at(total, total_hits, blockIdx.x, gridDim.x, partial_loss, partial_correct, ticket, out, correct,
                running, loss_scale, 0);
}

// dx[i] = x[i] > 0 ? dx[i] : 0 over count floats (count a multiple of 4: rows of 256), four at a time:
// thread t of block b owns the float4s b 256 + t + 256 gridDim.x k, k = 0, 1, ... (nothing shared).
extern "C" __global__ void __launch_bounds__(256)
head_mask_kernel(const float* __restrict__ x, float* __restrict__ dx, long long count) {
  griddep_entry();
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float4* d4 = reinterpret_cast<float4*>(dx);
  for (long long i = blockIdx.x * 256ll + threadIdx.x; i < count / 4; i += 256ll * gridDim.x) {
    const float4 a = __ldg(x4 + i);
    float4 g = d4[i];
    g.x = a.x > 0.f ? g.x : 0.f;
    g.y = a.y > 0.f ? g.y : 0.f;
    g.z = a.z > 0.f ? g.z : 0.f;
    g.w = a.w > 0.f ? g.w : 0.f;
    d4[i] = g;
  }
}
