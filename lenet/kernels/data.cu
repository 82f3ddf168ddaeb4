// Gather one batch from the GPU-resident uint8 dataset and normalize it, in one launch:
//   x[b, p] = (images[order[start + b], p] / 255 - mean) / std     b < n, p < 784
//   y[b]    = labels[order[start + b]]
// and, when lr_out is given, set the learning rate the SGD kernel reads (lr_out[0] = lr),
// so a schedule needs no separate launch. The arithmetic is PyTorch's
// x.float().div(255).sub(mean).div(std), operation for operation.
extern "C" __global__ void gather_batch_kernel(const unsigned char* __restrict__ images,
                                               const unsigned char* __restrict__ labels,
                                               const int* __restrict__ order, int start, int n,
                                               float mean, float std, float* __restrict__ x,
                                               int* __restrict__ y, float lr, float* __restrict__ lr_out) {
    const int pixels = 28 * 28;
    const int total = n * pixels;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int b = i / pixels, p = i - b * pixels;
        const long src = order[start + b];
        x[i] = ((float)images[src * pixels + p] / 255.0f - mean) / std;
        if (p == 0) y[b] = (int)labels[src];
    }
    if (lr_out && blockIdx.x == 0 && threadIdx.x == 0) lr_out[0] = lr;
}
