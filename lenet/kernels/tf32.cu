// Float32 products on the tensor cores, for the stage kernels that use them (stage2_backward_roles.cu's
// versions 7 and 8, stage2_forward_mma.cu's version 4).
//
// Note [three tf32 products]: a float32 operand v is split into big = tf32(v) and small = tf32(v - big),
// and each product a b is three m16n8k8 TF32 products, small(a) big(b) + big(a) small(b) + big(a) big(b)
// (the small * small term, ~2^-22 of the product, dropped; as CUTLASS's 3xTF32), accumulated in float32:
// within float32's accuracy of the exact sum, not TF32's (the planner's check and tests/test_stages_gpu.py
// hold these kernels to the float32 kernels' bounds). Three TF32 products still make more float32
// multiply-adds a cycle than the FMA pipe, in a pipe of their own (scripts/probes/mma_rate.py;
// docs/kernels.md, "Launches and compiles").

// cvt.rna.tf32.f32 as its two integer steps, without the instruction's test for Inf and NaN (4 instructions
// on sm_90): a NaN's big part may come out an Inf or a zero, but its small part, v - big, is a NaN, so the
// products still carry it.
__device__ __forceinline__ unsigned s2d_tf32(float v) { return (__float_as_uint(v) + 0x1000u) & 0xffffe000u; }

// v as (big, small): big = tf32(v), small = tf32(v - big).
__device__ __forceinline__ uint2 s2d_split(float v) {
  const unsigned big = s2d_tf32(v);
  return make_uint2(big, s2d_tf32(v - __uint_as_float(big)));
}

// c += a b, one m16n8k8 TF32 product on fragments in PTX's layout: lane (g, q) = (lane >> 2, lane & 3)
// holds a = A[g, q], A[g + 8, q], A[g, q + 4], A[g + 8, q + 4]; b = B[q, g], B[q + 4, g];
// c = C[g, 2q], C[g, 2q + 1], C[g + 8, 2q], C[g + 8, 2q + 1].
__device__ __forceinline__ void s2d_mma(float* c, const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
