// module stage2_backward_split4: stage=conv2 direction=backward version=3 threads=640 define=S2B_KS=4 uses=stage_common
// Stage 2 backward through the argmax: data gradient (masked by x > 0), weight and bias gradients. The
// block's four parts (KS = 4, 640 threads) each take 16 / KS of the output channels (k), so one image's
// work is done by four times the threads in about a quarter of the time: the heuristic's version at
// small batches where the tensor-core versions cannot run (compute capability 7.5: docs/kernels.md,
// "Stage 2's backward"). Versions 1 and 2 (KS = 1, 2: 160 and 320 threads) are in dev/.
// One image per block iteration.
//   Weight gradient: thread t < 150 KS owns filter tap u = (c, r, s) = (u / 25, u % 25 / 5, u % 5),
//   u = s2b_taps.u[t % 150] (Note [shared-memory banks]), for the 16 / KS channels k of its part
//   h = t / 150: sums in registers, each over the channel's 16 pooled positions.
//   Bias gradient: thread t < 16 owns channel t.
//   Data gradient: thread t < 144 KS owns input position (yy, xx) = (u / 12, u % 12), u = t % 144,
//   all 6 channels, over the channels k of its part h = t / 144: for each k, the 3 x 3 windows
//   around it whose argmax may lie within the filter's reach, each visited whether it does or not
//   (a zero gradient where not): no branch on data, so the visits unroll and their loads overlap (a
//   loop that branched was slower: docs/kernels.md, "Stage 2's backward"). With
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
                                                float* __restrict__ dw, float* __restrict__ db, int N, int ps) {
  griddep_entry();
  PACK_MODEL(x, (size_t)N * S2_IMAGE); PACK_MODEL(w, ps); PACK_MODEL(arg, (size_t)N * S2_POOLED);   // Note [model from the grid]
  PACK_MODEL(dp, (size_t)N * S2_POOLED); PACK_MODEL(dx, (size_t)N * S2_IMAGE);
  PACK_MODEL(part, (size_t)gridDim.x * (S2_WEIGHTS + 16)); PACK_MODEL(dw, ps); PACK_MODEL(db, ps);
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
        const int pos = i & 15, q = arg_q(nq[j]);
        const int y = 2 * (pos >> 2) + (q >> 1), xc = 2 * (pos & 3) + (q & 1);
        sgo[i] = make_float2(arg_g(nq[j], ng[j]), __int_as_float((y * S2_RS + xc) | y << 16 | xc << 24));
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

// The one version this file ships (S2B_KS, set by its declaration). dev/conv2_backward_v1_v2.cu compiles this
// file before its own (uses=) for the template's other instances, KS = 1 and 2.
#if S2B_KS == 4
// Note [registers of the split kernel]: 640 threads at 72 registers take 46 K of an SM's 64 K
// registers, and leave room for a block of the head's weight-gradient kernel, which runs beside the
// stages' backward on the side stream (Note [side stream] in lenet/engines/context.py). Left to ptxas,
// __launch_bounds__(640, 1) took 96 registers: the whole register file, so at batch 128 (a grid of
// 128 blocks) the side stream waited and the step was slower (docs/kernels.md, "Stage 2's backward").
// __launch_bounds__(640) alone took 48 registers and spilled.
extern "C" __global__ void __maxnreg__(72)
stage2_backward_split4_kernel(const float* __restrict__ x, const float* __restrict__ w,
                              const unsigned char* __restrict__ arg, const float* __restrict__ dp,
                              float* __restrict__ dx, float* __restrict__ part, float* __restrict__ dw,
                              float* __restrict__ db, int N, int ps) {
  stage2_backward<4>(x, w, arg, dp, dx, part, dw, db, N, ps);
}
#elif S2B_KS != 1 && S2B_KS != 2
#error "S2B_KS must be 4 (versions 1 and 2, KS = 1 and 2, are dev/conv2_backward_v1_v2.cu's)"
#endif
