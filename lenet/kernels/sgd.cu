// module sgd: uses=sgd_rule
// One SGD step over the flat parameter buffer (sgd_rule.cu's rule, PyTorch's torch.optim.SGD), and, when ema
// is given, the exponential moving average of the weights. lr is read from device memory so that a captured CUDA graph follows a schedule.
extern "C" __global__ void sgd_kernel(float* __restrict__ p, const float* __restrict__ g,
                                      float* __restrict__ v, const float* __restrict__ lr,
                                      float momentum, float weight_decay, int nesterov,
                                      float* __restrict__ ema, float ema_weight, int n,
                                      const float* __restrict__ hyper) {
    griddep_entry();
    // A pack of models (lenet sweep) is gridDim.y = K: model m's buffers are n floats after model
    // m - 1's, its learning rate lr[m], and hyper (when given) holds its constants: hyper[4 m + 0..3] =
    // momentum, weight decay, nesterov (0 or 1), ema weight; an ema weight of 1 copies the weights
    // (a model of the pack that keeps no average evaluates the same buffer as the others).
    // Block (x, m), thread t owns model m's elements i = blockIdx.x * blockDim.x + t, then every
    // gridDim.x * blockDim.x after it; no shared memory.
    const int m = blockIdx.y;
    if (m) {
        p += (size_t)m * n; g += (size_t)m * n; v += (size_t)m * n;
        if (ema) ema += (size_t)m * n;
    }
    if (hyper) {
        momentum = hyper[4 * m]; weight_decay = hyper[4 * m + 1];
        nesterov = hyper[4 * m + 2] != 0.f; ema_weight = hyper[4 * m + 3];
    }
    const float rate = lr[m];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float q = sgd_rule(p[i], g[i], v[i], momentum, weight_decay, nesterov, rate);
        p[i] = q;
        if (ema) ema_rule(ema[i], q, ema_weight);
    }
}

// a[0..n) = value: the learning rate and the running loss set on the model's stream without a host
// copy that could wait for the stream, and without CuPy's fill kernel (one more NVRTC compile on a
// first run: Note [first run] in lenet/kernels/nvrtc.py). Thread i (grid-stride) owns a[i]; no
// shared memory.
extern "C" __global__ void fill_kernel(float* __restrict__ a, float value, int n) {
    griddep_entry();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) a[i] = value;
}
