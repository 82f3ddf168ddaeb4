// The layouts stage 2's dense backwards share (stage2_backward_dense.cu's versions 4 and 5,
// stage2_backward_roles.cu's 7 and 8, and dev/conv2_backward_v6.cu's 6): the conv gradient sd, one 8-wide row of channel k's 8 rows at
// k * S2D_DS + y * S2D_RS; the image split into two planes of words (big, then small at + S2D_XP), as
// x[c, Y, X] at c * 144 + Y * 12 + X, with a region of ones past it for the bias's column.
#ifndef S2D_RS
#define S2D_RS 12          // sd's row stride: 8 + 4, so a data-gradient warp's 4 row pairs lie in 4 distinct bank quads
#endif
#define S2D_DS (8 * S2D_RS + 4)   // sd's channel stride: 8 channels' rows in 8 distinct bank quads
#define S2D_ONES S2_IMAGE           // the planes' region of ones (big 1, small 0): the bias column reads it
#define S2D_XP (S2_IMAGE + 96)      // words a plane

// The 8 floats at p (16-byte aligned) into registers.
__device__ __forceinline__ void s2d_row8(float (&d)[8], const float* p) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  d[0] = a.x; d[1] = a.y; d[2] = a.z; d[3] = a.w; d[4] = b.x; d[5] = b.y; d[6] = b.z; d[7] = b.w;
}

// The planes' offset of weight-gradient column col (the tap (c, r, s) = (col / 25, col / 5 % 5, col % 5),
// or the bias's column 150 and the tiles' unused columns 151..159, which read the ones) at (y, x) = (0, 0).
__device__ __forceinline__ int s2d_column(int col) {
  return col < 150 ? col / 25 * 144 + col / 5 % 5 * 12 + col % 5 : S2D_ONES;
}

// A data-gradient unit's sums (versions 4 to 7): a[y][x + s] = the sum over channels k and taps s of
// dconv[k, 2 dq + y, x] w[k, c, r, s], for the unit's two conv-gradient rows dr (sd + 2 dq * S2D_RS) and the
// weights of its (c, r): taps 0..3 a float4 at wd + k * KS, tap 4 at w4 + k * K4; the channel loop unrolled
// by UNROLL. The operands are registers loaded once a row: 80 multiply-adds per six loads.
template <int KS, int K4, int UNROLL>
__device__ __forceinline__ void s2d_data_rows(float (&a)[2][12], const float* wd, const float* w4, const float* dr) {
#pragma unroll
  for (int y = 0; y < 2; ++y)
#pragma unroll
    for (int X = 0; X < 12; ++X) a[y][X] = 0.f;
  auto channel = [&]() {   // channel k's 80 multiply-adds, then the pointers advanced (not recomputed from k)
    const float4 q = *reinterpret_cast<const float4*>(wd);
    const float ws[5] = {q.x, q.y, q.z, q.w, *w4};
#pragma unroll
    for (int y = 0; y < 2; ++y) {
      float d[8];
      s2d_row8(d, dr + y * S2D_RS);
#pragma unroll
      for (int xx = 0; xx < 8; ++xx)
#pragma unroll
        for (int s = 0; s < 5; ++s) a[y][xx + s] = fmaf(d[xx], ws[s], a[y][xx + s]);
    }
    wd += KS; w4 += K4; dr += S2D_DS;
  };
  // The first UNROLL channels apart, so that the compiler folds a's zeros into their multiply-adds (the same
  // fmaf(d, w, +0) as in the loop: the same bits) and need not clear 24 registers for the loop.
#pragma unroll
  for (int k = 0; k < UNROLL; ++k) channel();
#pragma unroll UNROLL
  for (int k = UNROLL; k < 16; ++k) channel();
}

// Tile ``tile``'s C fragment (c[2 h + e] is C[g + 8 h, 2 q + e]) into the weight gradient's row (columns
// < 150) and the bias (column 150).
__device__ __forceinline__ void s2d_store_tile(float* mine, float* bias, int tile, const float* c, int lane) {
  const int lg = lane >> 2, lq = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * tile + 2 * lq + e, k = lg + 8 * h;
      if (col < 150) mine[k * 150 + col] = c[2 * h + e];
      else if (col == 150) bias[k] = c[2 * h + e];
    }
}
