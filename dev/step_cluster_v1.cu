// module step_cluster_v1: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common define=SC_PROFILE smem=24880
// The whole step as it shipped before Note [four barriers] (lenet/kernels/step_cluster.cu): the head split
// by hidden units (rank r fc1's units 15 r .. 15 r + 14), every image's p2 gathered to every block, dp2 summed
// over the ranks' parts, and the convolutions' gradients redistributed over the ranks before the update:
// seven cluster barriers a step. Kept as the workbench's baseline (dev/step_cluster.py --variants
// step_cluster step_cluster_v1); its numbers against the shipped form are in docs/kernels.md, "The whole step".
// Its SC_MAXG (images a cluster) and SC_DX_ROUTED (dp1 through the argmax bytes) forms lost to one image a
// cluster and the dense dp1 (the same section).
// A whole training step of one LeNet (forward, softmax cross-entropy, backward, SGD) at small batches as
// one launch of thread-block clusters (sm_90 and newer), or two above one image: our engine's candidate for
// the step (lenet/engines/ours_step.py, launcher lenet/kernels/step.py), timed by the planner against the
// chain of launches and checked against its result (Note [a whole step] in lenet/steps.py). dev/step_cluster.cu
// declares the variants the workbench times (dev/step_cluster.py; docs/kernels.md, "The whole step").
//
// Note [a step in one cluster]: at 1 to about 12 images the chain's kernels are short and its time is their
// latencies: each waits for the last's writes through L2 and loads its weights from there again
// (docs/performance.md, "Where a step's time goes"). Here a cluster of SC_RANKS blocks holds up to
// SC_MAXG images; every weight is copied once, at the start, into the blocks' shared memory, and the
// blocks exchange activations through distributed shared memory and meet at cluster barriers, which stay
// on the chip. A batch of more than SC_MAXG images runs as several clusters, each writing its sums of the
// weight gradients (one row of `part` a cluster); step_cluster_update_kernel adds the rows in cluster
// order and runs the update. One cluster runs the update itself: one launch a step. One image a cluster
// (SC_MAXG 1, eight blocks an image) ships: it was the fastest where the step is offered (docs/kernels.md,
// "The whole step", with the forms that lost).
//
// What a block owns. Cluster c holds images n0 = c SC_MAXG .. n0 + nc - 1. Image g of them is worked by GS =
// SC_RANKS / P blocks (P: nc rounded up to a power of two), ranks g GS .. g GS + GS - 1; member `sub` of them
// owns conv1's channels c = sub (mod GS) and conv2's k = sub (mod GS) of that image, forward and backward,
// and their weights' gradients for it. A rank g >= nc holds no image (`has` false) and works on the head
// only. The head is split by hidden units: rank r owns fc1's units 15 r .. 15 r + 14 for every image of the
// cluster (W1's rows and b1's entries, fc2's columns), and rank 0 fc2's biases. After the barrier of phase 6,
// rank r owns the convolutions' gradients e = r (mod SC_RANKS) (conv2's 2416, then conv1's 156): it adds
// them over the cluster's images and updates those parameters.
//
// What a thread owns, phase by phase (t: the thread, 0 .. SC_THREADS - 1; "items" are spread over the
// block's threads t, t + SC_THREADS, ...):
//   loads   16-byte copies: the image's 196 float4s (t < 196), conv2's weights, W1's own rows, W2
//   1 conv1 forward (own channels) -> p1, argmax bytes: items (channel, pooled position, q), q the window's
//     position a thread computes; lanes 4m .. 4m + 3 are one window, lane 4m stores it
//                                                            | barrier | p1's other channels gathered
//   2 conv2 forward (own channels) -> p2: items as in 1      | barrier | every image's p2 gathered
//   3 fc1 (own units, every image) -> h1: a warp an (image, unit), lane l the inputs l, l + 32, ...
//                                                            | barrier | h1's other units gathered
//   4 fc2 (a warp an (image, class)), the loss and dlogits (thread g < nc image g; every block, every image);
//     dh1 (items (image, own unit)); thread t < 256 input t of fc1: dW1's column t for the own units and dp2's
//     part for every image; thread t < 175 one more of the head's gradients (fc2's column entries t < 150,
//     the own units' fc1 biases, fc2's biases on rank 0)  | barrier
//   5 dp2 (own channels: the ranks' parts in rank order, masked by the ReLU bit; items (channel, position));
//     conv2's dW (items (channel, weight)), db (thread t < nk); dp1's part over own channels (items (input
//     channel, position); conv2's output gradient laid out dense and padded, 25 multiply-adds a channel)
//                                                            | barrier
//   6 dp1 (own channels: the image's members' parts in order; items (channel, position)); conv1's dW and db:
//     items (channel, weight, eighth of the positions), then (channel, weight) adds the eighths | barrier
//   7 thread t: the convolutions' gradients e = rank + SC_RANKS (t + SC_THREADS q), q = 0, 1, added over the
//     images into grads (one cluster: then updated) or the cluster's row of `part`; with one cluster, the
//     update of its fc1 column and its one more head parameter, whose gradients phase 4 wrote
// Sums are in fixed orders: no atomics, the same bits every run. The argmax and ReLU bits are
// stage_common.cu's (Note [stage backward through the argmax], Note [the ReLU bit]).

#ifndef SC_THREADS
#define SC_THREADS 512   // at least 256: thread i < 256 owns input i of fc1 in the head's gradients
#endif
#ifndef SC_MAXG
#define SC_MAXG 1       // images a cluster (1, 2, 4 or 8)
#endif
#define SC_UNITS 15     // fc1's units a block: H_HID / SC_RANKS

#define CONV_GRADS 2572   // conv2's 2400 + 16, then conv1's 150 + 6

// Shared memory, in floats (dynamic): see the carving in step_cluster_kernel.
#define SC_SMEM_FLOATS 24880   // 4096 of them conv2's output gradients, dense and padded (but SC_DX_ROUTED)

// The update of the convolutions' gradient e (0 .. CONV_GRADS): its parameter index and its channel (conv2's k
// below 2416, conv1's c above), whose owner among an image's GS blocks is channel % GS.
__device__ __forceinline__ int sc_conv_param(int e, int& channel) {
  if (e < 2400) { channel = e / 150; return OFF_C2W + e; }
  if (e < 2416) { channel = e - 2400; return OFF_C2B + channel; }
  if (e < 2566) { channel = (e - 2416) / 25; return OFF_C1W + e - 2416; }
  channel = e - 2566;
  return OFF_C1B + channel;
}

// x (N, 1, 28, 28), labels (N,); params, grads, velocity, ema: the flat buffers (lenet/params.py); lr[0];
// logits (N, 10) written as the chain's forward writes them. prof: null, or the workbench's (SC_PROFILE). With
// one cluster (gridDim.x == SC_RANKS): the step's gradients into grads, the update, and the loss into out,
// correct, running (lenet/kernels/softmax_ce_row.cu's totals). With more: cluster c's sums into row c of part
// (PARAMS_TOTAL floats a row, zero where no parameter is) and part_loss[c], part_correct[c]; then
// step_cluster_update_kernel.
extern "C" __global__ void __cluster_dims__(SC_RANKS, 1, 1) __launch_bounds__(SC_THREADS)
step_cluster_kernel(const float* __restrict__ x, const int* __restrict__ labels, int N, float* __restrict__ params,
                    float* __restrict__ grads, float* __restrict__ velocity, float* __restrict__ ema,
                    const float* __restrict__ lr, float momentum, float weight_decay, int nesterov, float ema_weight,
                    float eps, float grad_scale, float loss_scale, float* __restrict__ out, int* __restrict__ correct,
                    float* __restrict__ running, float* __restrict__ part, float* __restrict__ part_loss,
                    int* __restrict__ part_correct, float* __restrict__ logits, unsigned long long* __restrict__ prof) {
  griddep_entry();
#ifdef SC_EMPTY   // the workbench's launch floor: this launch's shape (cluster, threads, shared memory), no work
  return;
#endif
  extern __shared__ float4 sm4[];
  float* const sm = reinterpret_cast<float*>(sm4);
  float* const sx = sm;                  // 784: image g
  float* const sp1 = sx + 784;           // 864: image g's p1 (own channels, then all)
  float* const swc1 = sp1 + 864;         // 160: conv1's 150 weights, 6 biases
  float* const swc2 = swc1 + 160;        // 2416: conv2's 2400 weights, 16 biases
  float* const sp2 = swc2 + 2416;        // 8 x 256: every image's p2
  float* const sW1 = sp2 + 2048;         // 15 x 256: W1's own rows
  float* const sb1 = sW1 + 3840;         // 16
  float* const sb2 = sb1 + 16;           // 16
  float* const sW2 = sb2 + 16;           // 1200
  float* const sh1 = sW2 + 1200;         // 8 x 120: every image's h1
  float* const sl = sh1 + 960;           // 8 x 10 logits
  float* const sdl = sl + 80;            // 8 x 10 dlogits
  float* const sdh = sdl + 80;           // 8 x 16: dh1 of own units
  float* const sdp2part = sdh + 128;     // 8 x 256: dp2 over own units
  float* const sdp2 = sdp2part + 2048;   // 256: image g's dp2 (own channels), masked
  float* const sdp1part = sdp2 + 256;    // 864: image g's dp1 over own conv2 channels
  float* const sdp1 = sdp1part + 864;    // 864: image g's dp1 (own conv1 channels), masked
  float* const sgc = sdp1 + 864;         // 2576: image g's conv gradients (own channels; CONV_GRADS order)
  float* const sscr = sgc + 2576;        // 1280: conv1's gradient in parts
  float* const sloss = sscr + 1280;      // 8
  int* const shits = reinterpret_cast<int*>(sloss + 8);   // 8
  int* const slab = shits + 8;                            // 8
  unsigned char* const sa1 = reinterpret_cast<unsigned char*>(slab + 8);   // 864: image g's conv1 argmax bytes
  unsigned char* const sa2 = sa1 + 864;                                    // 256: conv2's

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const unsigned rank = sc_rank();
  const int cl = blockIdx.x / SC_RANKS, clusters = gridDim.x / SC_RANKS;
  const int n0 = cl * SC_MAXG, nc = min(SC_MAXG, N - n0);
  const int P = nc <= 1 ? 1 : nc <= 2 ? 2 : nc <= 4 ? 4 : 8;
  const int GS = SC_RANKS / P, g = rank / GS, sub = rank % GS;
  const bool has = g < nc;
  const int nch1 = has ? (6 - sub + GS - 1) / GS : 0;   // own conv1 channels: sub, sub + GS, ...
  const int nk = has ? 16 / GS : 0;                     // own conv2 channels
  const bool alone = clusters == 1;
  SC_MARK(0);
  float* const dst = alone ? grads : part + (size_t)cl * PARAMS_TOTAL;

  // ---- loads: the image, every weight this block reads (copies in flight, in two groups: what conv1 reads,
  // then the rest, waited for before conv2); the momentum this block's update will need (registers, used last)
  if (has && t < 196) sc_copy<16>(sx + 4 * t, x + (size_t)(n0 + g) * 784 + 4 * t);
  for (int i = t; i < 156; i += SC_THREADS) sc_copy<4>(swc1 + i, params + (i < 150 ? OFF_C1W + i : OFF_C1B + i - 150));
  sc_copies_sent();
  for (int i = t; i < 600; i += SC_THREADS) sc_copy<16>(swc2 + 4 * i, params + OFF_C2W + 4 * i);
  if (t < 4) sc_copy<16>(swc2 + 2400 + 4 * t, params + OFF_C2B + 4 * t);
  for (int i = t; i < SC_UNITS * 64; i += SC_THREADS)
    sc_copy<16>(sW1 + 4 * i, params + OFF_F1W + (size_t)rank * SC_UNITS * 256 + 4 * i);
  if (t < SC_UNITS) sc_copy<4>(sb1 + t, params + OFF_F1B + SC_UNITS * rank + t);
  if (t < 10) sc_copy<4>(sb2 + t, params + OFF_F2B + t);
  for (int i = t; i < 300; i += SC_THREADS) sc_copy<16>(sW2 + 4 * i, params + OFF_F2W + 4 * i);
  sc_copies_sent();
  if (t < nc) slab[t] = labels[n0 + t];
  // The head's parameter of thread t < 175 (fc2's column entries, fc1's biases, fc2's biases on rank 0).
  int hidx = -1;
  if (t < 150) hidx = OFF_F2W + (t / SC_UNITS) * 120 + SC_UNITS * rank + t % SC_UNITS;
  else if (t < 165) hidx = OFF_F1B + SC_UNITS * rank + (t - 150);
  else if (t < 175 && rank == 0) hidx = OFF_F2B + (t - 165);
  float vw1[SC_UNITS], vh = 0.f, ph = 0.f, vc[2] = {0.f, 0.f};
  if (alone) {
#pragma unroll
    for (int j = 0; j < SC_UNITS; ++j)
      vw1[j] = momentum != 0.f && t < 256 ? velocity[OFF_F1W + (SC_UNITS * rank + j) * 256 + t] : 0.f;
    if (hidx >= 0) {
      ph = params[hidx];
      if (momentum != 0.f) vh = velocity[hidx];
    }
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int e = rank + SC_RANKS * (t + SC_THREADS * q);
      int ch;
      if (e < CONV_GRADS && momentum != 0.f) vc[q] = velocity[sc_conv_param(e, ch)];
    }
  }
  sc_copies_wait<1>();   // the image and conv1's weights
  __syncthreads();
#ifdef SC_EXTRA_SYNCS   // the workbench's measure of a cluster barrier: the loads' phase with this many more
  for (int i = 0; i < SC_EXTRA_SYNCS; ++i) {
#ifdef SC_RELAXED   // a barrier that orders no memory
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
#else
    sc_sync();
#endif
  }
#endif
  SC_MARK(1);

  // ---- 1: conv1's forward, own channels: items (channel, pooled position, q), a quad of lanes a window
  if (has) {
    const int total = nch1 * 576;
    for (int base = 0; base < total; base += SC_THREADS) {
      const int item = base + t, ci = item / 576, rem = item % 576, pos = rem >> 2, q = rem & 3;
      const bool valid = item < total;
      const int c = sub + GS * ci;
      float a = 0.f;
      if (valid) {
        const int oy = 2 * (pos / 12) + (q >> 1), ox = 2 * (pos % 12) + (q & 1);
        a = swc1[150 + c];
#pragma unroll
        for (int r = 0; r < 5; ++r)
#pragma unroll
          for (int s = 0; s < 5; ++s) a = fmaf(sx[(oy + r) * 28 + ox + s], swc1[c * 25 + r * 5 + s], a);
      }
      int arg;
      const float best = sc_quad_max(a, arg);
      if (valid && q == 0) {
        sp1[c * 144 + pos] = relu_keep_nan(best);
        sa1[c * 144 + pos] = arg_byte(arg, best);
      }
    }
  }
  sc_copies_wait<0>();   // every weight (each thread its own copies; the barrier makes them everyone's)
  sc_sync();
  if (has && GS > 1)
    for (int i = t; i < 864; i += SC_THREADS) {
      const int c = i / 144;
      if (c % GS != sub) sp1[i] = sc_at(sp1, g * GS + c % GS)[i];
    }
  __syncthreads();
  SC_MARK(2);

  // ---- 2: conv2's forward, own channels: items (channel, pooled position, q)
  if (has) {
    const int total = nk * 64;
    for (int base = 0; base < total; base += SC_THREADS) {
      const int item = base + t, ki = item / 64, rem = item % 64, pos = rem >> 2, q = rem & 3;
      const bool valid = item < total;
      const int k = sub + GS * ki;
      float a = 0.f;
      if (valid) {
        const int oy = 2 * (pos / 4) + (q >> 1), ox = 2 * (pos % 4) + (q & 1);
        float b = 0.f;   // two chains of sums (channels 0-2 and 3-5): half the dependent latency
        a = swc2[2400 + k];
        for (int c = 0; c < 3; ++c)
#pragma unroll
          for (int r = 0; r < 5; ++r)
#pragma unroll
            for (int s = 0; s < 5; ++s) {
              a = fmaf(sp1[c * 144 + (oy + r) * 12 + ox + s], swc2[k * 150 + c * 25 + r * 5 + s], a);
              b = fmaf(sp1[(c + 3) * 144 + (oy + r) * 12 + ox + s], swc2[k * 150 + (c + 3) * 25 + r * 5 + s], b);
            }
        a += b;
      }
      int arg;
      const float best = sc_quad_max(a, arg);
      if (valid && q == 0) {
        sp2[g * 256 + k * 16 + pos] = relu_keep_nan(best);
        sa2[k * 16 + pos] = arg_byte(arg, best);
      }
    }
  }
  sc_sync();
  for (int i = t; i < nc * 256; i += SC_THREADS) {
    const int gg = i >> 8, k = (i & 255) >> 4, owner = gg * GS + k % GS;
    if (owner != (int)rank) sp2[i] = sc_at(sp2, owner)[i];
  }
  __syncthreads();
  SC_MARK(3);

  // ---- 3: fc1 + ReLU, own units, every image: a warp a (image, unit)
  for (int d = warp; d < nc * SC_UNITS; d += SC_THREADS / 32) {
    const int gg = d / SC_UNITS, j = d % SC_UNITS;
    float a = 0.f;
#pragma unroll
    for (int i = lane; i < 256; i += 32) a = fmaf(sW1[j * 256 + i], sp2[gg * 256 + i], a);
    a = warp_sum(a);
    if (lane == 0) sh1[gg * 120 + SC_UNITS * rank + j] = head_relu(a + sb1[j]);
  }
  sc_sync();
  for (int i = t; i < nc * 120; i += SC_THREADS) {
    const int owner = (i % 120) / SC_UNITS;
    if (owner != (int)rank) sh1[i] = sc_at(sh1, owner)[i];
  }
  __syncthreads();
  SC_MARK(4);

  // ---- 4: fc2, the loss and dlogits (every block, every image); the head's gradients of own units
  for (int d = warp; d < nc * 10; d += SC_THREADS / 32) {
    const int gg = d / 10, c = d % 10;
    float a = 0.f;
    for (int j = lane; j < 120; j += 32) a = fmaf(sW2[c * 120 + j], sh1[gg * 120 + j], a);
    a = warp_sum(a);
    if (lane == 0) {
      sl[gg * 10 + c] = a + sb2[c];
      if (rank == 0) logits[(size_t)(n0 + gg) * 10 + c] = a + sb2[c];
    }
  }
  __syncthreads();
  if (t < nc) {
    int hit;
    sloss[t] = sce_row(sl + t * 10, nullptr, slab[t], 10, eps, sdl + t * 10, grad_scale, hit);
    shits[t] = hit;
  }
  __syncthreads();
  for (int e = t; e < nc * SC_UNITS; e += SC_THREADS) {
    const int gg = e / SC_UNITS, j = e % SC_UNITS, u = SC_UNITS * rank + j;
    float a = 0.f;
#pragma unroll
    for (int c = 0; c < 10; ++c) a = fmaf(sW2[c * 120 + u], sdl[gg * 10 + c], a);
    sdh[gg * 16 + j] = sh1[gg * 120 + u] > 0.f ? a : 0.f;
  }
  __syncthreads();
  float gw1[SC_UNITS];
#pragma unroll
  for (int j = 0; j < SC_UNITS; ++j) gw1[j] = 0.f;
  if (t < 256)
    for (int gg = 0; gg < nc; ++gg) {
      const float xi = sp2[gg * 256 + t];
      float a = 0.f;
#pragma unroll
      for (int j = 0; j < SC_UNITS; ++j) {
        const float dh = sdh[gg * 16 + j];
        a = fmaf(sW1[j * 256 + t], dh, a);
        gw1[j] = fmaf(dh, xi, gw1[j]);
      }
      sdp2part[gg * 256 + t] = a;
    }
  float gh = 0.f;
  if (t < 150) {
    const int c = t / SC_UNITS, u = SC_UNITS * rank + t % SC_UNITS;
    for (int gg = 0; gg < nc; ++gg) gh = fmaf(sdl[gg * 10 + c], sh1[gg * 120 + u], gh);
  } else if (t < 165) {
    for (int gg = 0; gg < nc; ++gg) gh += sdh[gg * 16 + t - 150];
  } else if (t < 175 && rank == 0) {
    for (int gg = 0; gg < nc; ++gg) gh += sdl[gg * 10 + t - 165];
  }
  if (t < 256)
#pragma unroll
    for (int j = 0; j < SC_UNITS; ++j) dst[OFF_F1W + (SC_UNITS * rank + j) * 256 + t] = gw1[j];
  if (hidx >= 0) dst[hidx] = gh;
  sc_sync();
  SC_MARK(5);

  // ---- 5: dp2 of own channels (the ranks' parts in rank order, masked); conv2's gradients; dp1's part
  if (has)
    for (int e = t; e < nk * 16; e += SC_THREADS) {
      const int k = sub + GS * (e >> 4), i = k * 16 + (e & 15);
      float a = 0.f;
#pragma unroll
      for (int r = 0; r < SC_RANKS; ++r) a += sc_at(sdp2part, r)[g * 256 + i];
      sdp2[i] = arg_g(sa2[i], a);
    }
  __syncthreads();
  if (has) {
    for (int e = t; e < nk * 150; e += SC_THREADS) {
      const int k = sub + GS * (e / 150), rem = e % 150, c = rem / 25, r = rem % 25 / 5, s = rem % 5;
      float a = 0.f;
#pragma unroll
      for (int pos = 0; pos < 16; ++pos) {
        const int q = arg_q(sa2[k * 16 + pos]);
        const int oy = 2 * (pos >> 2) + (q >> 1), ox = 2 * (pos & 3) + (q & 1);
        a = fmaf(sdp2[k * 16 + pos], sp1[c * 144 + (oy + r) * 12 + ox + s], a);
      }
      sgc[k * 150 + rem] = a;
    }
    if (t < nk) {
      const int k = sub + GS * t;
      float a = 0.f;
#pragma unroll
      for (int pos = 0; pos < 16; ++pos) a += sdp2[k * 16 + pos];
      sgc[2400 + k] = a;
    }
#ifndef SC_DX_ROUTED
    float* const sdc = sm + SC_SMEM_FLOATS - 4096;   // nk x 16 x 16: conv2's output gradient at (oy + 4, ox + 4), else 0
    for (int e = t; e < nk * 256; e += SC_THREADS) sdc[e] = 0.f;
    __syncthreads();
    for (int e = t; e < nk * 16; e += SC_THREADS) {
      const int k = sub + GS * (e >> 4), pos = e & 15, q = arg_q(sa2[k * 16 + pos]);
      const int oy = 2 * (pos >> 2) + (q >> 1), ox = 2 * (pos & 3) + (q & 1);
      sdc[(e >> 4) * 256 + (oy + 4) * 16 + ox + 4] = sdp2[k * 16 + pos];
    }
    __syncthreads();
    for (int e = t; e < 864; e += SC_THREADS) {
      const int c = e / 144, yy = e % 144 / 12, xx = e % 12;
      float a = 0.f;
      for (int ki = 0; ki < nk; ++ki) {
        const float* w = swc2 + (sub + GS * ki) * 150 + c * 25;
        const float* d = sdc + ki * 256 + (yy + 4) * 16 + xx + 4;
#pragma unroll
        for (int r = 0; r < 5; ++r)
#pragma unroll
          for (int s = 0; s < 5; ++s) a = fmaf(d[-r * 16 - s], w[r * 5 + s], a);
      }
      sdp1part[e] = a;
    }
#else
    for (int e = t; e < 864; e += SC_THREADS) {
      const int c = e / 144, yy = e % 144 / 12, xx = e % 12;
      const int pi0 = max(0, (yy - 5) / 2), pi1 = min(3, yy / 2), pj0 = max(0, (xx - 5) / 2), pj1 = min(3, xx / 2);
      float a = 0.f;
      for (int ki = 0; ki < nk; ++ki) {
        const int k = sub + GS * ki;
        for (int pi = pi0; pi <= pi1; ++pi)
          for (int pj = pj0; pj <= pj1; ++pj) {
            const int pos = pi * 4 + pj, q = arg_q(sa2[k * 16 + pos]);
            const int r = yy - 2 * pi - (q >> 1), s = xx - 2 * pj - (q & 1);
            if (r >= 0 && r < 5 && s >= 0 && s < 5) a = fmaf(sdp2[k * 16 + pos], swc2[k * 150 + c * 25 + r * 5 + s], a);
          }
      }
      sdp1part[e] = a;
    }
#endif
  }
  sc_sync();
  SC_MARK(6);

  // ---- 6: dp1 of own conv1 channels (the image's members' parts in order, masked); conv1's gradients
  if (has) {
    for (int e = t; e < nch1 * 144; e += SC_THREADS) {
      const int i = (sub + GS * (e / 144)) * 144 + e % 144;
      float a = 0.f;
      for (int m = 0; m < GS; ++m) a += sc_at(sdp1part, g * GS + m)[i];
      sdp1[i] = arg_g(sa1[i], a);
    }
    __syncthreads();
    for (int e = t; e < nch1 * 200; e += SC_THREADS) {   // (channel, weight, eighth of the positions)
      const int c = sub + GS * (e / 200), rem = e % 200, rs = rem >> 3, seg = rem & 7, r = rs / 5, s = rs % 5;
      float a = 0.f;
      for (int pos = seg * 18; pos < seg * 18 + 18; ++pos) {
        const int q = arg_q(sa1[c * 144 + pos]);
        const int oy = 2 * (pos / 12) + (q >> 1), ox = 2 * (pos % 12) + (q & 1);
        a = fmaf(sdp1[c * 144 + pos], sx[(oy + r) * 28 + ox + s], a);
      }
      sscr[e] = a;
    }
    for (int e = t; e < nch1 * 8; e += SC_THREADS) {
      const int c = sub + GS * (e >> 3), seg = e & 7;
      float a = 0.f;
      for (int pos = seg * 18; pos < seg * 18 + 18; ++pos) a += sdp1[c * 144 + pos];
      sscr[1200 + e] = a;
    }
    __syncthreads();
    for (int e = t; e < nch1 * 26; e += SC_THREADS) {
      const int ci = e / 26, rs = e % 26, c = sub + GS * ci;
      float a = 0.f;
#pragma unroll
      for (int seg = 0; seg < 8; ++seg) a += rs < 25 ? sscr[ci * 200 + rs * 8 + seg] : sscr[1200 + ci * 8 + seg];
      sgc[2416 + (rs < 25 ? c * 25 + rs : 150 + c)] = a;
    }
  }
  sc_sync();
  SC_MARK(7);

  // ---- 7: the convolutions' gradients over the cluster's images, in image order; the update
  const float rate = alone ? lr[0] : 0.f;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int e = rank + SC_RANKS * (t + SC_THREADS * q);
    if (e < CONV_GRADS) {
      int ch;
      const int i = sc_conv_param(e, ch);
      float a = 0.f;
      for (int gg = 0; gg < nc; ++gg) a += sc_at(sgc, gg * GS + ch % GS)[e];
      dst[i] = a;
      if (alone) {
        const float pold = e < 2416 ? swc2[e] : swc1[e - 2416];
        float v = vc[q];
        const float pnew = sgd_rule(pold, a, v, momentum, weight_decay, nesterov, rate);
        sc_store(params, velocity, ema, i, pnew, v, momentum, ema_weight);
      }
    }
  }
  if (alone && t < 256) {
#pragma unroll
    for (int j = 0; j < SC_UNITS; ++j) {
      const int i = OFF_F1W + (SC_UNITS * rank + j) * 256 + t;
      float v = vw1[j];
      const float pnew = sgd_rule(sW1[j * 256 + t], gw1[j], v, momentum, weight_decay, nesterov, rate);
      sc_store(params, velocity, ema, i, pnew, v, momentum, ema_weight);
    }
  }
  if (alone) {
    if (hidx >= 0) {
      float v = vh;
      const float pnew = sgd_rule(ph, gh, v, momentum, weight_decay, nesterov, rate);
      sc_store(params, velocity, ema, hidx, pnew, v, momentum, ema_weight);
    }
  }
  if (rank == 0 && t == 0) {
    float total = 0.f;
    int hits = 0;
    for (int gg = 0; gg < nc; ++gg) { total += sloss[gg]; hits += shits[gg]; }
    if (alone) {
      out[0] = total * loss_scale;
      correct[0] = hits;
      if (running) running[0] += total * loss_scale;
    } else {
      part_loss[cl] = total;
      part_correct[cl] = hits;
    }
  }
  SC_MARK(8);
  sc_sync();   // no block leaves while another may still read its shared memory
}
