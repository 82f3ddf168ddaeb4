// module step_cluster: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common smem=11004
// module step_cluster_t256: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common define=SC_THREADS=256 smem=11004
// module step_cluster_g2: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common define=SC_MAXG=2 smem=15944
// module step_cluster_g2_t256: arch=90 uses=stage_common,softmax_ce_row,head_common,sgd_rule,step_common define=SC_MAXG=2 define=SC_THREADS=256 smem=15944
// A whole training step of one LeNet (forward, softmax cross-entropy, backward, SGD) at small batches as
// one launch of thread-block clusters (sm_90 and newer), or two above one cluster: our engine's candidates for
// the step, four forms declared above (lenet/engines/ours_step.py; launcher and the batch sizes each is offered
// at: lenet/kernels/step.py, Note [the whole step's batch sizes]), timed by the planner against the
// chain of launches and checked against its result (Note [a whole step] in lenet/steps.py). dev/step_cluster.cu
// declares the variants the workbench times (dev/step_cluster.py; docs/kernels.md, "The whole step").
//
// Note [a step in one cluster]: at 1 to a few dozen images the chain's kernels are short and its time is their
// latencies: each waits for the last's writes through L2 and loads its weights from there again
// (docs/performance.md, "Where a step's time goes"). Here a cluster of SC_RANKS blocks holds SC_MAXG images
// (1 or 2 in the forms that ship); the weights a block reads are copied once, at the start, into its shared
// memory, and the blocks exchange partial results through distributed shared memory and meet at cluster
// barriers, which stay on the chip. A block's phases below run over its images' items, and each gradient is
// summed over the images in image order. A larger batch runs as several clusters, each writing its gradients
// to a row of its own (`part`); step_cluster_update_kernel adds the rows in cluster order and runs the update.
// One cluster runs the update itself: one launch a step. A cluster's last images past the batch are zeros
// whose loss's gradient is zero: they add nothing.
//
// Note [four barriers]: a cluster barrier with the gather after it costs about 1 us before any arithmetic
// (docs/kernels.md, "The whole step"), so a block owns its part of the network along the input channels of
// the head, which its convolution channels make, and not along its hidden units: rank r owns conv1's channel
// r (r < 6) and conv2's channels r and r + 8, whose 32 pooled outputs are 32 of fc1's 256 inputs; it holds
// fc1's weights of those inputs (W1's 120 x 32 columns), sums fc1 over them for every unit, and the ranks'
// partial sums, added in rank order, make h1 in every block. Every block then has what the head's backward
// needs for its own inputs (dh1 over every unit, its columns of W1): dp2 of its own channels, and the
// gradients of its columns, with no exchange. Four barriers a step: p1's channels, fc1's partial sums, dp1's
// parts (each rank's conv2 channels give a part of every conv1 channel's), and the last, before which no
// block leaves (another may still read its shared memory).
//
// What a thread owns, phase by phase (t: the thread, 0 .. SC_THREADS - 1; "items" are spread over the
// block's threads t, t + SC_THREADS, ..., each item of one image where the phase runs over images):
//   loads   copies in flight (cp.async): the image and conv1's weights, then conv2's weights of the own
//           channels, W1's own columns, fc1's biases, W2, fc2's biases; the momentum of each parameter this
//           thread will update, the head's other parameters' values, the learning rate (registers, used last)
//   1 conv1 forward (own channel) -> p1, argmax bytes: a thread a pooling window, its four sums from one
//     load of its 6 x 6 inputs (sc_window)                               | barrier | p1's other channels gathered
//   2 conv2 forward (own channels): items (input channel, own channel, window), then items (own channel,
//     window, q) add the input channels in pairs and pool (a quad of lanes a window); fc1 over the own 32
//     inputs, a thread a unit (W1's columns swizzled: sc_w1)            | barrier
//   3 h1 (items (unit): the ranks' partial sums in rank order); fc2 (a warp a class), the loss and dlogits
//     (thread m: image m), dh1 (items (unit)); then two roles, each half of the block (Note [a step's two roles]):
//       t < SC_ROLE: dp2 of the own inputs in 15 parts of 8 units, then added (items (input)); conv2's dW and
//         db of the own channels (items (channel, weight)); conv2's output gradient laid out dense and
//         padded, then dp1's part over the own channels (items (input channel, row, four columns))
//       t >= SC_ROLE: fc1's weight gradients of the own columns (items (unit, input)), the head's other
//         gradients of the own units (fc2's column entries, fc1's biases, fc2's biases on rank 0)
//                                                                        | barrier
//   4 dp1 of the own conv1 channel (the ranks' parts in rank order); conv1's dW and db: items (weight,
//     sixteenth of the positions), then (weight) adds the sixteenths   | barrier
// Each gradient is written (one cluster: and its parameter updated) by the thread that sums it. Sums are in
// fixed orders: no atomics, the same bits every run. The argmax and ReLU bits are stage_common.cu's (Note
// [stage backward through the argmax], Note [the ReLU bit]).
//
// Note [a step's two roles]: after dh1 a block has two chains of work: conv2's backward (four steps, each
// waiting for the last) and the head's gradients with their update, about 4,000 parameters a block whose
// stores (gradient, value, momentum) are most of the step's memory traffic. Each half of the block runs one
// chain, so the stores go out while conv2's backward computes; the first half meets at a barrier of its own
// (sc_sync_role). The second half meets at one of its own as often, though it needs none: with the counts
// unequal, compute-sanitizer's racecheck reported the later phase's reads across the halves as unordered
// although a block barrier orders them. The measurements: docs/kernels.md, "The whole step".

#ifndef SC_MAXG
#define SC_MAXG 1   // images a cluster
#endif
// Shared memory: 6064 floats every image uses (weights, conv1's gradients' scratch), then SC_IMAGE floats an image
// at these offsets, then the argmax bytes (176 an image): SC_SMEM floats in all, the module's smem=.
#define SC_IMAGE 4896
#define SI_X 0        // 784: the image
#define SI_P1 784     // 864: p1 (own channel, then all)
#define SI_P2 1648    // 32: p2 of the own channels (own input j = channel j / 16's position j % 16)
#define SI_C2C 1680   // 6 x 128: conv2's sums over one input channel each
#define SI_HP 2448    // 128: fc1 over the own inputs, every unit
#define SI_H1 2576    // 128: h1
#define SI_L 2704     // 16: logits; the loss at 10, the hit at 11
#define SI_DL 2720    // 16: dlogits
#define SI_DH 2736    // 128: dh1
#define SI_DP2S 2864  // 15 x 32: dp2 of the own inputs in parts of 8 units
#define SI_DP2 3344   // 32: dp2 of the own inputs, masked
#define SI_DC 3376    // 2 x 16 x 16: conv2's output gradient at (oy + 4, ox + 4), else 0
#define SI_DP1P 3888  // 864: dp1's part over the own conv2 channels
#define SI_DP1 4752   // 144: dp1 of the own conv1 channel, masked
#define SC_SMEM (6064 + SC_MAXG * (SC_IMAGE + 44))

#ifndef SC_THREADS
#define SC_THREADS 512
#endif
#define SC_ROLE (SC_THREADS / 2)   // phase 3's two roles: threads below, conv2's backward; above, the head's update
#define SC_W1Q ((3840 + SC_ROLE - 1) / SC_ROLE)   // W1's own entries (120 x 32) a thread of the head's role
#define SC_C2Q ((302 + SC_ROLE - 1) / SC_ROLE)    // conv2's own parameters (2 x 150 weights, 2 biases) a thread of
                                                  // the first role
#define SC_HQ ((175 + SC_ROLE - 1) / SC_ROLE)     // the head's other parameters of the own units a thread of the second

// The threads of one of phase 3's roles (whole warps) meet: barrier 1 for the first (t < SC_ROLE), 2 for the
// second (__syncthreads is 0). Each role meets as often as the other (Note [a step's two roles]).
template <int role>
__device__ __forceinline__ void sc_sync_role() { asm volatile("bar.sync %0, %1;" ::"n"(1 + role), "n"(SC_ROLE) : "memory"); }

// W1's own column j (0 .. 31) of unit u in shared memory: 16-byte groups of 4 inputs, the group index XORed with
// the unit's low bits, so that a warp reading one group of 32 units (fc1, a thread a unit) and a warp reading 32
// inputs of one unit (dp2, the update) each meet no bank twice.
__device__ __forceinline__ int sc_w1(int u, int j) { return u * 32 + ((((j >> 2) ^ u) & 7) << 2) + (j & 3); }

// A 2x2 pooling window's four sums of a 5x5 filter w over the input at xa (a row of `stride` floats): a[q],
// q = 2 dy + dx, is bias plus the products at (dy + r, dx + s) in the order r, s (the order of a thread that
// sums one position). The window's 6x6 inputs are loaded once for its four sums.
__device__ __forceinline__ void sc_window(const float* xa, int stride, const float* w, float bias, float a[4]) {
  a[0] = a[1] = a[2] = a[3] = bias;
#pragma unroll
  for (int r = 0; r < 5; ++r)
#pragma unroll
    for (int s = 0; s < 5; ++s) {
      const float wv = w[r * 5 + s];
      a[0] = fmaf(xa[r * stride + s], wv, a[0]);
      a[1] = fmaf(xa[r * stride + s + 1], wv, a[1]);
      a[2] = fmaf(xa[(r + 1) * stride + s], wv, a[2]);
      a[3] = fmaf(xa[(r + 1) * stride + s + 1], wv, a[3]);
    }
}

// A window's maximum of its four sums and its position q: the first maximum in the order q = 0 .. 3.
__device__ __forceinline__ float sc_window_max(const float a[4], int& q) {
  float best = a[0];
  q = 0;
  if (a[1] > best) { best = a[1]; q = 1; }
  if (a[2] > best) { best = a[2]; q = 2; }
  if (a[3] > best) { best = a[3]; q = 3; }
  return best;
}

// The head's parameters of rank r's own units besides W1's: h < 150 fc2's column entries (class h / 15, unit
// 15 r + h % 15), h < 165 fc1's biases, h < 175 fc2's biases (rank 0); else -1.
__device__ __forceinline__ int sc_head_param(int h, unsigned rank) {
  if (h < 150) return OFF_F2W + (h / 15) * 120 + 15 * rank + h % 15;
  if (h < 165) return OFF_F1B + 15 * rank + (h - 150);
  if (h < 175 && rank == 0) return OFF_F2B + (h - 165);
  return -1;
}

// x (N, 1, 28, 28), labels (N,); params, grads, velocity, ema: the flat buffers (lenet/params.py); lr[0];
// logits (N, 10) written as the chain's forward writes them. prof: null, or the workbench's (SC_PROFILE). With
// one cluster (gridDim.x == SC_RANKS): the step's gradients into grads, the update, and the loss into out,
// correct, running (lenet/kernels/softmax_ce_row.cu's totals). With more: cluster c's gradients into row c of
// part (PARAMS_TOTAL floats a row, zero where no parameter is) and part_loss[c], part_correct[c]; then
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
  float* const sm = reinterpret_cast<float*>(sm4);   // SC_SMEM floats (the module's smem=)
  // What every image of the cluster uses: 6064 floats
  float* const swc1 = sm;                // 160: conv1's 150 weights, 6 biases
  float* const swc2 = swc1 + 160;        // 304: conv2's weights of the own channels (2 x 150), their 2 biases
  float* const sW1 = swc2 + 304;         // 3840: W1's own columns, (unit, own input j), at sc_w1(u, j)
  float* const sb1 = sW1 + 3840;         // 128: fc1's 120 biases
  float* const sW2 = sb1 + 128;          // 1200
  float* const sb2 = sW2 + 1200;         // 16: fc2's 10 biases
  float* const sscr = sb2 + 16;          // 416: conv1's gradients in sixteenths
  // Image m's own (SC_IMAGE floats from SC_AT(m)): the offsets SI_* above
  float* const simg = sscr + 416;
#define SC_AT(m) (simg + (m) * SC_IMAGE)
  unsigned char* const sa1 = reinterpret_cast<unsigned char*>(simg + SC_MAXG * SC_IMAGE);   // G x 144: conv1's
  unsigned char* const sa2 = sa1 + SC_MAXG * 144;                                           // G x 32: conv2's argmax bytes

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const unsigned rank = sc_rank();
  const int cl = blockIdx.x / SC_RANKS, clusters = gridDim.x / SC_RANKS;
  const int img0 = cl * SC_MAXG;        // the cluster's first image; images img0 + m >= N are zeros, their loss's
                                        // gradient zero: they add nothing
  const bool c1 = rank < 6;             // owns conv1's channel rank
  const bool alone = clusters == 1;
  SC_MARK(0);
  float* const dst = alone ? grads : part + (size_t)cl * PARAMS_TOTAL;

  // ---- loads: what conv1 reads, then the rest, waited for before conv2 (copies in flight); the momentum of
  // the parameters this thread will update (registers, used last)
  if (c1)
    for (int i = t; i < SC_MAXG * 196; i += SC_THREADS) {
      const int m = i / 196, k = i % 196;
      if (img0 + m < N) sc_copy<16>(SC_AT(m) + SI_X + 4 * k, x + (size_t)(img0 + m) * 784 + 4 * k);
      else *reinterpret_cast<float4*>(SC_AT(m) + SI_X + 4 * k) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  for (int i = t; i < 156; i += SC_THREADS) sc_copy<4>(swc1 + i, params + (i < 150 ? OFF_C1W + i : OFF_C1B + i - 150));
  sc_copies_sent();
  for (int i = t; i < 302; i += SC_THREADS)
    sc_copy<4>(swc2 + i, params + (i < 300 ? OFF_C2W + (rank + 8 * (i / 150)) * 150 + i % 150 : OFF_C2B + rank + 8 * (i - 300)));
  for (int i = t; i < 960; i += SC_THREADS) {   // (unit, own channel, quarter): 16 bytes each
    const int u = i >> 3, ki = (i >> 2) & 1, m = i & 3;
    sc_copy<16>(sW1 + sc_w1(u, ki * 16 + 4 * m), params + OFF_F1W + u * 256 + (rank + 8 * ki) * 16 + 4 * m);
  }
  if (t < 30) sc_copy<16>(sb1 + 4 * t, params + OFF_F1B + 4 * t);
  for (int i = t; i < 300; i += SC_THREADS) sc_copy<16>(sW2 + 4 * i, params + OFF_F2W + 4 * i);
  if (t < 10) sc_copy<4>(sb2 + t, params + OFF_F2B + t);
  sc_copies_sent();
  const int label = t < SC_MAXG && img0 + t < N ? labels[img0 + t] : 0;   // thread m: image m's
  // Phase 3's roles: t < SC_ROLE conv2's backward (conv2's own parameters e = t, t + SC_ROLE, ... < 302),
  // tb = t - SC_ROLE >= 0 the head's update (W1's own entries, the head's other parameters h = tb, tb +
  // SC_ROLE, ... < 175).
  const int tb = t - SC_ROLE;
  float vw1[SC_W1Q], vc2[SC_C2Q], vh[SC_HQ], ph[SC_HQ], v1 = 0.f;
#pragma unroll
  for (int q = 0; q < SC_HQ; ++q) vh[q] = ph[q] = 0.f;
#pragma unroll
  for (int q = 0; q < SC_W1Q; ++q) vw1[q] = 0.f;
#pragma unroll
  for (int q = 0; q < SC_C2Q; ++q) vc2[q] = 0.f;
  if (alone) {
    const bool mom = momentum != 0.f;
#pragma unroll
    for (int q = 0; q < SC_W1Q; ++q) {
      const int e = tb + SC_ROLE * q;
      if (mom && tb >= 0 && e < 3840) vw1[q] = velocity[OFF_F1W + (e >> 5) * 256 + (rank + 8 * ((e & 31) >> 4)) * 16 + (e & 15)];
    }
#pragma unroll
    for (int q = 0; q < SC_C2Q; ++q) {
      const int e = t + SC_ROLE * q;
      if (mom && tb < 0 && e < 302) vc2[q] = velocity[e < 300 ? OFF_C2W + (rank + 8 * (e / 150)) * 150 + e % 150
                                                              : OFF_C2B + rank + 8 * (e - 300)];
    }
#pragma unroll
    for (int q = 0; q < SC_HQ; ++q) {
      const int i = tb >= 0 ? sc_head_param(tb + SC_ROLE * q, rank) : -1;
      if (i >= 0) {
        ph[q] = params[i];
        if (mom) vh[q] = velocity[i];
      }
    }
    if (mom && c1 && t < 26) v1 = velocity[t < 25 ? OFF_C1W + rank * 25 + t : OFF_C1B + rank];
  }
  const float rate = alone ? lr[0] : 0.f;   // loaded early: its first use is late
  sc_copies_wait<1>();   // the images and conv1's weights
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

  // ---- 1: conv1's forward, own channel: a thread a pooling window of an image, its four positions' sums
  if (c1) {
    const int c = rank;
    for (int i = t; i < SC_MAXG * 144; i += SC_THREADS) {
      const int m = i / 144, pos = i % 144;
      const float* xa = SC_AT(m) + SI_X + 2 * (pos / 12) * 28 + 2 * (pos % 12);
      float a[4];
      sc_window(xa, 28, swc1 + c * 25, swc1[150 + c], a);
      int arg;
      const float best = sc_window_max(a, arg);
      SC_AT(m)[SI_P1 + c * 144 + pos] = relu_keep_nan(best);
      sa1[m * 144 + pos] = arg_byte(arg, best);
    }
  }
  sc_copies_wait<0>();   // every weight (each thread its own copies; the barrier makes them everyone's)
  sc_sync();
  for (int i = t; i < SC_MAXG * 864; i += SC_THREADS) {
    const int m = i / 864, k = i % 864, c = k / 144;
    float* const p1 = SC_AT(m) + SI_P1;   // rank c's channel c of image m
    if (c != (int)rank) p1[k] = sc_at(simg, c)[m * SC_IMAGE + SI_P1 + k];
  }
  __syncthreads();
  SC_MARK(2);

  // ---- 2: conv2's forward, own channels: items (image, input channel, own channel, window), a window's four
  // positions' sums over one input channel; then items (image, own channel, window, q) add the input channels
  // in pairs and pool
  for (int e = t; e < SC_MAXG * 192; e += SC_THREADS) {
    const int m = e / 192, c = (e % 192) >> 5, ki = (e >> 4) & 1, pos = e & 15;
    float a[4];
    sc_window(SC_AT(m) + SI_P1 + c * 144 + 2 * (pos >> 2) * 12 + 2 * (pos & 3), 12, swc2 + ki * 150 + c * 25, 0.f, a);
    *reinterpret_cast<float4*>(SC_AT(m) + SI_C2C + c * 128 + ki * 64 + pos * 4) = make_float4(a[0], a[1], a[2], a[3]);
  }
  __syncthreads();
  for (int e = t; e < SC_MAXG * 128; e += SC_THREADS) {   // whole warps: the quad max's shuffles
    const int m = e >> 7, k = e & 127, ki = k >> 6, pos = (k >> 2) & 15;
    const float* c2c = SC_AT(m) + SI_C2C;
    const float a = swc2[300 + ki] + (c2c[k] + c2c[128 + k]) + (c2c[256 + k] + c2c[384 + k]) +
                    (c2c[512 + k] + c2c[640 + k]);
    int arg;
    const float best = sc_quad_max(a, arg);
    if ((k & 3) == 0) {
      SC_AT(m)[SI_P2 + ki * 16 + pos] = relu_keep_nan(best);
      sa2[m * 32 + ki * 16 + pos] = arg_byte(arg, best);
    }
  }
  __syncthreads();
  SC_MARK(3);
  for (int e = t; e < SC_MAXG * 120; e += SC_THREADS) {   // fc1 over the own inputs: a thread a (image, unit)
    const int m = e / 120, u = e % 120;
    const float* p2 = SC_AT(m) + SI_P2;
    float a = 0.f;
#pragma unroll
    for (int j = 0; j < 32; j += 4)
      a = dot4(*reinterpret_cast<const float4*>(sW1 + sc_w1(u, j)), *reinterpret_cast<const float4*>(p2 + j), a);
    SC_AT(m)[SI_HP + u] = a;
  }
  sc_sync();
  SC_MARK(4);

  // ---- 3: h1, fc2, the loss; dh1; the head's gradients of the own inputs and units; conv2's backward
  for (int e = t; e < SC_MAXG * 120; e += SC_THREADS) {
    const int m = e / 120, u = e % 120;
    float a = 0.f;
#pragma unroll
    for (int r = 0; r < SC_RANKS; ++r) a += sc_at(simg, r)[m * SC_IMAGE + SI_HP + u];
    SC_AT(m)[SI_H1 + u] = head_relu(a + sb1[u]);
  }
  __syncthreads();
  SC_MARK(5);
  for (int e = warp; e < SC_MAXG * 10; e += SC_THREADS / 32) {   // a warp an (image, class)
    const int m = e / 10, c = e % 10;
    const float* h1 = SC_AT(m) + SI_H1;
    float a = 0.f;
    for (int j = lane; j < 120; j += 32) a = fmaf(sW2[c * 120 + j], h1[j], a);
    a = warp_sum(a);
    if (lane == 0) {
      SC_AT(m)[SI_L + c] = a + sb2[c];
      if (rank == 0 && img0 + m < N) logits[(size_t)(img0 + m) * 10 + c] = a + sb2[c];
    }
  }
  __syncthreads();
  SC_MARK(6);
  if (t < SC_MAXG) {   // thread m: image m's loss and dlogits; its loss and hit beside its logits (SI_L + 10, 11)
    float* const l = SC_AT(t) + SI_L;
    if (img0 + t < N) {
      int hit = 0;
      l[10] = sce_row(l, nullptr, label, 10, eps, SC_AT(t) + SI_DL, grad_scale, hit);
      l[11] = (float)hit;
    } else {
#pragma unroll
      for (int c = 0; c < 10; ++c) SC_AT(t)[SI_DL + c] = 0.f;
      l[10] = l[11] = 0.f;
    }
  }
  __syncthreads();
  SC_MARK(7);
  for (int e = t; e < SC_MAXG * 120; e += SC_THREADS) {
    const int m = e / 120, u = e % 120;
    const float* dl = SC_AT(m) + SI_DL;
    float a = 0.f;
#pragma unroll
    for (int c = 0; c < 10; ++c) a = fmaf(sW2[c * 120 + u], dl[c], a);
    SC_AT(m)[SI_DH + u] = SC_AT(m)[SI_H1 + u] > 0.f ? a : 0.f;
  }
  __syncthreads();
  SC_MARK(8);
  if (tb < 0) {   // conv2's backward: dp2, conv2's gradients (and update), dp1's part; its own barriers (id 1)
    for (int e = t; e < SC_MAXG * 480; e += SC_ROLE) {   // dp2's parts: (image, eighth of the units, own input)
      const int m = e / 480, j = e & 31, s = (e % 480) >> 5;
      const float* dh = SC_AT(m) + SI_DH;
      float a = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) a = fmaf(sW1[sc_w1(8 * s + k, j)], dh[8 * s + k], a);
      SC_AT(m)[SI_DP2S + (e % 480)] = a;
    }
    sc_sync_role<0>();
    SC_MARK(9);
    for (int e = t; e < SC_MAXG * 32; e += SC_ROLE) {
      const int m = e >> 5, j = e & 31;
      const float* dp2s = SC_AT(m) + SI_DP2S;
      float a = 0.f;
#pragma unroll
      for (int s = 0; s < 15; ++s) a += dp2s[s * 32 + j];
      SC_AT(m)[SI_DP2 + j] = arg_g(sa2[e], a);
    }
    sc_sync_role<0>();
    SC_MARK(10);
#pragma unroll
    for (int q = 0; q < SC_C2Q; ++q) {   // conv2's dW and db of the own channels, over the images in order
      const int e = t + SC_ROLE * q;
      if (e >= 302) continue;
      float a = 0.f;
      int i;
      if (e < 300) {
        const int ki = e / 150, rem = e % 150, c = rem / 25, r = rem % 25 / 5, s = rem % 5;
#pragma unroll
        for (int m = 0; m < SC_MAXG; ++m) {
          const float* dp2 = SC_AT(m) + SI_DP2 + ki * 16;
          const float* p1 = SC_AT(m) + SI_P1 + c * 144 + r * 12 + s;
#pragma unroll
          for (int pos = 0; pos < 16; ++pos) {
            const int qq = arg_q(sa2[m * 32 + ki * 16 + pos]);
            const int oy = 2 * (pos >> 2) + (qq >> 1), ox = 2 * (pos & 3) + (qq & 1);
            a = fmaf(dp2[pos], p1[oy * 12 + ox], a);
          }
        }
        i = OFF_C2W + (rank + 8 * ki) * 150 + rem;
      } else {
#pragma unroll
        for (int m = 0; m < SC_MAXG; ++m)
#pragma unroll
          for (int pos = 0; pos < 16; ++pos) a += SC_AT(m)[SI_DP2 + (e - 300) * 16 + pos];
        i = OFF_C2B + rank + 8 * (e - 300);
      }
      dst[i] = a;
      if (alone) {
        float v = vc2[q];
        sc_store(params, velocity, ema, i, sgd_rule(swc2[e], a, v, momentum, weight_decay, nesterov, rate), v,
                 momentum, ema_weight);
      }
    }
    for (int e = t; e < SC_MAXG * 512; e += SC_ROLE) {   // (image, own channel, padded row, padded column)
      const int m = e >> 9, ki = (e >> 8) & 1, oy = ((e >> 4) & 15) - 4, ox = (e & 15) - 4;
      float v = 0.f;
      if (oy >= 0 && oy < 8 && ox >= 0 && ox < 8) {
        const int j = ki * 16 + (oy >> 1) * 4 + (ox >> 1);
        if (arg_q(sa2[m * 32 + j]) == (oy & 1) * 2 + (ox & 1)) v = SC_AT(m)[SI_DP2 + j];
      }
      SC_AT(m)[SI_DC + (e & 511)] = v;
    }
    sc_sync_role<0>();
    SC_MARK(11);
    for (int e = t; e < SC_MAXG * 216; e += SC_ROLE) {   // (image, input channel, row, four columns)
      const int m = e / 216, k = e % 216, c = k / 36, yy = k % 36 / 3, x0 = 4 * (k % 3);
      float a[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ki = 0; ki < 2; ++ki) {
        const float* w = swc2 + ki * 150 + c * 25;
#pragma unroll
        for (int r = 0; r < 5; ++r) {   // columns x0 .. x0 + 7: (x0 + n + 4 - s); a row of 8 a load pair
          const float* row = SC_AT(m) + SI_DC + ki * 256 + (yy + 4 - r) * 16 + x0;
          const float4 lo = *reinterpret_cast<const float4*>(row), hi = *reinterpret_cast<const float4*>(row + 4);
          const float d[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
          for (int s = 0; s < 5; ++s)
#pragma unroll
            for (int n = 0; n < 4; ++n) a[n] = fmaf(d[n + 4 - s], w[r * 5 + s], a[n]);
        }
      }
      *reinterpret_cast<float4*>(SC_AT(m) + SI_DP1P + c * 144 + yy * 12 + x0) = make_float4(a[0], a[1], a[2], a[3]);
    }
  } else {   // the head's gradients of the own inputs and units over the images in order, and their update:
             // stores beside the above
#pragma unroll
    for (int q = 0; q < SC_W1Q; ++q) {   // fc1's weight gradients of the own columns
      const int e = tb + SC_ROLE * q;
      if (e < 3840) {
        const int i = OFF_F1W + (e >> 5) * 256 + (rank + 8 * ((e & 31) >> 4)) * 16 + (e & 15);
        float g = 0.f;
#pragma unroll
        for (int m = 0; m < SC_MAXG; ++m) g = fmaf(SC_AT(m)[SI_DH + (e >> 5)], SC_AT(m)[SI_P2 + (e & 31)], g);
        dst[i] = g;
        if (alone) {
          float v = vw1[q];
          sc_store(params, velocity, ema, i, sgd_rule(sW1[sc_w1(e >> 5, e & 31)], g, v, momentum, weight_decay,
                                                      nesterov, rate), v, momentum, ema_weight);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < SC_HQ; ++q) {   // fc2's column entries, fc1's biases, fc2's biases
      const int h = tb + SC_ROLE * q, i = sc_head_param(h, rank);
      if (i >= 0) {
        float gh = 0.f;
#pragma unroll
        for (int m = 0; m < SC_MAXG; ++m) {
          const float* im = SC_AT(m);
          gh = h < 150 ? fmaf(im[SI_DL + h / 15], im[SI_H1 + 15 * rank + h % 15], gh)
                       : gh + (h < 165 ? im[SI_DH + 15 * rank + h - 150] : im[SI_DL + h - 165]);
        }
        dst[i] = gh;
        if (alone) {
          float v = vh[q];
          sc_store(params, velocity, ema, i, sgd_rule(ph[q], gh, v, momentum, weight_decay, nesterov, rate), v,
                   momentum, ema_weight);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 3; ++i) sc_sync_role<1>();   // as many as the first role's (Note [a step's two roles])
  }
  SC_MARK(12);
  sc_sync();
  SC_MARK(13);

  // ---- 4: dp1 of the own conv1 channel (the ranks' parts in rank order, masked); conv1's gradients
  if (c1) {
    const int c = rank;
    for (int e = t; e < SC_MAXG * 144; e += SC_THREADS) {
      const int m = e / 144, pos = e % 144;
      float a = 0.f;
#pragma unroll
      for (int r = 0; r < SC_RANKS; ++r) a += sc_at(simg, r)[m * SC_IMAGE + SI_DP1P + c * 144 + pos];
      SC_AT(m)[SI_DP1 + pos] = arg_g(sa1[e], a);
    }
    __syncthreads();
    for (int e = t; e < 416; e += SC_THREADS) {   // (weight, sixteenth of the positions), then the bias's
      const int seg = e & 15;
      float a = 0.f;
      if (e < 400) {
        const int rs = e >> 4, r = rs / 5, s = rs % 5;
#pragma unroll
        for (int m = 0; m < SC_MAXG; ++m)
#pragma unroll
          for (int pos = seg * 9; pos < seg * 9 + 9; ++pos) {
            const int q = arg_q(sa1[m * 144 + pos]);
            const int oy = 2 * (pos / 12) + (q >> 1), ox = 2 * (pos % 12) + (q & 1);
            a = fmaf(SC_AT(m)[SI_DP1 + pos], SC_AT(m)[SI_X + (oy + r) * 28 + ox + s], a);
          }
      } else {
#pragma unroll
        for (int m = 0; m < SC_MAXG; ++m)
#pragma unroll
          for (int pos = seg * 9; pos < seg * 9 + 9; ++pos) a += SC_AT(m)[SI_DP1 + pos];
      }
      sscr[e] = a;
    }
    __syncthreads();
    if (t < 26) {
      float a = 0.f;
#pragma unroll
      for (int seg = 0; seg < 16; ++seg) a += sscr[(t < 25 ? t * 16 : 400) + seg];
      const int i = t < 25 ? OFF_C1W + c * 25 + t : OFF_C1B + c;
      dst[i] = a;
      if (alone) {
        float v = v1;
        sc_store(params, velocity, ema, i, sgd_rule(swc1[t < 25 ? c * 25 + t : 150 + c], a, v, momentum, weight_decay,
                                                    nesterov, rate), v, momentum, ema_weight);
      }
    }
  }
  if (rank == 0 && t == 0) {   // the images' losses and hits in order
    float loss = 0.f;
    int hit = 0;
#pragma unroll
    for (int m = 0; m < SC_MAXG; ++m) {
      loss += SC_AT(m)[SI_L + 10];
      hit += (int)SC_AT(m)[SI_L + 11];
    }
    if (alone) {
      out[0] = loss * loss_scale;
      correct[0] = hit;
      if (running) running[0] += loss * loss_scale;
    } else {
      part_loss[cl] = loss;
      part_correct[cl] = hit;
    }
  }
#undef SC_AT
  SC_MARK(14);
  sc_sync();   // no block leaves while another may still read its shared memory
}
