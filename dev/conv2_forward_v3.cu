// module stage2_forward_mma_pairs: stage=conv2 direction=forward version=3 threads=32 images=4,8 arch=80 define=S2M_TEMPLATE_ONLY smem=5016+1728*images uses=stage_common,tf32,stage2_forward_mma
// Stage 2's forward version 3: lenet/kernels/stage2_forward_mma.cu's implicit GEMM on the tensor cores with
// the image kept split, each float as its (big, small) pair (a uint2, 1728 floats an image), so an A value is
// one 64-bit load and no split. Lost to version 4, which ships (the image as floats, each A value split where
// it is loaded: half the shared-memory wavefronts): on an H200, 6.64 against 6.34 ns an image at 8192, 6.31
// against 6.04 at 65536, 10.78 against 10.41 at 1024 (python dev/conv2_forward_v3.py, each version's best
// launch shape).
extern "C" __global__ void __launch_bounds__(256, 2)
stage2_forward_mma_pairs_kernel(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                                float* __restrict__ p, unsigned char* __restrict__ arg, int N, int ps) {
  stage2_forward_mma<true>(x, w, b, p, arg, N, ps);
}
