// module distance:
// |out - ref| and |ref| over two float32 arrays of one size, in float64, in one pass: what the planner's
// check of a convolution candidate measures (lenet/plan.py, Note [exact candidates] in
// descriptors/exact.py), with no temporary the size of the output. CuPy's reductions of one array go
// through CUB, a module NVRTC took 2-2.5 s over on a first run, one per shape of call (Note [first run]
// in lenet/kernels/nvrtc.py).
// Block b of a grid-stride loop writes sums[2 b] = sum of (out - ref)^2 and sums[2 b + 1] = sum of ref^2
// over its share; the host adds the blocks' sums in order (deterministic). blockDim.x = 256: thread t
// owns the elements t, t + 256 gridDim.x, ... of its block's share, and sd[t], sr[t] (shared, 256
// doubles each) until the tree reduction, whose every step ends at a barrier; thread 0 writes the
// block's two sums.
extern "C" __global__ void __launch_bounds__(256)
distance_kernel(const float* __restrict__ out, const float* __restrict__ ref, long long n, double* __restrict__ sums) {
  __shared__ double sd[256], sr[256];
  double d = 0.0, r = 0.0;
  for (long long i = (long long)blockIdx.x * 256 + threadIdx.x; i < n; i += (long long)gridDim.x * 256) {
    const double o = out[i], e = ref[i];
    d += (o - e) * (o - e);
    r += e * e;
  }
  sd[threadIdx.x] = d;
  sr[threadIdx.x] = r;
  __syncthreads();
  for (int s = 128; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      sd[threadIdx.x] += sd[threadIdx.x + s];
      sr[threadIdx.x] += sr[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    sums[2 * blockIdx.x] = sd[0];
    sums[2 * blockIdx.x + 1] = sr[0];
  }
}
