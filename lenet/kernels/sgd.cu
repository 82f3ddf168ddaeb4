// One SGD step over the flat parameter buffer (PyTorch's torch.optim.SGD rule):
//   d = g + weight_decay * p
//   v = momentum * v + d        (v starts at 0, so the first step has v = d)
//   p = p - lr * v              (momentum == 0: p = p - lr * d, v untouched)
// lr is read from device memory so that a captured CUDA graph follows a schedule.
extern "C" __global__ void sgd_kernel(float* __restrict__ p, const float* __restrict__ g,
                                      float* __restrict__ v, const float* __restrict__ lr,
                                      float momentum, float weight_decay, int n) {
    const float rate = lr[0];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float d = g[i] + weight_decay * p[i];
        if (momentum != 0.f) {
            d = momentum * v[i] + d;
            v[i] = d;
        }
        p[i] -= rate * d;
    }
}
