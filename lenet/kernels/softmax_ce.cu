// module softmax_ce: uses=softmax_ce_row
// Softmax cross-entropy, forward and backward in one launch: the kernel over softmax_ce_row.cu's
// per-row math (sce_row) and sums (block_sum, sce_finish), which this module is compiled after
// (lenet/kernels/__init__.py: SOURCES).

// blockDim.x = SCE_THREADS; thread t of block (b, m) owns model m's rows b * 256 + t, then every gridDim.x * 256 after
// it; shared sv, sc (256 each) hold the block's sums (block_sum); sce_finish's `last` says whether it adds them all.
extern "C" __global__ void __launch_bounds__(SCE_THREADS)
softmax_ce_kernel(const float* __restrict__ logits,
                  const float* __restrict__ logits2,    // may be null: z = logits
                  const int* __restrict__ labels,
                  float* __restrict__ dlogits,          // may be null: forward only
                  float* __restrict__ out, int* __restrict__ correct,
                  float* __restrict__ partial_loss, int* __restrict__ partial_correct,
                  unsigned int* __restrict__ ticket, float* __restrict__ running,
                  int n, int classes, float grad_scale, float loss_scale, int accumulate, float eps,
                  const float* __restrict__ eps_models) {   // may be null: eps for every model
    __shared__ float sv[SCE_THREADS];
    __shared__ int sc[SCE_THREADS];
    // A pack of models (lenet sweep) is gridDim.y = K: model m's rows are [m * n, (m + 1) * n), its
    // totals out[m], correct[m], running[m], its partial sums gridDim.x after model m - 1's, its ticket
    // ticket[m], its label smoothing eps_models[m] (Note [model from the grid] in stage_common.cu).
    const int m = blockIdx.y;
    if (m) {
        logits += (size_t)m * n * classes;
        if (logits2) logits2 += (size_t)m * n * classes;
        if (dlogits) dlogits += (size_t)m * n * classes;
        labels += (size_t)m * n;
        out += m; correct += m; ticket += m;
        if (running) running += m;
        partial_loss += (size_t)m * gridDim.x; partial_correct += (size_t)m * gridDim.x;
    }
    if (eps_models) eps = eps_models[m];
    float loss = 0.f;
    int hits = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int hit;
        loss += sce_row(logits + (size_t)i * classes, logits2 ? logits2 + (size_t)i * classes : nullptr, labels[i],
                        classes, eps, dlogits ? dlogits + (size_t)i * classes : nullptr, grad_scale, hit);
        hits += hit;
    }
    block_sum(loss, hits, sv, sc);
    sce_finish(loss, hits, partial_loss, partial_correct, ticket, out, correct, running, loss_scale, accumulate);
}
