// module stage2_backward_roles: stage=conv2 direction=backward version=7 threads=256 arch=80 uses=stage_common,tf32,stage2_tiles smem=14056
// module stage2_backward_roles3: stage=conv2 direction=backward version=8 threads=256 arch=80 define=S2R_VERSION=8 uses=stage_common,tf32,stage2_tiles smem=14056
// Stage 2's dense backward, versions 7 and 8 (Note [two roles]; version 8 is version 7 budgeted for three
// blocks an SM, Note [three blocks an SM]): version 6's sums (dev/conv2_backward_v6.cu: the same
// products in the same order, every output bit-identical to version 6's), its warps in two roles that
// hand each image over through two buffers at named barriers. Same arguments, partial rows and determinism as
// stage2_backward_dense.cu; its shared memory (56,224 bytes) is dynamic, beyond the 48 KiB a kernel
// gets without asking (lenet/kernels/launch.py asks).
//   A block owns images blockIdx.x, blockIdx.x + gridDim.x, ... of its model (image j of the block in
//   buffer j & 1), their dx, and row blockIdx.x of part. In its prologue thread t copies the weights' words
//   t, t + 256, ... (taps 0..3, then tap 4) and writes the planes' ones t, t + 256, ...; data thread u its
//   first image's pieces (as below).
//   Tensor warps (threads 0..127): the weight and bias gradients of image j as version 6's products, warp w
//   its N tiles w, w + 4, .. w + 16 (lane (g, q) their C fragments' rows g, g + 8 and columns 2q, 2q + 1:
//   image j's in img[0..19] from zero, added to the block's sums acc[0..19] once its products are done),
//   the three products of a k-step a kind at a time over the five tiles; the A fragments split from the
//   buffer's sd as they are loaded.
//   Data warps (threads 128..255, u = t - 128): version 6's data gradient of image j (unit u < 120:
//   (c, r, quarter) = (u / 20, u / 4 % 5, u & 3)) into sp, the rows' sums of input quads u and u + 128
//   (< 216) into dx, masked; then image j + 1 into the other buffer: its pieces u, u + 128, u + 256 (of
//   296) copied from global memory into the stage (cp.async) an image ahead, the image split into the
//   buffer's planes and mask (quads u, u + 128) and its pooled gradient expanded into the buffer's sd
//   (windows u, u + 128).
//
// Note [two roles]: version 6's eight warps meet at three block barriers an image, and the four tensor
// warps, whom the schedulers select less often than the FFMA warps, finished last: in ncu's samples at
// 65536 images 18% of the warps' time was the data warps waiting at the barrier after the products. Here
// the roles wait only for a buffer: the data warps fill buffer b ^ 1 with image j + 1 while the tensor
// warps run image j's products from buffer b, and a buffer is filled again once the tensor warps have
// arrived at S2R_EMPTY + b. Barriers (bar.sync / bar.arrive with a thread count): S2R_D among the data
// warps (128), S2R_FULL + b (the data warps arrive, the tensor warps wait: 256), S2R_EMPTY + b (the
// tensor warps arrive, the data warps wait: 256), each arrival matched by a wait.
// As first written it was level with version 6, issue-bound, with the barrier stall cut by half; Note
// [fewer instructions] has what made it faster (docs/kernels.md, "Stage 2's backward", has the timings).
//
// Note [fewer instructions]: what an image costs tracks the instructions issued for it (removing the FFMA
// data gradient, about half of them, took about half of an image's time), so three changes cut
// instructions that did no arithmetic, each keeping every output bit-identical:
//   - the tensor warps' eight k-steps unrolled whole (S2R_Y_UNROLL): a step's loads take their offsets as
//     immediates, 60 instructions a step where the loop took 76 (a few tile offsets spill, reloaded once an
//     image);
//   - the data gradient's channel loop advances its three pointers (s2d_data_rows) and runs two channels a
//     step (S2R_K_UNROLL, four since): 3 instructions of loop a channel where there were 9 (44 bytes spilled,
//     reloaded once an image);
//   - the prologue's copies, the weights' (4 bytes each) and the first image's, all in flight at once
//     (Note [one round trip]).
// Together about 6% faster than version 6 at large batches.
// Then the data warps' other work, counted in SASS (a data thread's instructions an image, the FFMA loop
// apart): 457 of them besides the loop, of which ~110 made fetch's addresses. Now (every output still
// bit-identical, stage_kernels.py --same compares bits):
//   - fetch: a data thread's three sources (x's, arg's or dp's piece for image 0) and their step an image
//     worked out once; an image's address is one multiply-add (IMAD.WIDE) each;
//   - constants a thread keeps (s2r_kept: the window offset, the sources), where the compiler had worked
//     them out again every image;
//   - dx's rows summed from the first that counts (ra) rather than added to zeros, and masked by prmt's sign
//     spread and an AND where a byte was extracted, compared and selected;
//   - the channel loop four channels a step (S2R_K_UNROLL), its first four apart so that a's zeros fold into
//     their multiply-adds (s2d_data_rows: no 24 registers cleared an image; 32 bytes spilled).
// A data thread 1,881 -> 1,706 instructions an image, a tensor warp 483 -> 473: 9,456 -> 8,716 warp
// instructions an image (-7.8%), and about as much faster. Tried and dropped: the mask kept in registers
// (more spills), the blocks' images weighted by wave (blocks do not share an SM by blockIdx modulo the SM
// count, so some SMs got the heavy ones together). Timings: docs/kernels.md, "Stage 2's backward".
//
// Note [one round trip]: a block's prologue copied the weights through registers (loads, then stores, a
// loop of 7.5 rounds that the compiler unrolled by four: three round trips to L2), and only then sent
// the first image's copies: four round trips before the first fill. Now every copy of the prologue is a
// cp.async sent before any is waited for: the prologue is one round trip (scripts/probes/stage2_timeline.py).
//
// Where the rest of a launch goes (stage2_timeline.py): each SM's blocks end in the order of their blockIdx
// (the warp schedulers favour the oldest block's warps), so at the end each SM runs one block alone, more
// slowly. Balancing that needs images moved between blocks at run time: the weight gradient's products cannot
// move (a block's partial row sums its own images in a fixed order: deterministic sums), its data gradient
// could (dx is per image); not tried (docs/kernels.md, "Stage 2's backward").
//
// Note [three blocks an SM]: version 8 is this file compiled with S2R_VERSION=8: __launch_bounds__(256, 3)
// in place of (256, 4), so ptxas has 80 registers a thread where it had 64 (version 7 spilled 32 bytes,
// reloaded each image; version 8 spills none), and the data gradient's channel loop eight channels a step
// (S2R_K_UNROLL) where the 64-register budget held four. Its sums are version 7's, in the same order:
// every output bit-identical (stage_kernels.py --same, 1,024 to 65,536 images, every grid). Four blocks
// no longer fit an SM's registers, so it runs three an SM (g3, 24 warps) or two (g2); its fill of an SM is
// 168 of 228 KiB of shared memory. Faster than version 7 from about 2,000 images on (docs/kernels.md,
// "Stage 2's backward").
// HEURISTIC (lenet/kernels/stages.py) takes its g3 from 32 images per SM; below that version 7 stays, whose
// g2 ran beside the head's kernels of a whole step (heuristic_rows.py), which version 8 has not yet.
//
// Note [an image's own sums]: the tensor cores' float32 accumulation (mma.sync, TF32 operands, float32
// accumulators) does not round to nearest: the error of a sum carried across images grew linearly with
// the images a block sums, as a directed rounding's does (round to nearest's grows as their square root).
// With one accumulator per tile across all of a block's images, the step's conv2 weight gradient at its
// own decisions was, in relative L2 from float64 (scripts/probes/bwd_numerics.py), up to 1e-5 at 8192
// images and 8.8e-5 at 65536 (docs/kernels.md, "Note [an image's own sums]"): over the tests' 1e-5 and the
// search's 3e-5 (descriptors/exact.py), which the plan-time check, at 256 images and a block an image, never saw
// (Note [checking a stage] in lenet/engines/reference.py now also runs one block over all 256). So the
// tensor warps sum each image's products (24 mma a tile: 8 k-steps of three products) into registers of
// their own, from zero, and add those to the block's sums in FADDs (round to nearest): below 4e-7 on every
// grid. Version 6 (dev/conv2_backward_v6.cu) does the same, so versions 6 to 8 keep the same sums in the
// same order. It costs 1-2% (version 8) and 3% (version 7, whose 64 registers now spill 120 bytes).
#define S2R_PS 100                        // sp's (c, r) stride: rows of 12 on 16-byte boundaries
#define S2R_SD (16 * S2D_DS)              // one buffer's conv gradient (floats)
#define S2R_PLANES (2 * S2D_XP)           // one buffer's image planes, big then small (words)
#define S2R_SWD 0                         // the dynamic shared memory's arrays (words): the weights' taps 0..3,
#define S2R_SWD4 (S2R_SWD + 16 * 30 * 4)  // tap 4,
#define S2R_SP (S2R_SWD4 + 16 * 30)       // the data gradient's partial rows,
#define S2R_SDB (S2R_SP + 30 * S2R_PS)    // the buffers' conv gradients,
#define S2R_X (S2R_SDB + 2 * S2R_SD)      // their image planes,
#define S2R_MASK (S2R_X + 2 * S2R_PLANES) // their masks (bytes),
#define S2R_STAGE (S2R_MASK + 2 * S2_IMAGE / 4)   // the next image's x, arg (bytes) and dp, as copied
#define S2R_WORDS (S2R_STAGE + S2_IMAGE + S2_POOLED / 4 + S2_POOLED)   // 14056: the module's smem
#define S2R_D 2
#ifndef S2R_VERSION
#define S2R_VERSION 7
#endif
#if S2R_VERSION == 7                      // four blocks an SM: 64 registers, four channels a step
#define S2R_KERNEL stage2_backward_roles_kernel
#define S2R_BLOCKS_AS_DECLARED 4
#define S2R_K_AS_DECLARED 4
#elif S2R_VERSION == 8                    // three blocks an SM: 80 registers, eight (Note [three blocks an SM])
#define S2R_KERNEL stage2_backward_roles3_kernel
#define S2R_BLOCKS_AS_DECLARED 3
#define S2R_K_AS_DECLARED 8
#else
#error "S2R_VERSION must be 7 or 8"
#endif
#ifndef S2R_MIN_BLOCKS                    // blocks an SM the registers are budgeted for (a probe's -D may set it)
#define S2R_MIN_BLOCKS S2R_BLOCKS_AS_DECLARED
#endif
#ifndef S2R_K_UNROLL
#define S2R_K_UNROLL S2R_K_AS_DECLARED
#endif
#ifndef S2R_Y_UNROLL
#define S2R_Y_UNROLL 8
#endif
#define S2R_FULL 3
#define S2R_EMPTY 5

__device__ __forceinline__ void s2r_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void s2r_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }

// v, computed once: the compiler neither folds it nor computes it again where it is used.
__device__ __forceinline__ int s2r_kept(int v) { asm volatile("mov.b32 %0, %0;" : "+r"(v)); return v; }
__device__ __forceinline__ const char* s2r_kept(const char* p) {
  asm volatile("mov.b64 %0, %0;" : "+l"(p));
  return p;
}

// v where mask byte sel & 3 of m is 0xff, 0 where it is 0: prmt's sel (0x8888 for byte 0, 0x9999 for byte 1,
// ..) spreads that byte's top bit over a word, which masks v's bits.
__device__ __forceinline__ float s2r_masked(float v, unsigned m, unsigned sel) {
  unsigned w;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(w) : "r"(m), "r"(sel));
  return __uint_as_float(__float_as_uint(v) & w);
}

// 16 bytes from global memory into shared memory without registers (cp.async, sm_80 and later); the
// copies a thread sent complete at its s2r_copies_done().
__device__ __forceinline__ void s2r_copy16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void s2r_copies_sent() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void s2r_copies_done() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// 4 bytes from global memory into shared memory (cp.async .ca: 4-byte pieces go through L1).
__device__ __forceinline__ void s2r_copy4(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}

extern "C" __global__ void __launch_bounds__(256, S2R_MIN_BLOCKS)
S2R_KERNEL(const float* __restrict__ x, const float* __restrict__ w, const unsigned char* __restrict__ arg,
           const float* __restrict__ dp, float* __restrict__ dx, float* __restrict__ part, float* __restrict__ dw,
           float* __restrict__ db, int N, int ps) {
  griddep_entry();
  PACK_MODEL(x, (size_t)N * S2_IMAGE); PACK_MODEL(w, ps); PACK_MODEL(arg, (size_t)N * S2_POOLED);   // Note [model from the grid]
  PACK_MODEL(dp, (size_t)N * S2_POOLED); PACK_MODEL(dx, (size_t)N * S2_IMAGE);
  PACK_MODEL(part, (size_t)gridDim.x * (S2_WEIGHTS + 16)); PACK_MODEL(dw, ps); PACK_MODEL(db, ps);
  extern __shared__ __align__(16) float s2r_smem[];
  unsigned smem_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
  if (smem_bytes < 4 * S2R_WORDS) __trap();   // launched with less than the module declares
  float* const swd = s2r_smem + S2R_SWD;
  float* const swd4 = s2r_smem + S2R_SWD4;
  float* const sp = s2r_smem + S2R_SP;
  unsigned* const planes = reinterpret_cast<unsigned*>(s2r_smem + S2R_X);
  unsigned char* const smask = reinterpret_cast<unsigned char*>(s2r_smem + S2R_MASK);
  const int t = threadIdx.x;
  const int count = blockIdx.x < N ? (N - 1 - blockIdx.x) / gridDim.x + 1 : 0;   // the block's images
  float* const stx = s2r_smem + S2R_STAGE;   // the next image as copied: x, arg, dp
  const unsigned char* const starg = reinterpret_cast<const unsigned char*>(stx + S2_IMAGE);
  const float* const stdp = stx + S2_IMAGE + S2_POOLED / 4;
  const int du = t - 128, dcr = du >> 2, dq = du & 3;   // a data thread's u and unit (c, r, quarter) as version 6's
  // A data thread's pieces du, du + 128, du + 256 (of 296) of image 0: x's, then arg's, then dp's, and the
  // bytes from one image's piece to the next's: fetch's addresses are one multiply-add each (Note [fewer
  // instructions]).
  const int c1 = du + 128, c2 = du + 256;
  const char* const src0 = s2r_kept(reinterpret_cast<const char*>(x + 4 * du));
  const char* const src1 = s2r_kept(c1 < S2_IMAGE / 4 ? reinterpret_cast<const char*>(x + 4 * c1)
                                    : c1 < S2_IMAGE / 4 + S2_POOLED / 16
                                        ? reinterpret_cast<const char*>(arg + 16 * (c1 - S2_IMAGE / 4))
                                        : reinterpret_cast<const char*>(dp + 4 * (c1 - S2_IMAGE / 4 - S2_POOLED / 16)));
  const unsigned step1 = s2r_kept(c1 < S2_IMAGE / 4 ? 4 * S2_IMAGE : c1 < S2_IMAGE / 4 + S2_POOLED / 16 ? S2_POOLED : 4 * S2_POOLED);
  const char* const src2 = s2r_kept(reinterpret_cast<const char*>(dp + 4 * (c2 - S2_IMAGE / 4 - S2_POOLED / 16)));
  const bool has2 = c2 < S2_IMAGE / 4 + S2_POOLED / 16 + S2_POOLED / 4;   // c2 >= 256 is always one of dp's, if any
  auto fetch = [&](int j) {   // image j's 16-byte pieces du, du + 128, du + 256 into the stage
    const unsigned n = blockIdx.x + j * gridDim.x;
    s2r_copy16(stx + 4 * du, src0 + (size_t)n * (4 * S2_IMAGE));
    s2r_copy16(stx + 4 * c1, src1 + (size_t)n * step1);
    if (has2) s2r_copy16(stx + 4 * c2, src2 + (size_t)n * (4 * S2_POOLED));
    s2r_copies_sent();
  };
  // The first image's copies and the weights' all in flight at once (Note [one round trip]).
  if (t >= 128 && count > 0) fetch(0);
  for (int i = t; i < 16 * 30 * 4; i += 256) s2r_copy4(swd + i, w + (i >> 2) * 5 + (i & 3));
  for (int i = t; i < 16 * 30; i += 256) s2r_copy4(swd4 + i, w + i * 5 + 4);
  s2r_copies_sent();
  for (int i = t; i < 2 * (S2D_XP - S2D_ONES); i += 256) {   // each buffer's region of ones
    unsigned* xb = planes + (i >= S2D_XP - S2D_ONES) * S2R_PLANES + S2D_ONES + i % (S2D_XP - S2D_ONES);
    xb[0] = 0x3f800000u;
    xb[S2D_XP] = 0u;
  }
  s2r_copies_done();
  __syncthreads();
  const bool direct = gridDim.x == 1;   // the block's sums are the gradients
  float* mine = direct ? dw : part + (size_t)blockIdx.x * (S2_WEIGHTS + 16);
  float* bias = direct ? db : mine + S2_WEIGHTS;
  if (t < 128) {   // the tensor warps: image j's products from buffer j & 1
    const int lane = t & 31, lg = lane >> 2, lq = lane & 3;
    float acc[20];
#pragma unroll
    for (int i = 0; i < 20; ++i) acc[i] = 0.f;
    int toff[5];   // the planes' offset of column 8 tile + g, tile = (t >> 5) + 4 i (s2d_column)
#pragma unroll
    for (int i = 0; i < 5; ++i) {
      const int col = 8 * ((t >> 5) + 4 * i) + lg;
      toff[i] = s2d_column(col) + lq;
    }
    for (int j = 0; j < count; ++j) {
      const int b = j & 1;
      float img[20];   // image j's sums, added to acc once its products are done (Note [an image's own sums])
#pragma unroll
      for (int i = 0; i < 20; ++i) img[i] = 0.f;
      s2r_sync(S2R_FULL + b, 256);   // buffer b holds image j
      const unsigned* const xb = planes + b * S2R_PLANES;
      const unsigned* const xs = xb + S2D_XP;
      const float* const sd = s2r_smem + S2R_SDB + b * S2R_SD;
#pragma unroll S2R_Y_UNROLL
      for (int y = 0; y < 8; ++y) {   // A[k, x] = dconv[k, y, x]: lane (g, q) k = g, g + 8 and x = q, q + 4
        const float* a = sd + lg * S2D_DS + y * S2D_RS + lq;
        const uint2 a0 = s2d_split(a[0]), a1 = s2d_split(a[8 * S2D_DS]), a2 = s2d_split(a[4]),
                    a3 = s2d_split(a[8 * S2D_DS + 4]);
        const unsigned ab[4] = {a0.x, a1.x, a2.x, a3.x}, as[4] = {a0.y, a1.y, a2.y, a3.y};
        unsigned bb[5][2];   // each tile's three products in version 6's order, the tiles side by side
#pragma unroll
        for (int i = 0; i < 5; ++i) {
          bb[i][0] = xb[toff[i] + y * 12];
          bb[i][1] = xb[toff[i] + y * 12 + 4];
        }
#pragma unroll
        for (int i = 0; i < 5; ++i) s2d_mma(img + 4 * i, as, bb[i][0], bb[i][1]);
#pragma unroll
        for (int i = 0; i < 5; ++i) s2d_mma(img + 4 * i, ab, xs[toff[i] + y * 12], xs[toff[i] + y * 12 + 4]);
#pragma unroll
        for (int i = 0; i < 5; ++i) s2d_mma(img + 4 * i, ab, bb[i][0], bb[i][1]);
      }
      if (j + 2 < count) s2r_arrive(S2R_EMPTY + b, 256);   // buffer b is free for image j + 2
#pragma unroll
      for (int i = 0; i < 20; ++i) acc[i] += img[i];
    }
#pragma unroll
    for (int i = 0; i < 5; ++i) s2d_store_tile(mine, bias, (t >> 5) + 4 * i, acc + 4 * i, lane);
  } else {   // the data warps: image j's data gradient from buffer j & 1, then image j + 1 into the other
    // window du's offset in sd: (k, pi, pj) = (du / 16, du / 4 % 4, du % 4); window du + 128's, 8 channels on
    const int wofs = s2r_kept((du >> 4) * S2D_DS + ((du >> 2) & 3) * 2 * S2D_RS + (du & 3) * 2);
    auto fill = [&](int b) {   // the staged image split into buffer b's planes and mask, its conv gradient into sd
      s2r_copies_done();
      s2r_sync(S2R_D, 128);   // the stage is complete
      unsigned* const xb = planes + b * S2R_PLANES;
      float* const sd = s2r_smem + S2R_SDB + b * S2R_SD;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = du + 128 * h;
        if (i < S2_IMAGE / 4) {
          const float4 v = *reinterpret_cast<const float4*>(stx + 4 * i);
          const uint2 p0 = s2d_split(v.x), p1 = s2d_split(v.y), p2 = s2d_split(v.z), p3 = s2d_split(v.w);
          *reinterpret_cast<uint4*>(xb + 4 * i) = make_uint4(p0.x, p1.x, p2.x, p3.x);
          *reinterpret_cast<uint4*>(xb + S2D_XP + 4 * i) = make_uint4(p0.y, p1.y, p2.y, p3.y);
          *reinterpret_cast<uchar4*>(smask + b * S2_IMAGE + 4 * i) =
              make_uchar4(v.x > 0.f ? 0xff : 0, v.y > 0.f ? 0xff : 0, v.z > 0.f ? 0xff : 0, v.w > 0.f ? 0xff : 0);
        }
        // window (k, pi, pj) = (i / 16, i / 4 % 4, i % 4): its 2 x 2 conv gradient
        const int q = arg_q(starg[i]);
        const float g = arg_g(starg[i], stdp[i]);
        float* d = sd + wofs + h * 8 * S2D_DS;
        *reinterpret_cast<float2*>(d) = make_float2(q == 0 ? g : 0.f, q == 1 ? g : 0.f);
        *reinterpret_cast<float2*>(d + S2D_RS) = make_float2(q == 2 ? g : 0.f, q == 3 ? g : 0.f);
      }
      s2r_sync(S2R_D, 128);            // buffer b is complete, the stage read
      s2r_arrive(S2R_FULL + b, 256);   // and the tensor warps' to read
    };
    if (count > 0) {
      fill(0);
      if (count > 1) fetch(1);
    }
    for (int j = 0; j < count; ++j) {
      const int b = j & 1;
      const size_t n = blockIdx.x + (size_t)j * gridDim.x;
      if (du < 120) {
        const float* const sd = s2r_smem + S2R_SDB + b * S2R_SD;
        float a[2][12];
        s2d_data_rows<120, 30, S2R_K_UNROLL>(a, swd + dcr * 4, swd4 + dcr, sd + dq * 2 * S2D_RS);
        float* p = sp + dcr * S2R_PS + dq * 24;
#pragma unroll
        for (int y = 0; y < 2; ++y)
#pragma unroll
          for (int X = 0; X < 12; X += 4)
            *reinterpret_cast<float4*>(p + y * 12 + X) = make_float4(a[y][X], a[y][X + 1], a[y][X + 2], a[y][X + 3]);
      }
      s2r_sync(S2R_D, 128);   // sp is complete
#pragma unroll
      for (int h = 0; h < 2; ++h) {   // input positions (c, Y, X0 .. X0 + 3) of quad u
        const int u = du + 128 * h;
        if (u < S2_IMAGE / 4) {
          const int c = u / 36, Y = u / 3 % 12, X0 = u % 3 * 4;
          const int ra = max(0, Y - 7), rb = min(4, Y);   // the rows r whose y = Y - r is in 0..7
          const float* q = sp + c * 5 * S2R_PS + Y * 12 + X0;
          float4 v = *reinterpret_cast<const float4*>(q + ra * (S2R_PS - 12));   // the sum from row ra on
#pragma unroll
          for (int r = 1; r < 5; ++r)
            if (r > ra && r <= rb) {
              const float4 e = *reinterpret_cast<const float4*>(q + r * (S2R_PS - 12));
              v.x += e.x; v.y += e.y; v.z += e.z; v.w += e.w;
            }
          const unsigned m = *reinterpret_cast<const unsigned*>(smask + b * S2_IMAGE + 4 * u);   // bytes 0 or 0xff
          *reinterpret_cast<float4*>(dx + n * S2_IMAGE + 4 * u) =
              make_float4(s2r_masked(v.x, m, 0x8888), s2r_masked(v.y, m, 0x9999), s2r_masked(v.z, m, 0xaaaa),
                          s2r_masked(v.w, m, 0xbbbb));
        }
      }
      if (j + 1 < count) {   // image j + 1 into the other buffer, once the tensor warps are done with image j - 1
        if (j >= 1) s2r_sync(S2R_EMPTY + (b ^ 1), 256);
        fill(b ^ 1);   // (its first barrier also keeps sp's and the mask's reads of image j before what follows)
        if (j + 2 < count) fetch(j + 2);
      } else {
        s2r_sync(S2R_D, 128);
      }
    }
  }
}
