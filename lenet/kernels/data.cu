// module data:
// Gather one batch from the GPU-resident uint8 dataset, augment it and normalize it, in one launch:
//   x[b, r, c] = (pixel / 255 - mean) / std     b < n, r, c < 28
//   y[b]       = labels[order[start + b]]
// where, without augmentation (shift == 0, flip == 0), pixel = images[order[start + b], r, c].
// With augmentation, image b is mirrored left-right (flip == 1: when a hash bit says so, half the
// images; flip == 2: every image, the mirrored view of test-time augmentation) and
// translated by (dy, dx) in [-shift, shift]^2, the uncovered border reading 0 (the background):
//   pixel = image[r - dy, c' - dx],  c' = mirrored ? 27 - c : c
// and, with cutout > 0, a cutout x cutout square of the output cleared to the background (pixel 0), its
// centre (cy, cx) uniform over the 28 x 28 image and the square clipped where it leaves it (DeVries and
// Taylor's cutout): rows cy - cutout / 2 .. cy - cutout / 2 + cutout - 1, the columns alike, drawn from
// a second hash of the image's h (lenet_cut).
// The hash is lenet_hash(seed, epoch, start + b): the image's position in the epoch, so a batch
// depends only on (seed, epoch, step) and a resumed run sees what an uninterrupted one would
// (lenet/data.py: augment_params computes the same numbers on the host).
// When lr_out is given, also lr_out[0] = lr (the learning rate the SGD kernel reads), so a
// schedule needs no separate launch. The arithmetic is PyTorch's
// x.float().div(255).sub(mean).div(std), operation for operation.

__device__ __forceinline__ unsigned int lenet_mix(unsigned int h) {   // lowbias32 (C. Wellons)
    h ^= h >> 16; h *= 0x7feb352du;
    h ^= h >> 15; h *= 0x846ca68bu;
    h ^= h >> 16;
    return h;
}

__device__ __forceinline__ unsigned int lenet_hash(unsigned int seed, unsigned int epoch, unsigned int i) {
    return lenet_mix(lenet_mix(lenet_mix(seed + 0x9e3779b9u) ^ epoch) ^ i);
}

// Whether output pixel (r, c) of the image whose hash is h lies in its cutout square of side cut.
__device__ __forceinline__ bool lenet_cut(unsigned int h, int cut, int r, int c) {
    const unsigned int g = lenet_mix(h ^ 0x68e31da4u);
    const int top = (int)(g % 28u) - cut / 2, left = (int)((g >> 16) % 28u) - cut / 2;
    return r >= top && r < top + cut && c >= left && c < left + cut;
}

// Pixel i = b * 784 + p of the batch: x[i] from image order[start + b] (augmented), and y[b] at p == 0.
__device__ __forceinline__ void gather_pixel(const unsigned char* __restrict__ images,
                                             const unsigned char* __restrict__ labels, const int* __restrict__ order,
                                             int start, int i, int shift, int flip, int cut, unsigned int span,
                                             unsigned int seed, unsigned int epoch, float mean, float std,
                                             float* __restrict__ x, int* __restrict__ y) {
    const int pixels = 28 * 28;
    const int b = i / pixels, p = i - b * pixels;
    const long src = order[start + b];
    int r = p / 28, c = p - r * 28;
    bool cleared = false;
    if (shift > 0 || flip || cut > 0) {
        const unsigned int h = lenet_hash(seed, epoch, (unsigned int)(start + b));
        const int dx = (int)(h % span) - shift, dy = (int)((h / span) % span) - shift;
        if (cut > 0) cleared = lenet_cut(h, cut, r, c);
        if (flip == 2 || (flip == 1 && ((h >> 24) & 1u))) c = 27 - c;
        r -= dy;
        c -= dx;
    }
    const bool inside = !cleared && r >= 0 && r < 28 && c >= 0 && c < 28;
    const unsigned char v = inside ? images[src * pixels + r * 28 + c] : (unsigned char)0;
    x[i] = ((float)v / 255.0f - mean) / std;
    if (p == 0) y[b] = (int)labels[src];
}

extern "C" __global__ void gather_batch_kernel(const unsigned char* __restrict__ images,
                                               const unsigned char* __restrict__ labels,
                                               const int* __restrict__ order, int start, int n,
                                               float mean, float std, float* __restrict__ x,
                                               int* __restrict__ y, float lr, float* __restrict__ lr_out,
                                               int shift, int flip, unsigned int seed, unsigned int epoch,
                                               int cut) {
    const int pixels = 28 * 28;
    const int total = n * pixels;
    const unsigned int span = 2u * (unsigned int)shift + 1u;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x)
        gather_pixel(images, labels, order, start, i, shift, flip, cut, span, seed, epoch, mean, std, x, y);
    if (lr_out && blockIdx.x == 0 && threadIdx.x == 0) lr_out[0] = lr;
}

// A pack of K models (lenet sweep), one launch of gridDim.y = K: model m's batch goes to rows
// [m * n, (m + 1) * n) of x and y, gathered from its own order orders[m * size + start + b], augmented
// by its own flags aug[4 m + 0..3] = shift, flip, seed, cutout with the draws of its own epoch epochs[m];
// and lr_out[m] = lr_table[lr_at[m] + step], its schedule's rate at its own step (the host writes
// orders, epochs and lr_at once an epoch, and the whole schedule once). Block (x, m), thread t owns model
// m's pixels i = blockIdx.x * blockDim.x + t, then every gridDim.x * blockDim.x after it (gather_pixel);
// thread 0 of block (0, m) writes lr_out[m]. No shared memory.
extern "C" __global__ void gather_pack_kernel(const unsigned char* __restrict__ images,
                                              const unsigned char* __restrict__ labels,
                                              const int* __restrict__ orders, int size, int start, int n,
                                              float mean, float std, float* __restrict__ x, int* __restrict__ y,
                                              const int* __restrict__ aug, const int* __restrict__ epochs,
                                              const float* __restrict__ lr_table, const int* __restrict__ lr_at,
                                              int step, float* __restrict__ lr_out) {
    const int pixels = 28 * 28, m = blockIdx.y;
    const int total = n * pixels;
    const int shift = aug[4 * m], flip = aug[4 * m + 1], cut = aug[4 * m + 3];
    const unsigned int seed = (unsigned int)aug[4 * m + 2], epoch = (unsigned int)epochs[m];
    const unsigned int span = 2u * (unsigned int)shift + 1u;
    const int* order = orders + (size_t)m * size;
    x += (size_t)m * total;
    y += (size_t)m * n;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x)
        gather_pixel(images, labels, order, start, i, shift, flip, cut, span, seed, epoch, mean, std, x, y);
    if (lr_out && blockIdx.x == 0 && threadIdx.x == 0) lr_out[m] = lr_table[lr_at[m] + step];
}

// count[0] += how many of x[0..n) are NaN or infinite: a check of a batch already on the GPU
// (lenet/model.py, check_batch), one atomic add per warp that found any (an integer count: the
// order of the adds does not matter). Any grid and block size, a multiple of 32 threads. Thread i
// (grid-stride) owns x[i], x[i + gridDim.x * blockDim.x], ...; no shared memory.
extern "C" __global__ void count_nonfinite_kernel(const float* __restrict__ x, long long n,
                                                  unsigned long long* __restrict__ count) {
  unsigned int c = 0;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    c += isfinite(x[i]) ? 0u : 1u;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  if ((threadIdx.x & 31) == 0 && c) atomicAdd(count, (unsigned long long)c);
}
