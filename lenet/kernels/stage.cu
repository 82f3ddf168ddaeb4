// LeNet's two stages, conv (5x5, valid) + bias + ReLU + 2x2/2 max-pool, forward and backward, each
// direction fused into one kernel (plus one small reduction for the weight and bias gradients).
// Launchers and the engine around them: lenet/stages/ours.py.
//
// Layouts: NCHW float32. An argmax byte q = 2 * dy + dx names the position of a pooling window's
// maximum (dy, dx in {0, 1}); the first maximum in the order a00, a01, a10, a11 wins.
//   stage 1: x (N, 1, 28, 28), w (6, 1, 5, 5), b (6)   -> conv (N, 6, 24, 24) -> p (N, 6, 12, 12)
//   stage 2: x (N, 6, 12, 12), w (16, 6, 5, 5), b (16) -> conv (N, 16, 8, 8)  -> p (N, 16, 4, 4)
//
// Note [stage backward through the argmax]: the gradient below a 2x2 max-pool is nonzero at one
// position in four (the argmax), so the weight gradient sums over the pooled positions only,
// dw[k, c, r, s] = sum_(n, pi, pj) dp[n, k, pi, pj] * x[n, c, y + r, x + s] with (y, x) the window's
// argmax, and the data gradient gathers, for each input position, the at most 3 x 3 windows per
// output channel whose argmax lies within the filter's reach: a quarter of the multiply-adds of a
// dense weight or data gradient. The incoming dp is the gradient of the pooled output already
// masked by this stage's ReLU (see Note [relu at the pooled level] in lenet/ops/conv.py); the data
// gradient is masked by the previous stage's ReLU, whose output is this stage's input x.
//
// Weight and bias gradients are deterministic: each block sums its images in a fixed order into
// its own row of `part`, and stage_reduce_kernel adds the rows in block order. No float atomics.
// A grid of one block (batch 1) writes its sums straight into dw and db, and no reduction runs.
//
// Note [prefetch]: a backward block works on one image at a time, and every image begins with a
// load from global memory that the whole block waits for at a barrier. The backward kernels
// therefore load the next image's inputs into registers right after the barrier and compute the
// current image meanwhile; the next iteration only moves them from registers to shared memory.

#define S1_IMAGE 784
#define S1_POOLED 864   // 6 * 12 * 12
#define S2_IMAGE 864    // 6 * 12 * 12
#define S2_POOLED 256   // 16 * 4 * 4
#define S2_WEIGHTS 2400 // 16 * 6 * 5 * 5

// ReLU of a window's maximum that keeps a NaN (fmaxf would turn it into 0 and hide a diverged run).
__device__ __forceinline__ float relu_keep_nan(float v) { return (v > 0.f || v != v) ? v : 0.f; }

// Stage 1 forward. blockDim.x = 144 * imgs: thread t works on image slot t / 144 of the block's
// current group of imgs images, at pooled position (pi, pj) = (t % 144 / 12, t % 144 % 12), for all
// 6 channels: its 6 x 6 input patch in registers, 4 conv outputs per channel, their max and argmax.
// Shared: sx (imgs * 784 floats, dynamic) the group's images; sw (150), sb (6) weights and bias.
extern "C" __global__ void __launch_bounds__(576)
stage1_forward_kernel(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                      float* __restrict__ p, unsigned char* __restrict__ arg, int N) {
  griddep_entry();
  extern __shared__ float sx[];
  __shared__ float sw[150];
  __shared__ float sb[6];
  const int t = threadIdx.x, imgs = blockDim.x / 144, slot = t / 144, pos = t % 144;
  const int pi = pos / 12, pj = pos % 12;
  for (int i = t; i < 150; i += blockDim.x) sw[i] = w[i];
  if (t < 6) sb[t] = b[t];
  for (int n0 = blockIdx.x * imgs; n0 < N; n0 += gridDim.x * imgs) {
    __syncthreads();   // every read of the previous group is done
    const int count = min(imgs, N - n0);
    for (int i = t; i < count * S1_IMAGE; i += blockDim.x) sx[i] = x[(size_t)n0 * S1_IMAGE + i];
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
      arg[out + k * 144] = (unsigned char)q;
    }
  }
}

// Stage 2 forward. blockDim.x = 256 * imgs: thread t works on image slot t / 256 at pooled output
// o = t % 256 = (k, pi, pj): 4 conv outputs in registers over 6 channels x 25 taps, then max and argmax.
// Shared (dynamic): sw (2400) the weights, then sx (imgs * 864) the group's images; sb (16) the bias.
extern "C" __global__ void __launch_bounds__(512)
stage2_forward_kernel(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                      float* __restrict__ p, unsigned char* __restrict__ arg, int N) {
  griddep_entry();
  extern __shared__ float smem[];
  float* sw = smem;
  float* sx = smem + S2_WEIGHTS;
  __shared__ float sb[16];
  const int t = threadIdx.x, imgs = blockDim.x / 256, slot = t / 256, o = t % 256;
  const int k = o >> 4, pi = (o >> 2) & 3, pj = o & 3;
  for (int i = t; i < S2_WEIGHTS; i += blockDim.x) sw[i] = w[i];
  if (t < 16) sb[t] = b[t];
  for (int n0 = blockIdx.x * imgs; n0 < N; n0 += gridDim.x * imgs) {
    __syncthreads();
    const int count = min(imgs, N - n0);
    for (int i = t; i < count * S2_IMAGE; i += blockDim.x) sx[i] = x[(size_t)n0 * S2_IMAGE + i];
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
    arg[out] = (unsigned char)q;
  }
}

// Stage 2 forward, tiled over output channels: blockDim.x = 64 * imgs, thread t works on image slot
// t / 64 at pooled position (pi, pj) = (t % 16 / 4, t % 4) for the 4 output channels
// k = 4 kg + 0..3, kg = t % 64 / 16: 16 conv outputs in registers. Per input channel and filter row
// a thread loads the next input row (3 aligned 8-byte loads; the row before stays in registers) and
// 5 float4s of weights (the 4 channels' taps, one address per 16 lanes: a broadcast), then does 80
// multiply-adds: the one-output-per-thread kernel above does 20 per 17 loads and waits on shared
// memory, this one on its multiply-adds.
// Shared (dynamic): swt (2400) the weights as [c][r][s][k] (k innermost, 16-byte aligned groups of
// 4), then sx (imgs * 864) the group's images.
extern "C" __global__ void __launch_bounds__(512)
stage2_forward_tiled_kernel(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                            float* __restrict__ p, unsigned char* __restrict__ arg, int N) {
  griddep_entry();
  extern __shared__ float4 smem4[];
  float* swt = reinterpret_cast<float*>(smem4);
  float* sx = swt + S2_WEIGHTS;
  const int t = threadIdx.x, imgs = blockDim.x / 64, slot = t / 64, u = t % 64;
  const int kg = u >> 4, pi = (u >> 2) & 3, pj = u & 3;
  for (int i = t; i < S2_WEIGHTS; i += blockDim.x) swt[(i % 150) * 16 + i / 150] = w[i];
  float bias[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) bias[q] = b[4 * kg + q];
  for (int n0 = blockIdx.x * imgs; n0 < N; n0 += gridDim.x * imgs) {
    __syncthreads();
    const int count = min(imgs, N - n0);
    for (int i = t; i < count * S2_IMAGE; i += blockDim.x) sx[i] = x[(size_t)n0 * S2_IMAGE + i];
    __syncthreads();
    if (slot >= count) continue;
    float a00[4], a01[4], a10[4], a11[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) a00[q] = a01[q] = a10[q] = a11[q] = bias[q];
    for (int c = 0; c < 6; ++c) {
      const float2* xc = reinterpret_cast<const float2*>(sx + slot * S2_IMAGE + c * 144 + (2 * pi) * 12 + 2 * pj);
      const float4* wc = reinterpret_cast<const float4*>(swt) + c * 100 + kg;   // (c, r, s) at wc[(r * 5 + s) * 4]
      float x0[6], x1[6];
#pragma unroll
      for (int h = 0; h < 3; ++h) { const float2 v = xc[h]; x0[2 * h] = v.x; x0[2 * h + 1] = v.y; }
#pragma unroll
      for (int r = 0; r < 5; ++r) {
#pragma unroll
        for (int h = 0; h < 3; ++h) { const float2 v = xc[(r + 1) * 6 + h]; x1[2 * h] = v.x; x1[2 * h + 1] = v.y; }
#pragma unroll
        for (int s = 0; s < 5; ++s) {
          const float4 wv = wc[(r * 5 + s) * 4];
          const float wq[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            a00[q] = fmaf(x0[s], wq[q], a00[q]);
            a01[q] = fmaf(x0[s + 1], wq[q], a01[q]);
            a10[q] = fmaf(x1[s], wq[q], a10[q]);
            a11[q] = fmaf(x1[s + 1], wq[q], a11[q]);
          }
        }
#pragma unroll
        for (int s = 0; s < 6; ++s) x0[s] = x1[s];
      }
    }
    const size_t out = (size_t)(n0 + slot) * S2_POOLED + (4 * kg) * 16 + pi * 4 + pj;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float best = a00[q];
      int qa = 0;
      if (a01[q] > best) { best = a01[q]; qa = 1; }
      if (a10[q] > best) { best = a10[q]; qa = 2; }
      if (a11[q] > best) { best = a11[q]; qa = 3; }
      p[out + q * 16] = relu_keep_nan(best);
      arg[out + q * 16] = (unsigned char)qa;
    }
  }
}

// Stage 1 backward: the weight and bias gradients (nothing needs conv1's data gradient).
// blockDim.x = 192, one warp per output channel k = t / 32, one image per block iteration: lane
// l < 25 owns weight (k, r, s) = (k, l / 5, l % 5), lane 25 the bias of channel k (in step with the
// others, reading 1 for x); each sums its images in registers and writes its block's row
// part[blockIdx.x * 156 + i] (dw 150, then db 6).
// Shared: sx (28 x S1_RS) the image, row y at y * S1_RS; sgo (864) each window's pooled gradient
// and its argmax as an offset y * S1_RS + x into sx, in one 8-byte record (Note [stage backward
// through the argmax]). The next image's inputs are loaded into registers while this one is
// computed (Note [prefetch]).
// A warp's step reads one record (the same for every lane: one wavefront) and one word of sx per
// lane at that record's offset plus the lane's tap r * S1_RS + s: with S1_RS = 45 (13 mod 32) the 25
// taps fall in 25 banks, one wavefront (Note [shared-memory banks]). The earlier layout (160 threads,
// tap t, 28-float rows, two channels per warp at two offsets, gradient and offset in two arrays)
// took about 4.5 wavefronts per step.
#define S1B_THREADS 192
#define S1B_X 5   // ceil(784 / 192)
#define S1B_G 5   // ceil(864 / 192)
#ifndef S1_RS
#define S1_RS 45
#endif
extern "C" __global__ void __launch_bounds__(S1B_THREADS)
stage1_backward_kernel(const float* __restrict__ x, const unsigned char* __restrict__ arg,
                       const float* __restrict__ dp, float* __restrict__ part, float* __restrict__ dw,
                       float* __restrict__ db, int N) {
  griddep_entry();
  __shared__ float sx[28 * S1_RS];
  __shared__ float2 sgo[S1_POOLED];
  const int t = threadIdx.x, k = t >> 5, lane = t & 31;
  const bool bias = lane >= 25;   // lane 25 sums the gradient alone (lanes 26..31 idle along)
  const int tap = bias ? 0 : (lane / 5) * S1_RS + lane % 5;
  float nx[S1B_X], ng[S1B_G];
  int nq[S1B_G], sxi[S1B_X];   // sxi: where the image's element t + 192 j goes in sx
#pragma unroll
  for (int j = 0; j < S1B_X; ++j) {
    const int i = t + S1B_THREADS * j;
    sxi[j] = (i / 28) * S1_RS + i % 28;
  }
  auto fetch = [&](int n) {
#pragma unroll
    for (int j = 0; j < S1B_X; ++j) {
      const int i = t + S1B_THREADS * j;
      if (i < S1_IMAGE) nx[j] = x[(size_t)n * S1_IMAGE + i];
    }
#pragma unroll
    for (int j = 0; j < S1B_G; ++j) {
      const int i = t + S1B_THREADS * j;
      if (i < S1_POOLED) { nq[j] = arg[(size_t)n * S1_POOLED + i]; ng[j] = dp[(size_t)n * S1_POOLED + i]; }
    }
  };
  float acc = 0.f;
  if (blockIdx.x < N) fetch(blockIdx.x);
  for (int n = blockIdx.x; n < N; n += gridDim.x) {
    __syncthreads();   // every read of the previous image is done
#pragma unroll
    for (int j = 0; j < S1B_X; ++j) {
      const int i = t + S1B_THREADS * j;
      if (i < S1_IMAGE) sx[sxi[j]] = nx[j];
    }
#pragma unroll
    for (int j = 0; j < S1B_G; ++j) {
      const int i = t + S1B_THREADS * j;
      if (i < S1_POOLED) {
        const int q = nq[j], pos = i % 144;
        const int off = (2 * (pos / 12) + (q >> 1)) * S1_RS + 2 * (pos % 12) + (q & 1);
        sgo[i] = make_float2(ng[j], __int_as_float(off));
      }
    }
    __syncthreads();
    if (n + gridDim.x < N) fetch(n + gridDim.x);
    const float2* g = sgo + k * 144;
    float a = 0.f;
#pragma unroll 8
    for (int i = 0; i < 144; ++i) {   // every lane in step: the bias lane reads lane 0's word (a broadcast)
      const float2 v = g[i];
      const float xv = sx[__float_as_int(v.y) + tap];
      a = fmaf(v.x, bias ? 1.f : xv, a);
    }
    acc += a;
  }
  const int col = lane < 25 ? k * 25 + lane : 150 + k;   // this lane's column: dw, then db
  if (lane < 26) {
    if (gridDim.x == 1) {   // the block's sums are the gradients
      if (lane < 25) dw[col] = acc; else db[k] = acc;
    } else {
      part[(size_t)blockIdx.x * 156 + col] = acc;
    }
  }
}

// Stage 2 backward: data gradient (masked by x > 0), weight and bias gradients, in three versions:
// KS = 1 (stage2_backward_kernel, 160 threads), KS = 2 (stage2_backward_split_kernel, 320 threads)
// and KS = 4 (stage2_backward_split4_kernel, 640 threads), where each of KS parts of the block takes
// 16 / KS of the output channels (k), so one image's work is done by KS times the threads in about
// 1 / KS of the time (small batches, where the grid leaves SMs idle; the search times them all).
// One image per block iteration.
//   Weight gradient: thread t < 150 KS owns filter tap u = (c, r, s) = (u / 25, u % 25 / 5, u % 5),
//   u = s2b_taps.u[t % 150] (Note [shared-memory banks]), for the 16 / KS channels k of its part
//   h = t / 150: sums in registers, each over the channel's 16 pooled positions.
//   Bias gradient: thread t < 16 owns channel t.
//   Data gradient: thread t < 144 KS owns input position (yy, xx) = (u / 12, u % 12), u = t % 144,
//   all 6 channels, over the channels k of its part h = t / 144: for each k, the 3 x 3 windows
//   around it whose argmax may lie within the filter's reach, each visited whether it does or not
//   (a zero gradient where not): no branch on data, so the visits unroll and their loads overlap (a
//   loop that branched took 43 ns per image at batch 8192, scripts/probes/stage_kernels.py). With
//   KS > 1 the other parts' sums go through shared memory and the first part adds them, in part
//   order, before the mask.
// Writes dx for each image and its block's row part[blockIdx.x * 2416 + i] (dw 2400, then db 16), or,
// for a grid of one block, dw and db themselves.
// Shared: sw (2400) weights; sx (6 x S2_CS) the image, channel c's row y at c * S2_CS + y * S2_RS
// (Note [shared-memory banks]); sgo (256) each window's record: its pooled gradient, and its argmax
// packed as (y * S2_RS + x) | y << 16 | x << 24 for the weight gradient's offset into a channel
// plane and the data gradient's row and column (Note [stage backward through the argmax]);
// sdx ((KS - 1) x 6 x 144) the other parts' data-gradient sums. The next image's inputs are loaded
// into registers while this one is computed (Note [prefetch]).
//
// Note [shared-memory banks]: this kernel is bound by shared-memory wavefronts (a warp's load takes
// one per distinct bank word it touches more than once per bank; per image about 14 per weight-gradient
// step across the 5 warps and 8 per data-gradient visit, against a few multiply-adds each). A warp
// of weight-gradient threads reads sx at one argmax offset (uniform) plus each lane's tap, so its
// lanes conflict where two taps share a bank: with 12-float rows and 144-float planes the 5 warps
// took 14 wavefronts per step. With rows of S2_RS = 13 and planes of S2_CS = 159 floats every bank
// holds 4 or 5 of the 150 taps, and s2b_taps orders the taps so that the first 4 warps take one tap
// of every bank and the fifth the rest: 5 wavefronts, the least 150 lanes can take. The data
// gradient reads one record per visit (the gradient and the argmax in one 8-byte load, where it read
// two) and its 6 weights, whose 25 taps per channel lie in 25 consecutive words: conflict-free.
#ifndef S2B_MIN_BLOCKS
#define S2B_MIN_BLOCKS 4   // blocks per SM the register budget is fitted to (scripts/probes/stage_kernels.py)
#endif
#ifndef S2B_K_UNROLL
#define S2B_K_UNROLL 2     // output channels per unrolled step of the data gradient (the same probe)
#endif
#ifndef S2_RS
#define S2_RS 13           // sx's row stride in floats (Note [shared-memory banks])
#endif
#ifndef S2_CS
#define S2_CS 159          // sx's channel stride in floats, at least 12 * S2_RS
#endif
constexpr int s2b_k_unroll = S2B_K_UNROLL;   // #pragma unroll takes a constant, not a macro

constexpr int s2_bank(int u) { return ((u / 25) * S2_CS + (u % 25 / 5) * S2_RS + u % 5) & 31; }

// The weight gradient's taps in thread order (Note [shared-memory banks]): warp j < 4 takes the j-th
// tap of each bank in bank order, warp 4 every later one. Every tap appears once whatever the
// strides; they only decide how many wavefronts a warp's load takes.
struct TapOrder {
  unsigned char u[150];
  constexpr TapOrder() : u() {
    int n = 0;
    for (int j = 0; j < 5; ++j)
      for (int b = 0; b < 32; ++b) {
        int seen = 0;
        for (int v = 0; v < 150; ++v)
          if (s2_bank(v) == b) {
            if (j < 4 ? seen == j : seen >= 4) u[n++] = (unsigned char)v;
            ++seen;
          }
      }
  }
};
__constant__ TapOrder s2b_taps = TapOrder();

template <int KS>
__device__ __forceinline__ void stage2_backward(const float* __restrict__ x, const float* __restrict__ w,
                                                const unsigned char* __restrict__ arg, const float* __restrict__ dp,
                                                float* __restrict__ dx, float* __restrict__ part,
                                                float* __restrict__ dw, float* __restrict__ db, int N) {
  griddep_entry();
  constexpr int THREADS = 160 * KS, KN = 16 / KS;
  constexpr int NX = (S2_IMAGE + THREADS - 1) / THREADS, NG = (S2_POOLED + THREADS - 1) / THREADS;
  __shared__ float sw[S2_WEIGHTS];
  __shared__ float sx[6 * S2_CS];
  __shared__ float2 sgo[S2_POOLED];
  __shared__ float sdx[KS > 1 ? (KS - 1) * 6 * 144 : 1];
  const int t = threadIdx.x;
  for (int i = t; i < S2_WEIGHTS; i += THREADS) sw[i] = w[i];
  const int wu = s2b_taps.u[t % 150], wk0 = (t / 150) * KN;       // weight gradient: tap, first k
  const int tap = (wu / 25) * S2_CS + (wu % 25 / 5) * S2_RS + wu % 5;
  const bool wown = t < 150 * KS;
  float acc[KN];
#pragma unroll
  for (int k = 0; k < KN; ++k) acc[k] = 0.f;
  float bacc = 0.f;
  const int du = t % 144, dk0 = (t / 144) * KN;                    // data gradient: position, first k
  const bool down = t < 144 * KS;
  const int yy = du / 12, xx = du % 12;
  const int pi0 = max(0, (yy - 4) / 2), pi1 = min(3, yy / 2), pj0 = max(0, (xx - 4) / 2), pj1 = min(3, xx / 2);
  int woff[9], wmask = 0;   // the 3 x 3 windows from (pi0, pj0): offset pi * 4 + pj, and which exist
#pragma unroll
  for (int v = 0; v < 9; ++v) {
    const int pi = pi0 + v / 3, pj = pj0 + v % 3;
    const bool ok = pi <= pi1 && pj <= pj1;
    woff[v] = ok ? pi * 4 + pj : 0;
    wmask |= ok ? 1 << v : 0;
  }
  float nx[NX], ng[NG];
  int nq[NG], sxi[NX];   // sxi: where the image's element t + THREADS j goes in sx
#pragma unroll
  for (int j = 0; j < NX; ++j) {
    const int i = t + THREADS * j, c = i / 144, yx = i % 144;
    sxi[j] = c * S2_CS + (yx / 12) * S2_RS + yx % 12;
  }
  auto fetch = [&](int n) {
#pragma unroll
    for (int j = 0; j < NX; ++j) {
      const int i = t + THREADS * j;
      if (i < S2_IMAGE) nx[j] = x[(size_t)n * S2_IMAGE + i];
    }
#pragma unroll
    for (int j = 0; j < NG; ++j) {
      const int i = t + THREADS * j;
      if (i < S2_POOLED) { nq[j] = arg[(size_t)n * S2_POOLED + i]; ng[j] = dp[(size_t)n * S2_POOLED + i]; }
    }
  };
  if (blockIdx.x < N) fetch(blockIdx.x);
  for (int n = blockIdx.x; n < N; n += gridDim.x) {
    __syncthreads();   // every read of the previous image is done
#pragma unroll
    for (int j = 0; j < NX; ++j) {
      const int i = t + THREADS * j;
      if (i < S2_IMAGE) sx[sxi[j]] = nx[j];
    }
#pragma unroll
    for (int j = 0; j < NG; ++j) {
      const int i = t + THREADS * j;
      if (i < S2_POOLED) {
        const int pos = i & 15, q = nq[j];
        const int y = 2 * (pos >> 2) + (q >> 1), xc = 2 * (pos & 3) + (q & 1);
        sgo[i] = make_float2(ng[j], __int_as_float((y * S2_RS + xc) | y << 16 | xc << 24));
      }
    }
    __syncthreads();
    if (n + gridDim.x < N) fetch(n + gridDim.x);
#ifndef S2B_SKIP_WGRAD   // attribution switches for scripts/probes/stage_kernels.py only
    if (wown) {
#pragma unroll
      for (int k = 0; k < KN; ++k) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const float2 v = sgo[(wk0 + k) * 16 + i];
          a = fmaf(v.x, sx[(__float_as_int(v.y) & 0xffff) + tap], a);
        }
        acc[k] += a;
      }
    }
#endif
    if (t < 16) {   // lane t starts at window t: the 16 lanes' records lie in 16 distinct bank pairs
      float a = 0.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) a += sgo[t * 16 + ((i + t) & 15)].x;
      bacc += a;
    }
    float a[6] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#ifndef S2B_SKIP_DGRAD
    if (down) {
#pragma unroll s2b_k_unroll
      for (int kk = 0; kk < KN; ++kk)
#pragma unroll
        for (int v = 0; v < 9; ++v) {
          const int k = dk0 + kk;
          const float2 rec = sgo[k * 16 + woff[v]];
          const int p = __float_as_int(rec.y), r = yy - ((p >> 16) & 255), s = xx - (p >> 24);
          const bool hit = ((wmask >> v) & 1) && (unsigned)r < 5u && (unsigned)s < 5u;
          const float g = hit ? rec.x : 0.f;
          const float* wk = sw + k * 150 + (hit ? r * 5 + s : 0);
#pragma unroll
          for (int c = 0; c < 6; ++c) a[c] = fmaf(g, wk[c * 25], a[c]);
        }
    }
#endif
    if (KS > 1) {
      if (down && t >= 144) {
#pragma unroll
        for (int c = 0; c < 6; ++c) sdx[((t / 144 - 1) * 6 + c) * 144 + du] = a[c];
      }
      __syncthreads();
    }
    if (t < 144) {
#pragma unroll
      for (int c = 0; c < 6; ++c) {
        const int o = c * 144 + t;
        float v = a[c];
#pragma unroll
        for (int h = 1; h < KS; ++h) v += sdx[(h - 1) * S2_IMAGE + o];
        dx[(size_t)n * S2_IMAGE + o] = sx[c * S2_CS + yy * S2_RS + xx] > 0.f ? v : 0.f;
      }
    }
  }
  const bool direct = gridDim.x == 1;   // the block's sums are the gradients
  float* mine = direct ? dw : part + (size_t)blockIdx.x * (S2_WEIGHTS + 16);
  if (wown) {
#pragma unroll
    for (int k = 0; k < KN; ++k) mine[(wk0 + k) * 150 + wu] = acc[k];
  }
  if (t < 16) (direct ? db : mine + S2_WEIGHTS)[t] = bacc;
}

extern "C" __global__ void __launch_bounds__(160, S2B_MIN_BLOCKS)
stage2_backward_kernel(const float* __restrict__ x, const float* __restrict__ w, const unsigned char* __restrict__ arg,
                       const float* __restrict__ dp, float* __restrict__ dx, float* __restrict__ part,
                       float* __restrict__ dw, float* __restrict__ db, int N) {
  stage2_backward<1>(x, w, arg, dp, dx, part, dw, db, N);
}

extern "C" __global__ void __launch_bounds__(320)
stage2_backward_split_kernel(const float* __restrict__ x, const float* __restrict__ w,
                             const unsigned char* __restrict__ arg, const float* __restrict__ dp,
                             float* __restrict__ dx, float* __restrict__ part, float* __restrict__ dw,
                             float* __restrict__ db, int N) {
  stage2_backward<2>(x, w, arg, dp, dx, part, dw, db, N);
}

// Note [registers of the split kernel]: 640 threads at 72 registers take 46 K of an SM's 64 K
// registers, and leave room for a block of the head's weight-gradient kernel, which runs beside the
// stages' backward on the side stream (Note [side stream] in lenet/ops/context.py). Left to ptxas,
// __launch_bounds__(640, 1) took 96 registers: the whole register file, so at batch 128 (a grid of
// 128 blocks) the side stream waited, and the step took 69.7 us against 62.6. __launch_bounds__(640)
// alone took 48 registers and spilled.
extern "C" __global__ void __maxnreg__(72)
stage2_backward_split4_kernel(const float* __restrict__ x, const float* __restrict__ w,
                              const unsigned char* __restrict__ arg, const float* __restrict__ dp,
                              float* __restrict__ dx, float* __restrict__ part, float* __restrict__ dw,
                              float* __restrict__ db, int N) {
  stage2_backward<4>(x, w, arg, dp, dx, part, dw, db, N);
}

// The blocks' rows of partial sums added in a fixed order (deterministic): column i < mw goes to
// dw[i], the rest to db[i - mw]. blockDim.x = 256 (8 warps): a block owns 32 columns, lane = column;
// warp w sums rows w, w + 8, w + 16, ... in order, then warp 0 adds the 8 warps' sums in order.
// Shared: sums (8 x 32) the warps' sums. Many rows (a large grid of partials) are read in parallel:
// one thread per column looping over every row took ~30 us for 528 rows (ncu, batch 8192).
extern "C" __global__ void __launch_bounds__(256)
stage_reduce_kernel(const float* __restrict__ part, float* __restrict__ dw, float* __restrict__ db,
                    int rows, int mw, int mb) {
  griddep_entry();
  __shared__ float sums[8][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, m = mw + mb;
  const int i = blockIdx.x * 32 + lane;
  float a = 0.f;
  if (i < m)
    for (int b = warp; b < rows; b += 8) a += part[(size_t)b * m + i];
  sums[warp][lane] = a;
  __syncthreads();
  if (warp == 0 && i < m) {
    float total = sums[0][lane];
#pragma unroll
    for (int w = 1; w < 8; ++w) total += sums[w][lane];
    if (i < mw) dw[i] = total; else db[i - mw] = total;
  }
}
