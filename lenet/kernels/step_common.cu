// What the whole step's modules share (each begins with it: uses=step_common): step_cluster.cu, and the form
// before it that dev/step_cluster_v1.cu keeps. The cluster's shape, the flat parameters' offsets, the cluster's
// barrier and copies, the workbench's clock, a parameter's store after the update, and the update of several
// clusters' rows (step_cluster_update_kernel).

#define SC_RANKS 8      // blocks a cluster

// The flat parameters' offsets (lenet/params.py, OFFSETS; dev/step_cluster.py checks them).
#define OFF_C1W 0
#define OFF_C1B 192
#define OFF_C2W 256
#define OFF_C2B 2688
#define OFF_F1W 2752
#define OFF_F1B 33472
#define OFF_F2W 33600
#define OFF_F2B 34816
#define PARAMS_TOTAL 34880

__device__ __forceinline__ unsigned sc_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every block of the cluster: writes before it are visible to reads after it.
// Note [a cheap cluster barrier]: barrier.cluster.arrive's default (.release) is a fence in every thread, and
// costs several times a relaxed barrier at 512 threads a block (docs/kernels.md, "The whole step";
// dev/step_cluster.py --barriers). Here the block's threads meet first (bar.sync orders their
// shared-memory writes before thread 0's next operations), thread 0 alone fences at cluster scope (a
// fence is cumulative: it orders what bar.sync ordered before it), then every thread arrives relaxed; the
// wait keeps its default .acquire.
__device__ __forceinline__ void sc_sync() {
#ifdef SC_ACQREL
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("fence.acq_rel.cluster;" ::: "memory");
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// n bytes (4 or 16) from global memory into shared memory without registers (cp.async, sm_80 and later).
template <int n>
__device__ __forceinline__ void sc_copy(float* dst, const float* src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  if (n == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
  else asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void sc_copies_sent() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int pending>
__device__ __forceinline__ void sc_copies_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(pending) : "memory"); }

// The address of *p (this block's shared memory) in rank r's shared memory.
template <typename T>
__device__ __forceinline__ const T* sc_at(const T* p, unsigned r) {
  unsigned long long a;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(a) : "l"(reinterpret_cast<unsigned long long>(p)), "r"(r));
  return reinterpret_cast<const T*>(a);
}

__device__ __forceinline__ unsigned long long sc_clock() {
  unsigned long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}
#ifdef SC_PROFILE   // the workbench's phase times (dev/step_cluster.py): rank 0's clock at each mark
#define SC_MARK(i) do { if (prof && rank == 0 && t == 0) prof[cl * 16 + (i)] = sc_clock(); } while (0)
#else
#define SC_MARK(i) ((void)prof)
#endif

// A parameter's new value q, its momentum v and its moving average stored (sgd_rule.cu's rule computed q and v).
__device__ __forceinline__ void sc_store(float* __restrict__ params, float* __restrict__ velocity,
                                         float* __restrict__ ema, int i, float q, float v, float momentum,
                                         float ema_weight) {
  params[i] = q;
  if (momentum != 0.f) velocity[i] = v;
  if (ema) ema_rule(ema[i], q, ema_weight);
}

// The quad max of four lanes' conv outputs (lanes 4m .. 4m + 3 hold positions q = 0 .. 3 of one pooling
// window): lane 4m gets (the first maximum, its q). Every lane of the warp calls it.
__device__ __forceinline__ float sc_quad_max(float a, int& q) {
  const float a1 = __shfl_down_sync(0xffffffffu, a, 1), a2 = __shfl_down_sync(0xffffffffu, a, 2),
              a3 = __shfl_down_sync(0xffffffffu, a, 3);
  float best = a;
  q = 0;
  if (a1 > best) { best = a1; q = 1; }
  if (a2 > best) { best = a2; q = 2; }
  if (a3 > best) { best = a3; q = 3; }
  return best;
}

// Several clusters: every parameter's gradient, the clusters' rows of part added in cluster order, then the
// update (sgd_rule.cu's rule); block 0's thread 0 the loss's totals. Thread i of the grid owns parameter i.
extern "C" __global__ void __launch_bounds__(256)
step_cluster_update_kernel(const float* __restrict__ part, int clusters, float* __restrict__ params,
                           float* __restrict__ grads, float* __restrict__ velocity, float* __restrict__ ema,
                           const float* __restrict__ lr, float momentum, float weight_decay, int nesterov,
                           float ema_weight, const float* __restrict__ part_loss, const int* __restrict__ part_correct,
                           float loss_scale, float* __restrict__ out, int* __restrict__ correct,
                           float* __restrict__ running) {
  griddep_entry();
  const float rate = lr[0];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < PARAMS_TOTAL; i += gridDim.x * blockDim.x) {
    float a = 0.f;
    for (int c = 0; c < clusters; ++c) a += part[(size_t)c * PARAMS_TOTAL + i];
    grads[i] = a;
    float v = momentum != 0.f ? velocity[i] : 0.f;
    const float pnew = sgd_rule(params[i], a, v, momentum, weight_decay, nesterov, rate);
    sc_store(params, velocity, ema, i, pnew, v, momentum, ema_weight);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    float total = 0.f;
    int hits = 0;
    for (int c = 0; c < clusters; ++c) { total += part_loss[c]; hits += part_correct[c]; }
    out[0] = total * loss_scale;
    correct[0] = hits;
    if (running) running[0] += total * loss_scale;
  }
}
