// module stage2_backward: stage=conv2 direction=backward version=1 threads=160 define=S2B_KS=1 uses=stage_common,stage2_backward
// module stage2_backward_split: stage=conv2 direction=backward version=2 threads=320 define=S2B_KS=2 uses=stage_common,stage2_backward
// Stage 2's backward, versions 1 and 2: the routed kernel of lenet/kernels/stage2_backward.cu (what one block
// and one thread own: its comment) in KS = 1 part of the block (stage2_backward_kernel, 160 threads) and
// KS = 2 parts (stage2_backward_split_kernel, 320 threads), where the version that ships, 3, has KS = 4
// (640 threads). That file is compiled first (uses=) and holds the template; this one instantiates it.
// No heuristic row takes either version: docs/kernels.md, "Versions 1 to 3: routed through the argmax".
#if S2B_KS == 1
extern "C" __global__ void __launch_bounds__(160, S2B_MIN_BLOCKS)
stage2_backward_kernel(const float* __restrict__ x, const float* __restrict__ w, const unsigned char* __restrict__ arg,
                       const float* __restrict__ dp, float* __restrict__ dx, float* __restrict__ part,
                       float* __restrict__ dw, float* __restrict__ db, int N, int ps) {
  stage2_backward<1>(x, w, arg, dp, dx, part, dw, db, N, ps);
}
#elif S2B_KS == 2
extern "C" __global__ void __launch_bounds__(320)
stage2_backward_split_kernel(const float* __restrict__ x, const float* __restrict__ w,
                             const unsigned char* __restrict__ arg, const float* __restrict__ dp,
                             float* __restrict__ dx, float* __restrict__ part, float* __restrict__ dw,
                             float* __restrict__ db, int N, int ps) {
  stage2_backward<2>(x, w, arg, dp, dx, part, dw, db, N, ps);
}
#endif
