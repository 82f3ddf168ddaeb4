// (versions 4 and 5 ship: lenet/kernels/stage2_backward_dense.cu; this is the file as it was when all three did.)
// module stage2_backward_tensor: stage=conv2 direction=backward version=6 threads=256 arch=80 define=S2D_VERSION=6 uses=stage_common,tf32,stage2_tiles
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
//   Version 6 (256 threads, Note [three tf32 products] in tf32.cu): version 5's data gradient (thread 128 + u
//   its unit u) and sum of the rows (thread t < 144); warp w < 4 the weight and bias gradients' N tiles w,
//   w + 4, .. w + 16 on the tensor cores, lane (g, q) their C fragments' rows g, g + 8 and columns 2q, 2q + 1.
//   Thread t < 216 loads and stores, split, x[4 t .. 4 t + 3] and its mask; thread t expands window t into
//   sd and into its A fragment words of sa. Its shared arrays: the image split (sxb: big, then small),
//   its mask (smask), the conv gradient's A fragments (sa), the weights' taps s = 0..3 (swd) and 4 (swd4).
// Shared: sx (6 x 144) the image; sd (16 x S2D_DS) the conv gradient, channel k's row y at
// k * S2D_DS + y * S2D_RS; sg (256) the pooled gradients (bias); swd the weights as w[k, c, r, 0..4] at
// (k * 30 + c * 5 + r) * 8 (16-byte rows); sp (30 x S2D_PS) the data gradient's partial rows, (c, r)'s
// row y at (c * 5 + r) * S2D_PS + y * 12.
//
// Note [dense stage backward]: stage2_backward.cu routes each pooled gradient through its argmax: a
// quarter of the multiply-adds, but each one reads shared memory at a data-dependent address (the
// weight gradient the image at the argmax, the data gradient the weight at the argmax's offset), and
// it is bound by shared-memory wavefronts (~7,600 per image: 36 ns per image at 8192 on an H100).
// Here the argmax decides only where the expansion writes; the sums then run over every conv position
// (3 in 4 of their terms are exact zeros: 0 * v adds nothing to a finite sum), with the loop indices
// known at compile time, so a thread's operands are registers loaded once per row: the weight gradient
// reads a row of x (3 x 16 bytes) and uses it for 40 multiply-adds, the data gradient a row of the
// conv gradient (2 x 16 bytes, broadcast) for 40. 307 K multiply-adds per image against 77 K, and
// ~990 shared loads (3,250 wavefronts by ncu) against ~7,600 wavefronts.
// On an H100 (scripts/probes/stage_kernels.py, 4 blocks per SM): 19.7 / 17.5 ns per image at 8192 /
// 65536 against the routed version's 38.9 / 36.0. ncu at 8192: 12,670 instructions per image (9,600 of
// them multiply-adds), 0.63 issued per scheduler and cycle, the largest stall the barriers (2.4 of 9.1
// cycles per instruction: the weight warps' 1,600 multiply-adds an image against the data warps' 1,280),
// shared memory at 67% of its wavefronts. Tried and within 3%: the weight gradient keeping rows y .. y + 4
// in registers (a third of its loads; 96 registers, 3 blocks per SM), 3 blocks per SM without it, other
// unroll depths, sd's rows at 8 floats (a 2-way bank conflict of the data gradient's row loads).
//
// Note [one set of sums]: a thread is of one kind, but registers are allocated for the kernel: with
// the weight gradient's 25 sums and the data gradient's 24 in two arrays, both were live across the
// image loop in every thread (96 registers, spilling at the 72 that four blocks per SM allow). The
// data gradient's sums therefore live in the first 24 of acc, zeroed at each image (72 registers and a
// spill of 44 bytes, into L1; 3 blocks per SM at 80 registers and no spill measured within 3%).
// Note [balanced stage backward]: in version 4 a weight-gradient thread does 1,600 multiply-adds an
// image and a data-gradient thread 1,280, so at each image's barrier the data warps wait a fifth of the
// time (barrier stalls 2.4 of 9.1 cycles per instruction). Version 5 takes each (k, c)'s fifth tap row
// off its thread: 24 more threads each take the r = 4 rows of four (k, c) of one channel c (one input row
// and four conv-gradient rows a step), so every thread does 1,280 (the bias moves to the 8 threads left
// over). 256 threads at 64 registers, 4 blocks per SM; the data gradient's channel loop unrolled by 1
// (by 2 it spilled 64 bytes). On an H100 (scripts/probes/stage_kernels.py, 2026-11-25), us, v4 / v5:
// 25.0 / 22.9 at 512 images (g2), 34.7 / 30.7 at 1024, 53.0 / 47.6 at 2048, 91.7 / 82.7 at 4096,
// 159.7 / 150.9 at 8192 (18.4 ns per image), 1136 / 1068 at 65536 (16.3 ns); alike at 1 to 64 images.
// ncu at 8192 (3 blocks per SM): 0.71 issued per scheduler and cycle against 0.63; the largest stall now
// "not selected" (2.5 of 6.9 cycles): the schedulers' issue, no longer the barriers. Tried and lost: 3
// blocks per SM at 72 registers without the spill (16.5-16.9 ns at 65536, 18.4-19.2 at 8192; its g4 grid
// is 1.33 waves), the data warps alone summing the rows behind a named barrier of their own so that the
// weight warps go straight on (17.8-18.0 ns at 65536 at 4 blocks, 16.8-17.1 at 3: the weight warps then
// wait at the next image's barrier instead), two weight-gradient rows y a step (18.0-18.1 ns). Fewer
// instructions, slower (ncu at 65536: 13,450 instructions an image, 9,600 of them multiply-adds, issue 77%
// of the cycles; the largest stalls "not selected" 1.7, barrier 0.6, dispatch 0.5 cycles per instruction):
// the data gradient's channel loop unrolled whole, 16.8-16.9 ns at 65536 and 19.0 at 8192 (16.3 / 18.6 in
// the same run), with the rows r = 4 unrolled whole too 19.1 / 21.0; the data gradient's partial rows with
// zero rows between them, so that the sum over r needs no bounds, 17.1 / 19.2 (a position has 3.3 valid
// rows on average: its sum then loads 5); the bias summed by shuffles of the windows' gradients as they are
// stored (in place of 8 threads' loop), 19.2 / 21.4 (a spill at 64 registers); the rows' sum over 128
// threads, 7 positions each (in place of 144 threads, 6), 17.7 / 19.8.
#ifndef S2D_MIN_BLOCKS
#define S2D_MIN_BLOCKS 4   // blocks per SM the register budget is fitted to
#endif
#ifndef S2D_Y_UNROLL
#define S2D_Y_UNROLL 1     // the weight gradient's rows y per unrolled step (scripts/probes/stage_kernels.py)
#endif
#ifndef S2D_K_UNROLL        // the data gradient's channels k per unrolled step (the same probe): at 2,
#define S2D_K_UNROLL (S2D_VERSION > 4 ? 1 : 2)   // version 5 spilled 64 bytes at its 64 registers
#endif
#ifndef S2D_T_UNROLL
#define S2D_T_UNROLL 1     // version 6's k-steps y per unrolled step (the same probe)
#endif
constexpr int s2d_y_unroll = S2D_Y_UNROLL, s2d_k_unroll = S2D_K_UNROLL, s2d_t_unroll = S2D_T_UNROLL;   // #pragma unroll takes a constant
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

// Version 6's weight gradient on the tensor cores (Note [three tf32 products] in tf32.cu): per image the
// product dW[k, (c, r, s)] += sum over (y, x) of dconv[k, y, x] x[c, y + r, x + s]: M = 16 channels k,
// K = 64 conv positions (one k-step of 8 a row y), N = 150 taps (c, r, s) and one column of ones, whose
// sums are the bias gradient (columns 151..159 read any image values: their sums are not kept). The image
// is stored split once into two planes (sxb: big, then small), so a B fragment is four 4-byte loads,
// and the conv gradient's A fragments are stored split by the expansion (sa), two 16-byte loads a k-step.
//   Warp w < 4 owns N tiles w, w + 4, .. w + 16 (columns 8 tile .. 8 tile + 7), their C fragments in
//   acc[0..19] across the images, each image's summed on its own first (img[0..19], Note [an image's own
//   sums] in stage2_backward_roles.cu; since 2026-11-27, when version 6 began to spill 76 bytes: its
//   timings below are from before); lane (g, q) = (lane >> 2, lane & 3) holds, per tile, C[g, 2q],
//   C[g, 2q + 1], C[g + 8, 2q], C[g + 8, 2q + 1] (PTX's m16n8k8 fragment layout).
// On an H100 (scripts/probes/stage_kernels.py, 2026-11-25): 16.6 / 15.6 ns an image at 8192 / 65536 (4
// blocks per SM) against version 5's 18.6 / 16.4, 5.2 against 6.6 us at one image, 6.5 against 9.4 at 64.
// ncu at 65536: 10,050 instructions an image (version 5: 13,460), 480 of them tensor products; the four
// FFMA data-gradient warps (1,500 instructions an image each, against the tensor warps' 530) set its time.
// Both gradients on the tensor cores was slower (19.0 / 18.2 ns: docs/probes.md, stage_kernels.py, and the
// steps on the way here).
#define S2D_AY 284                  // sa's k-step stride (words); lane l's 8 words at y * S2D_AY + l * 8 + (l >> 2) * 4
                                    // (to 283): the expansion's stores meet a bank at most twice, the loads never

// The three layouts (S2D_VERSION, set per module by lenet/kernels/__init__.py): version 4's and 5's
// above, and version 6's: version 5's with the weight gradient (and the bias's) on warps 0..3.
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
  constexpr bool BALANCED = V == 5, TENSOR = V == 6;
  constexpr int THREADS = V == 4 ? 224 : 256;
  constexpr int WR = BALANCED ? 4 : 5;           // a (k, c) weight thread's tap rows r: 0 .. WR - 1
  constexpr int D0 = V == 4 ? 96 : 128;          // the first data-gradient thread
  constexpr int NX = (S2_IMAGE + THREADS - 1) / THREADS, NG = (S2_POOLED + THREADS - 1) / THREADS;
  __shared__ __align__(16) float sx[TENSOR ? 1 : S2_IMAGE];
  __shared__ __align__(4) unsigned char smask[TENSOR ? S2_IMAGE : 1];   // version 6: x > 0 (the rows' mask)
  __shared__ __align__(16) float sd[16 * S2D_DS];
  __shared__ float sg[TENSOR ? 1 : S2_POOLED];
  __shared__ __align__(16) float swd[TENSOR ? 16 * 30 * 4 : 16 * 30 * 8];   // version 6: taps s = 0..3 only
  __shared__ float swd4[TENSOR ? 16 * 30 : 1];                              // and s = 4 here
  __shared__ float sp[30 * S2D_PS];
  __shared__ __align__(16) unsigned sa[TENSOR ? 8 * S2D_AY : 1];   // version 6's A fragments (k-step, lane: big 4, small 4)
  __shared__ __align__(16) unsigned sxb[TENSOR ? 2 * S2D_XP : 1];   // and the image, big (then small at + S2D_XP)
  unsigned* const sxs = sxb + S2D_XP;
  const int t = threadIdx.x;
  if (TENSOR) {
    for (int i = t; i < 16 * 30 * 4; i += THREADS) swd[i] = w[(i >> 2) * 5 + (i & 3)];
    for (int i = t; i < 16 * 30; i += THREADS) swd4[i] = w[i * 5 + 4];
  } else {
    for (int i = t; i < 16 * 30 * 8; i += THREADS) swd[i] = (i & 7) < 5 ? w[(i >> 3) * 5 + (i & 7)] : 0.f;
  }
  if (TENSOR)
    for (int i = S2D_ONES + t; i < S2D_XP; i += THREADS) {
      sxb[i] = 0x3f800000u;
      sxs[i] = 0u;
    }
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
    if (TENSOR) {   // thread t < 216: x[4 t .. 4 t + 3] (16-byte aligned: stage_backward checks x)
      if (t < S2_IMAGE / 4) {
        const float4 v = *reinterpret_cast<const float4*>(x + (size_t)n * S2_IMAGE + 4 * t);
        nx[0] = v.x; nx[1] = v.y; nx[2] = v.z; nx[3] = v.w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < NX; ++j) {
        const int i = t + THREADS * j;
        if (i < S2_IMAGE) nx[j] = x[(size_t)n * S2_IMAGE + i];
      }
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
    if (TENSOR) {
      if (t < S2_IMAGE / 4) {
        const uint2 a = s2d_split(nx[0]), b = s2d_split(nx[1]), c = s2d_split(nx[2]), d = s2d_split(nx[3]);
        *reinterpret_cast<uint4*>(sxb + 4 * t) = make_uint4(a.x, b.x, c.x, d.x);
        *reinterpret_cast<uint4*>(sxs + 4 * t) = make_uint4(a.y, b.y, c.y, d.y);
        *reinterpret_cast<uchar4*>(smask + 4 * t) = make_uchar4(nx[0] > 0.f, nx[1] > 0.f, nx[2] > 0.f, nx[3] > 0.f);
      }
    } else {
#pragma unroll
      for (int j = 0; j < NX; ++j) {
        const int i = t + THREADS * j;
        if (i < S2_IMAGE) sx[i] = nx[j];
      }
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
        if (!TENSOR) sg[i] = g;
        if (TENSOR) {   // the same 2 x 2, split, into the A fragments: (k, y, x) is lane (k & 7) * 4 + (x & 3)'s
          const uint2 b = s2d_split(g);   // register (k >> 3) + 2 (x >> 2) of k-step y
          const int k = i >> 4;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int y = ((i >> 2) & 3) * 2 + (e >> 1), xx = (i & 3) * 2 + (e & 1);
            const int lane = (k & 7) * 4 + (xx & 3);
            unsigned* f = sa + y * S2D_AY + lane * 8 + (lane >> 2) * 4 + (k >> 3) + 2 * (xx >> 2);
            f[0] = q == e ? b.x : 0u;
            f[4] = q == e ? b.y : 0u;
          }
        }
      }
    }
    __syncthreads();
    if (n + gridDim.x < N) fetch(n + gridDim.x);
    if (TENSOR && t < 128) {   // k-step y: A = dconv[k, y, 0..7], B = x[c, y + r, s .. s + 7] (and the ones)
      const int lg = (t & 31) >> 2, lq = t & 3;   // lane (g, q) of warp t >> 5
      int toff[5];   // the planes' offset of column 8 tile + g, tile = (t >> 5) + 4 i, at (y, x) = (0, 0)
#pragma unroll
      for (int i = 0; i < 5; ++i) {   // (per image: kept across the loop, they cost the data threads a spill)
        const int col = 8 * ((t >> 5) + 4 * i) + lg;
        toff[i] = s2d_column(col) + lq;
      }
      float img[20];   // the image's sums, added to acc once its products are done (Note [an image's own sums])
#pragma unroll
      for (int i = 0; i < 20; ++i) img[i] = 0.f;
#pragma unroll s2d_t_unroll
      for (int y = 0; y < 8; ++y) {
        const unsigned* fa = sa + y * S2D_AY + (t & 31) * 8 + ((t & 31) >> 2) * 4;
        const uint4 fb = *reinterpret_cast<const uint4*>(fa), fs = *reinterpret_cast<const uint4*>(fa + 4);
        const unsigned ab[4] = {fb.x, fb.y, fb.z, fb.w}, as[4] = {fs.x, fs.y, fs.z, fs.w};
#pragma unroll
        for (int i = 0; i < 5; ++i) {
          const int b = toff[i] + y * 12;   // b0 = x[c, y + r, q + s], b1 = x[c, y + r, q + 4 + s]
          s2d_mma(img + 4 * i, as, sxb[b], sxb[b + 4]);
          s2d_mma(img + 4 * i, ab, sxs[b], sxs[b + 4]);
          s2d_mma(img + 4 * i, ab, sxb[b], sxb[b + 4]);
        }
      }
#pragma unroll
      for (int i = 0; i < 20; ++i) acc[i] += img[i];
    } else if (!TENSOR && t < 96) {
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
      const float* wd = swd + dcr * (TENSOR ? 4 : 8);
      s2d_data_rows<TENSOR ? 120 : 240, TENSOR ? 30 : 240, s2d_k_unroll>(a, wd, TENSOR ? swd4 + dcr : wd + 4,
                                                                         sd + dq * 2 * S2D_RS);
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
        dx[(size_t)n * S2_IMAGE + c * 144 + t] = (TENSOR ? smask[c * 144 + t] != 0 : sx[c * 144 + t] > 0.f) ? v : 0.f;
      }
    }
  }
  const bool direct = gridDim.x == 1;   // the block's sums are the gradients
  float* mine = direct ? dw : part + (size_t)blockIdx.x * (S2_WEIGHTS + 16);
  float* bias = direct ? db : mine + S2_WEIGHTS;
  if (TENSOR && t < 128) {   // tile (t >> 5) + 4 i's C[g + 8 h, 2 q + e] is acc[4 i + 2 h + e]
#pragma unroll
    for (int i = 0; i < 5; ++i) s2d_store_tile(mine, bias, (t >> 5) + 4 * i, acc + 4 * i, t & 31);
  }
  if (!TENSOR && t < 96) {
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
#if S2D_VERSION == 6
extern "C" __global__ void __launch_bounds__(256, S2D_MIN_BLOCKS)
stage2_backward_tensor_kernel(const float* __restrict__ x, const float* __restrict__ w,
                              const unsigned char* __restrict__ arg, const float* __restrict__ dp,
                              float* __restrict__ dx, float* __restrict__ part, float* __restrict__ dw,
                              float* __restrict__ db, int N, int ps) {
  stage2_backward_dense<6>(x, w, arg, dp, dx, part, dw, db, N, ps);
}
#elif S2D_VERSION == 5
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
