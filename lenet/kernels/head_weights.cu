// module head_weights: uses=head_common
// LeNet's head: its weight and bias gradients (the head's forward: head.cu, whose Note [head latency]
// says why they run beside it on the side stream). Launcher: lenet/kernels/head.py (HeadLaunches).

// Sums of HW_AHEAD images' terms at a time from image n while they fit in [n, n1), their loads issued
// before the first is used; returns where it stopped. dW1[j, t]'s in a, and with EXTRA (warp 0) the
// thread's second sum in b: the product e * f, or e alone where prod is false (times 1: the same rounding
// as an addition). Each sum stays in image order.
template <int HW_AHEAD, bool EXTRA>
__device__ __forceinline__ int head_weight_sums(int n, int n1, const float* __restrict__ dh1,
                                                const float* __restrict__ p2, const float* __restrict__ h1,
                                                const float* __restrict__ e_at, int e_stride, bool prod, int j,
                                                int t, float& a, float& b) {
  for (; n + HW_AHEAD <= n1; n += HW_AHEAD) {
    float d[HW_AHEAD], x[HW_AHEAD], e[HW_AHEAD], f[HW_AHEAD];
#pragma unroll
    for (int k = 0; k < HW_AHEAD; ++k) {
      d[k] = __ldg(dh1 + (size_t)(n + k) * H_HID + j);
      x[k] = __ldg(p2 + (size_t)(n + k) * H_IN + t);
      if (EXTRA) {
        e[k] = __ldg(e_at + (size_t)(n + k) * e_stride);
        f[k] = __ldg(h1 + (size_t)(n + k) * H_HID + j);
      }
    }
#pragma unroll
    for (int k = 0; k < HW_AHEAD; ++k) {
      a = fmaf(d[k], x[k], a);
      if (EXTRA) b = fmaf(e[k], prod ? f[k] : 1.f, b);
    }
  }
  return n;
}

// Weight and bias gradients over images [s * per, min(N, (s + 1) * per)), s = blockIdx.y; blockIdx.x = j
// (a hidden unit), blockDim.x = 256. Thread i: dW1[j, i] = sum_n dh1[n, j] p2[n, i]; thread c < 10 also
// dW2[c, j] = sum_n dlogits[n, c] h1[n, j]; thread 10: db1[j] = sum_n dh1[n, j]; block j = 0, threads
// 11..20: db2[c - 11] = sum_n dlogits[n, c - 11], and the row's padding columns 0. Each sum runs over n
// in order, in one pass: eight images' loads in flight, then four, then one (Note [the weights' loads in
// flight]). Writes row s of `part` (width floats, the flat layout; a grid with one range is handed the
// gradient buffer itself).
//
// Note [the weights' loads in flight]: below 257 images a model's head sums one range, so each thread's sum
// runs over every image of the batch and the kernel's time is its loads' latency; the update waits for it.
// Eight images' loads are issued before the first is used, and warp 0's second sums ride in the same pass;
// each sum keeps its image order (the same sums to the bit). Warp 0's lanes that have no second sum load valid
// addresses and drop the sum: the branch stays per warp. Measured, and the forms that lost: docs/kernels.md,
// "head_weights.cu".
extern "C" __global__ void __launch_bounds__(H_THREADS)
head_weights_kernel(const float* __restrict__ p2, const float* __restrict__ h1, const float* __restrict__ dh1,
                    const float* __restrict__ dlogits, float* __restrict__ part, int width, int off_b1, int off_w2,
                    int off_b2, int N, int per HEAD_PACK_PARAMS) {
  griddep_entry();
#ifdef LENET_PACK
  {   // model m = blockIdx.z (head_common.cu): its rows of part (or its gradients) part_stride floats apart
    const unsigned m = blockIdx.z;
    HEAD_MODEL(p2, N * H_IN, m); HEAD_MODEL(h1, N * H_HID, m); HEAD_MODEL(dh1, N * H_HID, m);
    HEAD_MODEL(dlogits, N * H_OUT, m); HEAD_MODEL(part, part_stride, m);
  }
#endif
  const int t = threadIdx.x, j = blockIdx.x;
  const int n0 = blockIdx.y * per, n1 = min(N, n0 + per);
  float* row = part + (size_t)blockIdx.y * width;
  // The thread's second sum: 1 dW2[t, j] (dlogits times h1), 2 db1[j] (dh1), 3 db2[c] (dlogits), 0 none.
  const int role = t < H_OUT ? 1 : t == H_OUT ? 2 : (j == 0 && t < 2 * H_OUT + 1) ? 3 : 0;
  const float* e_at = role == 2 ? dh1 + j : dlogits + (role == 1 ? t : role == 3 ? t - H_OUT - 1 : 0);
  const int e_stride = role == 2 ? H_HID : H_OUT;
  float a = 0.f, b = 0.f;
  int n = n0;
  if (t < 32) {   // warp 0: every role is here
    n = head_weight_sums<8, true>(n, n1, dh1, p2, h1, e_at, e_stride, role == 1, j, t, a, b);
    n = head_weight_sums<4, true>(n, n1, dh1, p2, h1, e_at, e_stride, role == 1, j, t, a, b);
    head_weight_sums<1, true>(n, n1, dh1, p2, h1, e_at, e_stride, role == 1, j, t, a, b);
  } else {
    n = head_weight_sums<8, false>(n, n1, dh1, p2, h1, e_at, e_stride, false, j, t, a, b);
    n = head_weight_sums<4, false>(n, n1, dh1, p2, h1, e_at, e_stride, false, j, t, a, b);
    head_weight_sums<1, false>(n, n1, dh1, p2, h1, e_at, e_stride, false, j, t, a, b);
  }
  row[j * H_IN + t] = a;
  if (role == 1) row[off_w2 + t * H_HID + j] = b;
  else if (role == 2) row[off_b1 + j] = b;
  else if (role == 3) row[off_b2 + t - H_OUT - 1] = b;
  if (j == 0) {   // the padding between tensors
    for (int e = H_HID * H_IN + t; e < width; e += H_THREADS) {
      const bool pad = (e < off_b1) || (e >= off_b1 + H_HID && e < off_w2) ||
                       (e >= off_w2 + H_OUT * H_HID && e < off_b2);
      if (pad) row[e] = 0.f;
    }
  }
}
