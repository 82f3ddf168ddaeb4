// The layouts stage 2's dense backwards share (stage2_backward_dense.cu's versions 4 to 6, and
// stage2_backward_roles.cu's version 7): the conv gradient sd, one 8-wide row of channel k's 8 rows at
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
