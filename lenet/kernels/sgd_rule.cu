// The update's rule, one parameter at a time: what sgd.cu's kernel and the whole step's update
// (step_cluster.cu) share, so that the two update every parameter alike (PyTorch's torch.optim.SGD):
//   d = g + weight_decay * p
//   v = momentum * v + d        (v starts at 0, so the first step has v = d)
//   d = nesterov ? d + momentum * v : v
//   p = p - lr * d              (momentum == 0: p = p - lr * d, v untouched)
// and the weights' exponential moving average (torch.optim.swa_utils.get_ema_multi_avg_fn:
// ema.lerp_(p, 1 - decay)), an ema weight of 1 copying the weights:
//   ema = ema + (1 - decay) * (p - ema)

// The new value of parameter p with gradient g; v, its momentum, read and written only where momentum != 0.
__device__ __forceinline__ float sgd_rule(float p, float g, float& v, float momentum, float weight_decay, int nesterov,
                                          float rate) {
    float d = g + weight_decay * p;
    if (momentum != 0.f) {
        const float buf = momentum * v + d;
        v = buf;
        d = nesterov ? d + momentum * buf : buf;
    }
    return p - rate * d;
}

// The moving average e of a parameter whose new value is q (ema_weight = 1 - decay).
__device__ __forceinline__ void ema_rule(float& e, float q, float ema_weight) {
    e = ema_weight == 1.f ? q : e + ema_weight * (q - e);
}
