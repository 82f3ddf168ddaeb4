// module head_weights: uses=head_common
// LeNet's head: its weight and bias gradients (the head's forward: head.cu, whose Note [head latency]
// says why they run beside it on the side stream). Launcher: lenet/kernels/head.py (HeadLaunches).

// Weight and bias gradients over images [s * per, min(N, (s + 1) * per)), s = blockIdx.y; blockIdx.x = j
// (a hidden unit), blockDim.x = 256. Thread i: dW1[j, i] = sum_n dh1[n, j] p2[n, i]; thread c < 10 also
// dW2[c, j] = sum_n dlogits[n, c] h1[n, j]; thread 10: db1[j] = sum_n dh1[n, j]; block j = 0, threads
// 11..20: db2[c - 11] = sum_n dlogits[n, c - 11], and the row's padding columns 0. Each sum runs over n
// in order, four images' loads in flight. Writes row s of `part` (width floats, the flat layout; a grid
// with one range is handed the gradient buffer itself).
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
  float a = 0.f;
  int n = n0;
  for (; n + 4 <= n1; n += 4) {
    float d[4], x[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      d[k] = __ldg(dh1 + (size_t)(n + k) * H_HID + j);
      x[k] = __ldg(p2 + (size_t)(n + k) * H_IN + t);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) a = fmaf(d[k], x[k], a);
  }
  for (; n < n1; ++n) a = fmaf(__ldg(dh1 + (size_t)n * H_HID + j), __ldg(p2 + (size_t)n * H_IN + t), a);
  row[j * H_IN + t] = a;
  if (t < H_OUT) {
    float b = 0.f;
    for (int m = n0; m < n1; ++m) b = fmaf(__ldg(dlogits + (size_t)m * H_OUT + t), __ldg(h1 + (size_t)m * H_HID + j), b);
    row[off_w2 + t * H_HID + j] = b;
  } else if (t == H_OUT) {
    float b = 0.f;
    for (int m = n0; m < n1; ++m) b += __ldg(dh1 + (size_t)m * H_HID + j);
    row[off_b1 + j] = b;
  } else if (j == 0 && t < 2 * H_OUT + 1) {
    const int c = t - H_OUT - 1;
    float b = 0.f;
    for (int m = n0; m < n1; ++m) b += __ldg(dlogits + (size_t)m * H_OUT + c);
    row[off_b2 + c] = b;
  }
  if (j == 0) {   // the padding between tensors
    for (int e = H_HID * H_IN + t; e < width; e += H_THREADS) {
      const bool pad = (e < off_b1) || (e >= off_b1 + H_HID && e < off_w2) ||
                       (e >= off_w2 + H_OUT * H_HID && e < off_b2);
      if (pad) row[e] = 0.f;
    }
  }
}
