// LeNet's two stages, conv (5x5, valid) + bias + ReLU + 2x2/2 max-pool, forward and backward, each
// direction fused into one kernel (plus one small reduction for the weight and bias gradients).
// Launchers and the engine around them: lenet/engines/ours.py and lenet/kernels/stages.py. This file is what the stage modules
// share (each begins with it): stage1_forward.cu, stage2_forward.cu, stage2_forward_tiled.cu,
// stage1_backward_dense.cu, stage2_backward.cu, stage2_backward_dense.cu (two versions),
// stage2_backward_roles.cu (two) and stage_reduce.cu hold one kernel each (a module a version), compiled as
// modules of their own and in parallel (Note [first run] in lenet/kernels/nvrtc.py). The versions no
// generation's rows take are in dev/ (docs/kernels.md, "What ships").
//
// Layouts: NCHW float32. An argmax byte q = 2 * dy + dx names the position of a pooling window's
// maximum (dy, dx in {0, 1}); the first maximum in the order a00, a01, a10, a11 wins. Its bit 2
// (ARG_OFF) is set where the window's ReLU is off (Note [the ReLU bit]).
//   stage 1: x (N, 1, 28, 28), w (6, 1, 5, 5), b (6)   -> conv (N, 6, 24, 24) -> p (N, 6, 12, 12)
//   stage 2: x (N, 6, 12, 12), w (16, 6, 5, 5), b (16) -> conv (N, 16, 8, 8)  -> p (N, 16, 4, 4)
//
// Note [stage backward through the argmax]: the gradient below a 2x2 max-pool is nonzero at one
// position in four (the argmax), so the weight gradient sums over the pooled positions only,
// dw[k, c, r, s] = sum_(n, pi, pj) dp[n, k, pi, pj] * x[n, c, y + r, x + s] with (y, x) the window's
// argmax, and the data gradient gathers, for each input position, the at most 3 x 3 windows per
// output channel whose argmax lies within the filter's reach: a quarter of the multiply-adds of a
// dense weight or data gradient. The incoming dp is the gradient of the pooled output, masked here by
// this stage's ReLU (Note [the ReLU bit]); the data gradient is masked by the previous stage's ReLU,
// whose output is this stage's input x.
//
// Note [the ReLU bit]: ReLU commutes with the max-pool (Note [relu at the pooled level] in
// lenet/engines/cudnn.py), so a stage's ReLU mask is one bit per pooling window: the forward sets bit 2
// of the argmax byte where the pooled output is not > 0 (NaN included, as x > 0 is false for it), and
// the backward reads dp as 0 there (arg_g). So whatever computes dp need not mask it: the head's tail
// form leaves it to the stage (its dp2 comes from cuBLASLt, and a kernel of its own to mask it cost more
// than the bit: docs/kernels.md, "The head"). The head masks anyway where the stage below is cuDNN's,
// whose pooling backward reads no byte of ours (``masks_dy`` in lenet/engines/base.py).
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

// Note [model from the grid]: a pack of K models (lenet sweep) runs as one launch of gridDim.y = K.
// Model m's images are rows [m * N, (m + 1) * N) of every activation (N: images per model); its
// parameters and their gradients lie ps floats after model m - 1's (the flat buffers are (K, ps));
// its rows of partial sums, gridDim.x rows after model m - 1's. Each kernel moves its pointers to its
// model's first, and the rest of it is the one-model kernel. That is its pack version, a module of its
// own compiled with LENET_PACK (lenet/kernels/__init__.py: PACK); the one-model module compiles without
// the offsets, as it did before packs existed (with them, a lone model's step was slower: docs/kernels.md,
// "Note [one wave for a pack]").
#ifdef LENET_PACK
#define PACK_MODEL(ptr, per) ((ptr) = (ptr) ? (ptr) + (size_t)blockIdx.y * (size_t)(per) : (ptr))
#else
#define PACK_MODEL(ptr, per) ((void)0)
#endif

// ReLU of a window's maximum that keeps a NaN (fmaxf would turn it into 0 and hide a diverged run).
__device__ __forceinline__ float relu_keep_nan(float v) { return (v > 0.f || v != v) ? v : 0.f; }

#define ARG_OFF 4   // an argmax byte's bit: the window's ReLU is off (Note [the ReLU bit])

// The argmax byte of a window whose maximum is best, at position q.
__device__ __forceinline__ unsigned char arg_byte(int q, float best) {
  return (unsigned char)(best > 0.f ? q : q | ARG_OFF);
}

// A backward's window from its argmax byte a and its dp value v, as loaded: the position q and the
// gradient g, 0 where the ReLU is off. Applied where the prefetched values are used, not where they are
// loaded (Note [prefetch]): a select at the load waits for it there (docs/kernels.md, "Stage 1's
// backward").
__device__ __forceinline__ int arg_q(int a) { return a & 3; }
__device__ __forceinline__ float arg_g(int a, float v) { return (a & ARG_OFF) ? 0.f : v; }
