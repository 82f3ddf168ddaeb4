// module stage2_forward_mma: stage=conv2 direction=forward version=4 threads=32 images=4,8 arch=80 smem=5016+864*images uses=stage_common,tf32
// Stage 2 forward on the tensor cores: per image an implicit GEMM,
//   conv[m, n] = b[n] + sum_k A[m, k] B[k, n],  m = 8 oy + ox (64 conv positions), n the output channel (16),
//   k = 25 c + 5 r + s (150, padded to 152),    A[m, k] = x[c, oy + r, ox + s],  B[k, n] = w[n, c, r, s],
// as 4 x 2 tiles of m16n8k8 over 19 k-steps, each product three TF32 products (Note [three tf32 products]
// in tf32.cu): 456 mma.sync an image, where the float32 forwards do 153,600 multiply-adds. Then bias, the 2 x 2
// max-pool with its argmax byte and the ReLU bit, as stage2_forward_tiled.cu's epilogue (the same order of
// comparisons, so the same first maximum wins among equal values).
//
// blockDim.x = 32 * imgs. A block owns imgs images an iteration (n0 .. n0 + imgs - 1) and its shared copy of
// the split weights and offsets, written by all its threads before its one barrier and only read after it;
// warp `slot` owns image n0 + slot, from its global load to its outputs, and its own sx slot (warp barriers
// only: no block barrier after the weights). Shared (dynamic, floats):
//   swf (4864)           B's fragments in PTX's layout, split once: for k-step ks and n-tile nt, lane l's
//                        uint4 at (2 ks + nt) * 32 + l = (big b0, big b1, small b0, small b1), with
//                        b0 = B[8 ks + q, 8 nt + g], b1 = B[8 ks + q + 4, 8 nt + g] (g = l / 4, q = l % 4);
//   skoff (152 ints)     column k's offset into an image, 25 c + 5 r + s as 144 c + 12 r + s (the padded
//                        columns k = 150, 151 at 149's, read as 0 below);
//   sx (864 an image)    the warp's image as floats, each A value split where it is loaded (PRESPLIT false:
//                        version 4, this file's kernel); version 3 (PRESPLIT, dev/conv2_forward_v3.cu) keeps
//                        each float as its (big, small) pair (a uint2, 1728 an image), an A value one load.
// Lane (g, q)'s A values for m-tile mt and k-step ks: rows m = 16 mt + g (oy = 2 mt, ox = g) and m + 8 (oy + 1),
// columns k = 8 ks + q and k + 4, at sx[skoff[k] + 24 mt + g (+ 12)]: two loads of skoff a k-step, for all
// four m-tiles (the offsets as 38 registers a lane took 152 registers in all, one block of 8 images an SM).
// Its C values: conv(oy = 2 mt + {0, 1}, ox = g) at channels 8 nt + 2q, 2q + 1; the window (pi, pj) =
// (mt, g / 2) has its two columns in lanes g and g + 1 (l and l + 4): the even lane pools and writes.
// Version 4 splits each A value where it is loaded: half the shared-memory wavefronts of version 3's pairs (a
// 32-bit load a value, one wavefront a warp, where a 64-bit one takes two), five more instructions a value.
// Bound by shared-memory wavefronts (the A loads), not the tensor cores. Its times against versions 1-3 and why
// the heuristic takes it from 6 images an SM: docs/kernels.md, "Stage 2's forward, version 4".
//
// Note [four k-steps unrolled]: the 19 k-steps unrolled four at a time, not whole. The whole unroll was the
// longest compile of a first run (NVRTC, 0.66-0.72 s to a cubin on two CPUs, where the planner waits for it);
// four at a time takes 0.15 s for the same speed within the timing's noise (docs/kernels.md has both).
template <bool PRESPLIT>
__device__ __forceinline__ void stage2_forward_mma(const float* __restrict__ x, const float* __restrict__ w,
                                                   const float* __restrict__ b, float* __restrict__ p,
                                                   unsigned char* __restrict__ arg, int N, int ps) {
  griddep_entry();
  PACK_MODEL(x, (size_t)N * S2_IMAGE); PACK_MODEL(w, ps); PACK_MODEL(b, ps);   // Note [model from the grid]
  PACK_MODEL(p, (size_t)N * S2_POOLED); PACK_MODEL(arg, (size_t)N * S2_POOLED);
  extern __shared__ uint4 smem_u4[];
  uint4* swf = smem_u4;                                            // 19 * 2 * 32 uint4 = 4864 floats
  const int t = threadIdx.x, imgs = blockDim.x / 32, slot = t / 32, lane = t % 32;
  const int g = lane >> 2, q = lane & 3;
  int* skoff = reinterpret_cast<int*>(smem_u4 + 19 * 2 * 32);    // 152 ints
  uint2* sx = reinterpret_cast<uint2*>(skoff + 152) + slot * S2_IMAGE;               // version 3's image
  float* sxf = reinterpret_cast<float*>(skoff + 152) + slot * S2_IMAGE;              // version 4's
  for (int i = t; i < 19 * 2 * 32; i += blockDim.x) {             // B's fragments, split once a block
    const int l = i % 32, f = i / 32, ks = f / 2, nt = f % 2;
    const int n = 8 * nt + (l >> 2), k0 = 8 * ks + (l & 3), k1 = k0 + 4;
    const float v0 = k0 < 150 ? w[n * 150 + k0] : 0.f, v1 = k1 < 150 ? w[n * 150 + k1] : 0.f;
    const uint2 s0 = s2d_split(v0), s1 = s2d_split(v1);
    swf[i] = make_uint4(s0.x, s1.x, s0.y, s1.y);
  }
  for (int i = t; i < 152; i += blockDim.x) {
    const int k = min(i, 149);                                     // the padded columns: read as 0 below
    skoff[i] = (k / 25) * 144 + ((k % 25) / 5) * 12 + k % 5;
  }
  const bool pad = q >= 2;                                         // k = 148 + q + ... >= 150 at ks 18, h 1
  float bias[2][2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) { bias[nt][0] = b[8 * nt + 2 * q]; bias[nt][1] = b[8 * nt + 2 * q + 1]; }
  __syncthreads();
  for (int n0 = blockIdx.x * imgs; n0 < N; n0 += gridDim.x * imgs) {
    const int img = n0 + slot;
    if (img >= N) break;                                           // this warp's images are done (no barrier below)
    const float4* xi = reinterpret_cast<const float4*>(x + (size_t)img * S2_IMAGE);
    __syncwarp();                                                  // the last image's reads of sx are done
    for (int i = lane; i < S2_IMAGE / 4; i += 32) {
      const float4 v = xi[i];
      if (PRESPLIT) {
        const uint2 a = s2d_split(v.x), bb = s2d_split(v.y), c = s2d_split(v.z), d = s2d_split(v.w);
        sx[4 * i] = a; sx[4 * i + 1] = bb; sx[4 * i + 2] = c; sx[4 * i + 3] = d;
      } else {
        reinterpret_cast<float4*>(sxf)[i] = v;
      }
    }
    __syncwarp();
    float acc[4][2][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        acc[mt][nt][0] = acc[mt][nt][2] = bias[nt][0];
        acc[mt][nt][1] = acc[mt][nt][3] = bias[nt][1];
      }
#ifndef S2M_KS_UNROLL   // Note [four k-steps unrolled]; stage_kernels.py --define S2M_KS_UNROLL=19 times the whole unroll
#define S2M_KS_UNROLL 4
#endif
#pragma unroll S2M_KS_UNROLL
    for (int ks = 0; ks < 19; ++ks) {
      const uint4 f0 = swf[(2 * ks) * 32 + lane], f1 = swf[(2 * ks + 1) * 32 + lane];
      const int k0 = skoff[8 * ks + q], k1 = skoff[8 * ks + q + 4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        uint2 v0, v1, v2, v3;
        if (PRESPLIT) {
          const uint2* row = sx + 24 * mt + g;
          v0 = row[k0]; v1 = row[k0 + 12]; v2 = row[k1]; v3 = row[k1 + 12];
        } else {
          const float* row = sxf + 24 * mt + g;
          v0 = s2d_split(row[k0]); v1 = s2d_split(row[k0 + 12]); v2 = s2d_split(row[k1]); v3 = s2d_split(row[k1 + 12]);
        }
        if (ks == 18 && pad) { v2 = make_uint2(0u, 0u); v3 = make_uint2(0u, 0u); }
        const unsigned big[4] = {v0.x, v1.x, v2.x, v3.x}, small[4] = {v0.y, v1.y, v2.y, v3.y};
        // small(A) big(B) + big(A) small(B) + big(A) big(B): the small terms first (Note [three tf32 products])
        s2d_mma(acc[mt][0], small, f0.x, f0.y);
        s2d_mma(acc[mt][1], small, f1.x, f1.y);
        s2d_mma(acc[mt][0], big, f0.z, f0.w);
        s2d_mma(acc[mt][1], big, f1.z, f1.w);
        s2d_mma(acc[mt][0], big, f0.x, f0.y);
        s2d_mma(acc[mt][1], big, f1.x, f1.y);
      }
    }
    const size_t out = (size_t)img * S2_POOLED;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {                              // channel 8 nt + 2 q + e
          const float a00 = acc[mt][nt][e], a10 = acc[mt][nt][2 + e];
          const float a01 = __shfl_down_sync(0xffffffffu, a00, 4), a11 = __shfl_down_sync(0xffffffffu, a10, 4);
          if ((g & 1) == 0) {
            float best = a00;
            int qa = 0;
            if (a01 > best) { best = a01; qa = 1; }
            if (a10 > best) { best = a10; qa = 2; }
            if (a11 > best) { best = a11; qa = 3; }
            const size_t o = out + (8 * nt + 2 * q + e) * 16 + mt * 4 + (g >> 1);
            p[o] = relu_keep_nan(best);
            arg[o] = arg_byte(qa, best);
          }
        }
  }
}

// Version 4, the one that ships (PRESPLIT false); version 3 (the image as pairs) is dev/conv2_forward_v3.cu's,
// which compiles this file for the template alone (S2M_TEMPLATE_ONLY).
#ifndef S2M_TEMPLATE_ONLY
extern "C" __global__ void __launch_bounds__(256, 2)
stage2_forward_mma_kernel(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                          float* __restrict__ p, unsigned char* __restrict__ arg, int N, int ps) {
  stage2_forward_mma<false>(x, w, b, p, arg, N, ps);
}
#endif
