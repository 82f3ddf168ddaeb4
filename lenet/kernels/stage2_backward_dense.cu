// module stage2_backward_dense: stage=conv2 direction=backward version=4 threads=224 define=S2D_VERSION=4 uses=stage_common,tf32,stage2_tiles
// module stage2_backward_balanced: stage=conv2 direction=backward version=5 threads=256 define=S2D_VERSION=5 uses=stage_common,tf32,stage2_tiles
// Stage 2 backward in register tiles: the pooled gradient expanded once into the conv gradient
// (16 x 8 x 8, one nonzero per 2 x 2 window), then the weight and the data gradient as dense sums over
// it, whose operands sit in registers (Note [dense stage backward]). Same arguments, partial rows and
// determinism as stage2_backward.cu.
//   A block (224 threads; version 5's, 256) owns images blockIdx.x, blockIdx.x + gridDim.x, ... of its model, one per
//   iteration, their dx, and row blockIdx.x of part (its weight and bias sums over those images).
//   Weight gradient: thread t < 96 owns (k, c) = (t & 15, t >> 4): dw[k, c, r, s] for all 25 taps in
//   registers, summed over the images, each over y (its conv-gradient row) and x (8 x 8).
//   Bias gradient: thread t < 16 owns channel t.
//   Data gradient: thread 96 + u, u < 120, owns (c, r, quarter) = (u / 20, u / 4 % 5, u & 3): the sums
//   over k and s of dconv[k, y, x] w[k, c, r, s] into input row y + r, column x + s, for the 2 rows y
//   of its quarter (24 sums in registers); these go to sp, and after a barrier thread t < 144 adds, for
//   input position (Y, X) = (t / 12, t % 12) and each channel, its rows r = 0..4 in order and masks
//   by x > 0.
//   Version 5 (256 threads, Note [balanced stage backward]): thread t < 96 owns (k, c) as above, its
//   taps r = 0..3 only; thread 96 + b, b < 24, owns row r = 4 of (k, c) = ((b & 3) * 4 + i, b >> 2) for
//   i = 0..3; thread 120 + j, j < 8, the bias of channels 2 j and 2 j + 1; thread 128 + u the data
//   gradient's unit u as above.
//   Version 6 (the weight gradient on the tensor cores) is in dev/ (docs/kernels.md, "Stage 2's backward").
// Shared: sx (6 x 144) the image; sd (16 x S2D_DS) the conv gradient, channel k's row y at
// k * S2D_DS + y * S2D_RS; sg (256) the pooled gradients (bias); swd the weights as w[k, c, r, 0..4] at
// (k * 30 + c * 5 + r) * 8 (16-byte rows); sp (30 x S2D_PS) the data gradient's partial rows, (c, r)'s
// row y at (c * 5 + r) * S2D_PS + y * 12.
//
// Note [dense stage backward]: stage2_backward.cu routes each pooled gradient through its argmax: a
// quarter of the multiply-adds, but each one reads shared memory at a data-dependent address (the
// weight gradient the image at the argmax, the data gradient the weight at the argmax's offset), and
// it is bound by shared-memory wavefronts (~7,600 per image).
// Here the argmax decides only where the expansion writes; the sums then run over every conv position
// (3 in 4 of their terms are exact zeros: 0 * v adds nothing to a finite sum), with the loop indices
// known at compile time, so a thread's operands are registers loaded once per row: the weight gradient
// reads a row of x (3 x 16 bytes) and uses it for 40 multiply-adds, the data gradient a row of the
// conv gradient (2 x 16 bytes, broadcast) for 40. 307 K multiply-adds per image against 77 K, and
// ~990 shared loads (3,250 wavefronts by ncu) against ~7,600 wavefronts.
// About twice as fast as the routed version at large batches; its time is set by the barriers, where the
// weight warps' 1,600 multiply-adds an image meet the data warps' 1,280 (docs/kernels.md, "Stage 2's
// backward", with what was tried).
//
// Note [one set of sums]: a thread is of one kind, but registers are allocated for the kernel: with
// the weight gradient's 25 sums and the data gradient's 24 in two arrays, both were live across the
// image loop in every thread (96 registers, spilling at the 72 that four blocks per SM allow). The
// data gradient's sums therefore live in the first 24 of acc, zeroed at each image (72 registers and a
// spill of 44 bytes, into L1; 3 blocks per SM at 80 registers and no spill was no faster).
// Note [balanced stage backward]: in version 4 a weight-gradient thread does 1,600 multiply-adds an
// image and a data-gradient thread 1,280, so at each image's barrier the data warps wait a fifth of the
// time (barrier stalls 2.4 of 9.1 cycles per instruction). Version 5 takes each (k, c)'s fifth tap row
// off its thread: 24 more threads each take the r = 4 rows of four (k, c) of one channel c (one input row
// and four conv-gradient rows a step), so every thread does 1,280 (the bias moves to the 8 threads left
// over). 256 threads at 64 registers, 4 blocks per SM; the data gradient's channel loop unrolled by 1
// (by 2 it spilled 64 bytes). Faster than version 4 from 512 images on (alike below): the schedulers'
// issue, no longer the barriers, sets its time. What was tried and lost, and the timings: docs/kernels.md,
// "Stage 2's backward".
#ifndef S2D_MIN_BLOCKS
#define S2D_MIN_BLOCKS 4   // blocks per SM the register budget is fitted to
#endif
#ifndef S2D_Y_UNROLL
#define S2D_Y_UNROLL 1     // the weight gradient's rows y per unrolled step (scripts/probes/stage_kernels.py)
#endif
#ifndef S2D_K_UNROLL        // the data gradient's channels k per unrolled step (the same probe): at 2,
#define S2D_K_UNROLL (S2D_VERSION > 4 ? 1 : 2)   // version 5 spilled 64 bytes at its 64 registers
#endif
constexpr int s2d_y_unroll = S2D_Y_UNROLL, s2d_k_unroll = S2D_K_UNROLL;   // #pragma unroll takes a constant
#define S2D_PS 97          // sp's (c, r) stride: odd, so the 32 lanes' stores of one (y, X) meet no bank twice

__device__ __forceinline__ void s2d_row12(float (&v)[12], const float* p) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4),
               c = *reinterpret_cast<const float4*>(p + 8);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y;
  v[6] = b.z; v[7] = b.w; v[8] = c.x; v[9] = c.y; v[10] = c.z; v[11] = c.w;
}

// A weight-gradient row's five sums: acc[s] += sum over x of d[x] xr[x + s] (one conv-gradient row of 8
// against one input row of 12, in registers).
__device__ __forceinline__ void s2d_taps(float* acc, const float (&d)[8], const float (&xr)[12]) {
#pragma unroll
  for (int xx = 0; xx < 8; ++xx)
#pragma unroll
    for (int s = 0; s < 5; ++s) acc[s] = fmaf(d[xx], xr[xx + s], acc[s]);
}

// The two layouts (S2D_VERSION, set per module by its declaration): version 4's and 5's above.
template <int V>
__device__ __forceinline__ void stage2_backward_dense(const float* __restrict__ x, const float* __restrict__ w,
                                                      const unsigned char* __restrict__ arg,
                                                      const float* __restrict__ dp, float* __restrict__ dx,
                                                      float* __restrict__ part, float* __restrict__ dw,
                                                      float* __restrict__ db, int N, int ps) {
  griddep_entry();
  PACK_MODEL(x, (size_t)N * S2_IMAGE); PACK_MODEL(w, ps); PACK_MODEL(arg, (size_t)N * S2_POOLED);   // Note [model from the grid]
  PACK_MODEL(dp, (size_t)N * S2_POOLED); PACK_MODEL(dx, (size_t)N * S2_IMAGE);
  PACK_MODEL(part, (size_t)gridDim.x * (S2_WEIGHTS + 16)); PACK_MODEL(dw, ps); PACK_MODEL(db, ps);
  constexpr bool BALANCED = V == 5;
  constexpr int THREADS = V == 4 ? 224 : 256;
  constexpr int WR = BALANCED ? 4 : 5;           // a (k, c) weight thread's tap rows r: 0 .. WR - 1
  constexpr int D0 = V == 4 ? 96 : 128;          // the first data-gradient thread
  constexpr int NX = (S2_IMAGE + THREADS - 1) / THREADS, NG = (S2_POOLED + THREADS - 1) / THREADS;
  __shared__ __align__(16) float sx[S2_IMAGE];
  __shared__ __align__(16) float sd[16 * S2D_DS];
  __shared__ float sg[S2_POOLED];
  __shared__ __align__(16) float swd[16 * 30 * 8];
  __shared__ float sp[30 * S2D_PS];
  const int t = threadIdx.x;
  for (int i = t; i < 16 * 30 * 8; i += THREADS) swd[i] = (i & 7) < 5 ? w[(i >> 3) * 5 + (i & 7)] : 0.f;
  const int wk = t & 15, wc = t >> 4;                                  // weight gradient (t < 96)
  const int wb = t - 96;                                               // version 5's row r = 4 (0 <= wb < 24)
  const int du = t - D0, dcr = du >> 2, dq = du & 3;                  // data gradient (0 <= du < 120)
  const int gY = t / 12;                                               // the sum of the rows (t < 144): input row Y
  const int r0 = max(0, gY - 7), r1 = min(4, gY);                      // the rows r whose y = Y - r is in 0..7
  float acc[25];   // a weight-gradient thread's sums over the images; a data-gradient thread's over one image
#pragma unroll
  for (int i = 0; i < 25; ++i) acc[i] = 0.f;
  float bacc = 0.f, bacc1 = 0.f;
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
      if (i < S2_POOLED) {   // window (k, pi, pj) = (i / 16, i / 4 % 4, i % 4): its 2 x 2 conv gradient
        const int q = arg_q(nq[j]);
        const float g = arg_g(nq[j], ng[j]);
        float* d = sd + (i >> 4) * S2D_DS + ((i >> 2) & 3) * 2 * S2D_RS + (i & 3) * 2;
        *reinterpret_cast<float2*>(d) = make_float2(q == 0 ? g : 0.f, q == 1 ? g : 0.f);
        *reinterpret_cast<float2*>(d + S2D_RS) = make_float2(q == 2 ? g : 0.f, q == 3 ? g : 0.f);
        sg[i] = g;
      }
    }
    __syncthreads();
    if (n + gridDim.x < N) fetch(n + gridDim.x);
    if (t < 96) {
      const float* xc = sx + wc * 144;
      const float* dk = sd + wk * S2D_DS;
#pragma unroll s2d_y_unroll
      for (int y = 0; y < 8; ++y) {
        float d[8];
        s2d_row8(d, dk + y * S2D_RS);
#pragma unroll
        for (int r = 0; r < WR; ++r) {
          float xr[12];   // x[c, y + r, 0..11]
          s2d_row12(xr, xc + (y + r) * 12);
          s2d_taps(acc + r * 5, d, xr);
        }
      }
      if (V == 4 && t < 16) {   // lane t starts at window t: the 16 lanes' loads lie in 16 distinct banks
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) a += sg[t * 16 + ((i + t) & 15)];
        bacc += a;
      }
    } else if (BALANCED && wb < 24) {   // row r = 4 of (k, c) = ((wb & 3) * 4 + i, wb >> 2), i = 0..3
      const float* xc = sx + (wb >> 2) * 144 + 4 * 12;
      const float* dk = sd + (wb & 3) * 4 * S2D_DS;
#pragma unroll s2d_y_unroll
      for (int y = 0; y < 8; ++y) {
        float xr[12];   // x[c, y + 4, 0..11]
        s2d_row12(xr, xc + y * 12);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float d[8];
          s2d_row8(d, dk + i * S2D_DS + y * S2D_RS);
          s2d_taps(acc + i * 5, d, xr);
        }
      }
    } else if (BALANCED && t < D0) {   // bias: thread 120 + j owns channels 2 j and 2 j + 1, each from window k
      const int k = (t - 120) * 2;     // (16 distinct banks across the 8 lanes for either channel)
      float a = 0.f, b = 0.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        a += sg[k * 16 + ((i + k) & 15)];
        b += sg[(k + 1) * 16 + ((i + k + 1) & 15)];
      }
      bacc += a;
      bacc1 += b;
    } else if (t >= D0 && du < 120) {
      float (&a)[2][12] = *reinterpret_cast<float (*)[2][12]>(acc);   // Note [one set of sums]
      const float* wd = swd + dcr * 8;
      s2d_data_rows<240, 240, s2d_k_unroll>(a, wd, wd + 4, sd + dq * 2 * S2D_RS);
      float* p = sp + dcr * S2D_PS + dq * 24;
#pragma unroll
      for (int y = 0; y < 2; ++y)
#pragma unroll
        for (int X = 0; X < 12; ++X) p[y * 12 + X] = a[y][X];
    }
    __syncthreads();
    if (t < 144) {   // input position (c, Y, X): (c, r)'s row Y - r at (c * 5 + r) * S2D_PS + (Y - r) * 12 + X
#pragma unroll
      for (int c = 0; c < 6; ++c) {
        const float* q = sp + c * 5 * S2D_PS + t;
        float v = 0.f;
#pragma unroll
        for (int r = 0; r < 5; ++r)
          if (r >= r0 && r <= r1) v += q[r * (S2D_PS - 12)];
        dx[(size_t)n * S2_IMAGE + c * 144 + t] = sx[c * 144 + t] > 0.f ? v : 0.f;
      }
    }
  }
  const bool direct = gridDim.x == 1;   // the block's sums are the gradients
  float* mine = direct ? dw : part + (size_t)blockIdx.x * (S2_WEIGHTS + 16);
  float* bias = direct ? db : mine + S2_WEIGHTS;
  if (t < 96) {
#pragma unroll
    for (int i = 0; i < WR * 5; ++i) mine[wk * 150 + wc * 25 + i] = acc[i];
  }
  if (V == 4 && t < 16) bias[t] = bacc;
  if (BALANCED && t >= 96 && t < 120) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int s = 0; s < 5; ++s) mine[((wb & 3) * 4 + i) * 150 + (wb >> 2) * 25 + 20 + s] = acc[i * 5 + s];
  }
  if (BALANCED && t >= 120 && t < D0) {
    bias[(t - 120) * 2] = bacc;
    bias[(t - 120) * 2 + 1] = bacc1;
  }
}

// One kernel a module (S2D_VERSION), written out: tests/test_engines_cpu.py reads each kernel's first
// statement from this text (Note [programmatic launch] in lenet/kernels/launch.py).
#if S2D_VERSION == 5
extern "C" __global__ void __launch_bounds__(256, S2D_MIN_BLOCKS)
stage2_backward_balanced_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                const unsigned char* __restrict__ arg, const float* __restrict__ dp,
                                float* __restrict__ dx, float* __restrict__ part, float* __restrict__ dw,
                                float* __restrict__ db, int N, int ps) {
  stage2_backward_dense<5>(x, w, arg, dp, dx, part, dw, db, N, ps);
}
#else
extern "C" __global__ void __launch_bounds__(224, S2D_MIN_BLOCKS)
stage2_backward_dense_kernel(const float* __restrict__ x, const float* __restrict__ w,
                             const unsigned char* __restrict__ arg, const float* __restrict__ dp,
                             float* __restrict__ dx, float* __restrict__ part, float* __restrict__ dw,
                             float* __restrict__ db, int N, int ps) {
  stage2_backward_dense<4>(x, w, arg, dp, dx, part, dw, db, N, ps);
}
#endif
