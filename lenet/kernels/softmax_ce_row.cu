// Softmax cross-entropy's per-row math and its deterministic block sums, the device functions that
// softmax_ce.cu's kernel and the head's forward (head.cu, which fuses the loss into it) are compiled
// from; the kernel is in softmax_ce.cu, so that the head's module compiles no second copy of it (a
// fourth of that module's compile, on the first run's longest path: Note [first run] in
// lenet/kernels/nvrtc.py).
//
// logits (n, classes) row-major, labels (n,) int32; z = logits, or (logits + logits2) / 2 when
// logits2 is given (test-time augmentation: the mean of two views' logits). For each row i:
//   m = max_j z_ij,  s = sum_j exp(z_ij - m)
//   loss_i = (1 - eps) * (log(s) - (z_i,y_i - m)) + eps * (log(s) - mean_j (z_ij - m))
//   dlogits_ij = (exp(z_ij - m) / s - (1 - eps) * [j == y_i] - eps / classes) * grad_scale
// eps is the label smoothing of PyTorch's cross_entropy(label_smoothing=eps): the target is
// (1 - eps) * onehot + eps / classes; eps = 0 is the plain loss.
// out[0]     = (accumulate ? out[0] : 0) + loss_scale * sum_i loss_i
// correct[0] = (accumulate ? correct[0] : 0) + #{i : argmax_j z_ij == y_i}
// running[0] += loss_scale * sum_i loss_i   (when running is not null: an epoch's loss sum)
//
// The sum is deterministic: each block reduces a fixed set of rows in a fixed
// order into partial[blockIdx.x]; the last block to finish (counted with an
// atomic ticket, reset to 0 for the next launch) adds the partials in block order.
// A label outside [0, classes) makes that row's loss and gradient NaN.

#define SCE_THREADS 256

// One row: its loss (NaN for a label outside [0, classes)), whether its argmax is the label (hit),
// and, when d is not null, its gradient times grad_scale into d.
__device__ __forceinline__ float sce_row(const float* z1, const float* z2, int y, int classes, float eps,
                                         float* d, float grad_scale, int& hit) {
    auto z = [&](int j) { return z2 ? (z1[j] + z2[j]) * 0.5f : z1[j]; };
    const bool ok = y >= 0 && y < classes;
    float m = z(0);
    int arg = 0;
    for (int j = 1; j < classes; ++j) if (z(j) > m) { m = z(j); arg = j; }
    float s = 0.f, zsum = 0.f;
    for (int j = 0; j < classes; ++j) { s += expf(z(j) - m); zsum += z(j) - m; }
    const float ls = logf(s);
    const float zy = ok ? z(y) : 0.f;
    const float li = eps == 0.f ? ls - (zy - m)
                                : (1.f - eps) * (ls - (zy - m)) + eps * (ls - zsum / (float)classes);
    hit = (ok && arg == y) ? 1 : 0;
    if (d) {
        const float inv = 1.f / s, on = 1.f - eps, off = eps / (float)classes;
        for (int j = 0; j < classes; ++j) {
            const float g = expf(z(j) - m) * inv - (j == y ? on : 0.f) - off;
            d[j] = ok ? g * grad_scale : __int_as_float(0x7fc00000);
        }
    }
    return ok ? li : __int_as_float(0x7fc00000);
}

// The block's sums of v and c, in a fixed tree order (blockDim.x a power of two, sv and sc that long).
__device__ __forceinline__ void block_sum(float& v, int& c, float* sv, int* sc) {
    const int t = threadIdx.x;
    sv[t] = v; sc[t] = c;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) { sv[t] += sv[t + s]; sc[t] += sc[t + s]; }
        __syncthreads();
    }
    v = sv[0]; c = sc[0];
}

// Every thread of a block that holds part `index` of `parts` calls this with that part's sums: they go to
// partial_*[index], and the last part to finish adds the partials in part order into out, correct and
// running, then resets the ticket for the next launch. sce_finish: the part is the block (blockIdx.x of
// gridDim.x); the head's split version (head_split.cu) finishes one part per slice of images. The
// block has at least 32 threads.
//
// Note [the last part's sum]: the last part's first warp loads the partials, 32 at a time, a lane each,
// and lane 0 adds them in part order from the warp's registers. One thread loading them in its loop
// (volatile loads, each behind the add before it) waited for one L2 round trip per part, after the
// head's split forward's work (scripts/probes/chain.py; docs/kernels.md, "The head").
__device__ __forceinline__ void sce_finish_at(float loss, int hits, int index, int parts,
                                              float* __restrict__ partial_loss, int* __restrict__ partial_correct,
                                              unsigned int* __restrict__ ticket, float* __restrict__ out,
                                              int* __restrict__ correct, float* __restrict__ running,
                                              float loss_scale, int accumulate) {
    __shared__ bool last;
    if (parts == 1) {   // the only part: its sums are the totals (0 + x is x: the same bits as the loop's)
        if (threadIdx.x == 0) {
            out[0] = (accumulate ? out[0] : 0.f) + loss * loss_scale;
            correct[0] = (accumulate ? correct[0] : 0) + hits;
            if (running) running[0] += loss * loss_scale;
        }
        return;
    }
    if (threadIdx.x == 0) {
        partial_loss[index] = loss;
        partial_correct[index] = hits;
        __threadfence();
        last = atomicAdd(ticket, 1u) == (unsigned)parts - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x >= 32) return;
    __threadfence();
    const int lane = threadIdx.x;
    float total = 0.f;
    int total_hits = 0;
    for (int b0 = 0; b0 < parts; b0 += 32) {   // Note [the last part's sum]
        const int b = b0 + lane, m = min(32, parts - b0);
        const float v = b < parts ? ((volatile float*)partial_loss)[b] : 0.f;
        const int c = b < parts ? ((volatile int*)partial_correct)[b] : 0;
        for (int j = 0; j < m; ++j) {
            total += __shfl_sync(0xffffffffu, v, j);
            total_hits += __shfl_sync(0xffffffffu, c, j);
        }
    }
    if (lane != 0) return;
    out[0] = (accumulate ? out[0] : 0.f) + total * loss_scale;
    correct[0] = (accumulate ? correct[0] : 0) + total_hits;
    if (running) running[0] += total * loss_scale;
    *ticket = 0u;
}

__device__ __forceinline__ void sce_finish(float loss, int hits, float* __restrict__ partial_loss,
                                           int* __restrict__ partial_correct, unsigned int* __restrict__ ticket,
                                           float* __restrict__ out, int* __restrict__ correct,
                                           float* __restrict__ running, float loss_scale, int accumulate) {
    sce_finish_at(loss, hits, blockIdx.x, gridDim.x, partial_loss, partial_correct, ticket, out, correct, running,
                  loss_scale, accumulate);
}
