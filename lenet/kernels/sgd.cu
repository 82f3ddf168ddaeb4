// module sgd:
// One SGD step over the flat parameter buffer (PyTorch's torch.optim.SGD rule):
//   d = g + weight_decay * p
//   v = momentum * v + d        (v starts at 0, so the first step has v = d)
//   d = nesterov ? d + momentum * v : v
//   p = p - lr * d              (momentum == 0: p = p - lr * d, v untouched)
// and, when ema is given, the exponential moving average of the weights
// (torch.optim.swa_utils.get_ema_multi_avg_fn: ema.lerp_(p, 1 - decay)):
//   ema = ema + (1 - decay) * (p - ema)
// lr is read from device memory so that a captured CUDA graph follows a schedule.
extern "C" __global__ void sgd_kernel(float* __restrict__ p, const float* __restrict__ g,
                                      float* __restrict__ v, const float* __restrict__ lr,
                                      float momentum, float weight_decay, int nesterov,
                                      float* __restrict__ ema, float ema_weight, int n) {
    griddep_entry();
    const float rate = lr[0];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float d = g[i] + weight_decay * p[i];
        if (momentum != 0.f) {
            const float buf = momentum * v[i] + d;
            v[i] = buf;
            d = nesterov ? d + momentum * buf : buf;
        }
        const float q = p[i] - rate * d;
        p[i] = q;
        if (ema) ema[i] = ema[i] + ema_weight * (q - ema[i]);
    }
}

// a[0..n) = value: the learning rate and the running loss set on the model's stream without a host
// copy that could wait for the stream, and without CuPy's fill kernel (one more NVRTC compile on a
// first run: Note [first run] in descriptors/modules.py). Thread i (grid-stride) owns a[i]; no
// shared memory.
extern "C" __global__ void fill_kernel(float* __restrict__ a, float value, int n) {
    griddep_entry();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) a[i] = value;
}
