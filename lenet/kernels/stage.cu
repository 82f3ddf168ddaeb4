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

// Stage 1 backward: the weight and bias gradients (nothing needs conv1's data gradient).
// blockDim.x = 160, one image per block iteration: thread t < 150 owns weight (k, r, s) =
// (t / 25, t % 25 / 5, t % 5); 150 <= t < 156 the bias of channel t - 150; each sums its images in
// registers and writes its block's row part[blockIdx.x * 156 + t] (dw 150, then db 6).
// Shared: sx (784) the image; sg (864) the pooled gradient; so (864) each window's argmax as an
// offset y * 28 + x into the image (Note [stage backward through the argmax]). The next image's
// inputs are loaded into registers while this one is computed (Note [prefetch]). (One 8-byte pair
// per window instead of sg and so measured 148 us against 112 at batch 8192: kept apart.)
#define S1B_THREADS 160
#define S1B_X 5   // ceil(784 / 160)
#define S1B_G 6   // ceil(864 / 160)
extern "C" __global__ void __launch_bounds__(S1B_THREADS)
stage1_backward_kernel(const float* __restrict__ x, const unsigned char* __restrict__ arg,
                       const float* __restrict__ dp, float* __restrict__ part, float* __restrict__ dw,
                       float* __restrict__ db, int N) {
  griddep_entry();
  __shared__ float sx[S1_IMAGE];
  __shared__ float sg[S1_POOLED];
  __shared__ int so[S1_POOLED];
  const int t = threadIdx.x;
  const int k = t / 25, tap = (t % 25 / 5) * 28 + t % 5;
  float nx[S1B_X], ng[S1B_G];
  int nq[S1B_G];
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
      if (i < S1_IMAGE) sx[i] = nx[j];
    }
#pragma unroll
    for (int j = 0; j < S1B_G; ++j) {
      const int i = t + S1B_THREADS * j;
      if (i < S1_POOLED) {
        const int q = nq[j], pos = i % 144;
        so[i] = (2 * (pos / 12) + (q >> 1)) * 28 + 2 * (pos % 12) + (q & 1);
        sg[i] = ng[j];
      }
    }
    __syncthreads();
    if (n + gridDim.x < N) fetch(n + gridDim.x);
    float a = 0.f;
    if (t < 150) {
      const float* g = sg + k * 144;
      const int* off = so + k * 144;
#pragma unroll 8
      for (int i = 0; i < 144; ++i) a = fmaf(g[i], sx[off[i] + tap], a);
    } else if (t < 156) {
      const float* g = sg + (t - 150) * 144;
      for (int i = 0; i < 144; ++i) a += g[i];
    }
    acc += a;
  }
  if (gridDim.x == 1) {   // the block's sums are the gradients
    if (t < 150) dw[t] = acc; else if (t < 156) db[t - 150] = acc;
  } else if (t < 156) {
    part[(size_t)blockIdx.x * 156 + t] = acc;
  }
}

// Stage 2 backward: data gradient (masked by x > 0), weight and bias gradients, in three versions:
// KS = 1 (stage2_backward_kernel, 160 threads), KS = 2 (stage2_backward_split_kernel, 320 threads)
// and KS = 4 (stage2_backward_split4_kernel, 640 threads), where each of KS parts of the block takes
// 16 / KS of the output channels (k), so one image's work is done by KS times the threads in about
// 1 / KS of the time (small batches, where the grid leaves SMs idle; the search times them all).
// One image per block iteration.
//   Weight gradient: thread t < 150 KS owns filter tap (c, r, s) = (u / 25, u % 25 / 5, u % 5),
//   u = t % 150, for the 16 / KS channels k of its part h = t / 150: sums in registers, each over
//   the channel's 16 pooled positions.
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
// Shared: sw (2400) weights; sx (864) the image; sgo (256) each window's pooled gradient and its
// argmax as an offset y * 12 + x into a 12 x 12 input plane, in one 8-byte pair; syx (256) the
// argmax's row and column in the 8 x 8 conv output, as y << 8 | x (Note [stage backward through the
// argmax]); sdx ((KS - 1) x 6 x 144) the other parts' data-gradient sums. The next image's inputs
// are loaded into registers while this one is computed (Note [prefetch]).
#ifndef S2B_MIN_BLOCKS
#define S2B_MIN_BLOCKS 4   // blocks per SM the register budget is fitted to (scripts/probes/stage_kernels.py)
#endif
#ifndef S2B_K_UNROLL
#define S2B_K_UNROLL 2     // output channels per unrolled step of the data gradient (the same probe)
#endif
constexpr int s2b_k_unroll = S2B_K_UNROLL;   // #pragma unroll takes a constant, not a macro

template <int KS>
__device__ __forceinline__ void stage2_backward(const float* __restrict__ x, const float* __restrict__ w,
                                                const unsigned char* __restrict__ arg, const float* __restrict__ dp,
                                                float* __restrict__ dx, float* __restrict__ part,
                                                float* __restrict__ dw, float* __restrict__ db, int N) {
  griddep_entry();
  constexpr int THREADS = 160 * KS, KN = 16 / KS;
  constexpr int NX = (S2_IMAGE + THREADS - 1) / THREADS, NG = (S2_POOLED + THREADS - 1) / THREADS;
  __shared__ float sw[S2_WEIGHTS];
  __shared__ float sx[S2_IMAGE];
  __shared__ float2 sgo[S2_POOLED];
  __shared__ int syx[S2_POOLED];
  __shared__ float sdx[KS > 1 ? (KS - 1) * 6 * 144 : 1];
  const int t = threadIdx.x;
  for (int i = t; i < S2_WEIGHTS; i += THREADS) sw[i] = w[i];
  const int wu = t % 150, wk0 = (t / 150) * KN;                   // weight gradient: tap, first k
  const int tap = (wu / 25) * 144 + (wu % 25 / 5) * 12 + wu % 5;
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
  int nq[NG];
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
      if (i < S2_IMAGE) sx[i] = nx[j];
    }
#pragma unroll
    for (int j = 0; j < NG; ++j) {
      const int i = t + THREADS * j;
      if (i < S2_POOLED) {
        const int pos = i & 15, q = nq[j];
        const int y = 2 * (pos >> 2) + (q >> 1), xc = 2 * (pos & 3) + (q & 1);
        sgo[i] = make_float2(ng[j], __int_as_float(y * 12 + xc));
        syx[i] = y << 8 | xc;
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
          a = fmaf(v.x, sx[__float_as_int(v.y) + tap], a);
        }
        acc[k] += a;
      }
    }
#endif
    if (t < 16) {
      float a = 0.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) a += sgo[t * 16 + i].x;
      bacc += a;
    }
    float a[6] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#ifndef S2B_SKIP_DGRAD
    if (down) {
#pragma unroll s2b_k_unroll
      for (int kk = 0; kk < KN; ++kk)
#pragma unroll
        for (int v = 0; v < 9; ++v) {
          const int k = dk0 + kk, i = k * 16 + woff[v], p = syx[i];
          const int r = yy - (p >> 8), s = xx - (p & 255);
          const bool hit = ((wmask >> v) & 1) && (unsigned)r < 5u && (unsigned)s < 5u;
          const float g = hit ? sgo[i].x : 0.f;
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
        dx[(size_t)n * S2_IMAGE + o] = sx[o] > 0.f ? v : 0.f;
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

extern "C" __global__ void __launch_bounds__(640)
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
