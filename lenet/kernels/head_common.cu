// What the head's two modules share (lenet/kernels/__init__.py: SOURCES): its shapes and block size.
// head.cu holds the forward (with the loss and the data gradients), head_weights.cu the weight and
// bias gradients: two modules, so that neither compile waits for the other on a first run (Note
// [first run] in descriptors/modules.py).

#define H_IN 256
#define H_HID 120
#define H_OUT 10
#define H_MAXG 8
#define H_THREADS 256
#define H_WARPS (H_THREADS / 32)
#define H_UNITS_PER_WARP (H_HID / H_WARPS)   // 15
#define H_BATCH 5                            // W1 rows a warp loads before using any

// A pack of K models (lenet sweep) runs each kernel of the head once for all K, model m on blockIdx.y of
// the forward and blockIdx.z of the weights' kernel (Note [model from the grid] in stage_common.cu): its
// images N rows after model m - 1's, its weights and gradients ps floats after (the flat buffers are
// (K, ps)), its loss totals, ticket and label smoothing its own. These are the pack versions' extra
// parameters and offsets (modules head__pack and head_weights__pack, compiled with LENET_PACK); the
// one-model modules compile without them. Each model's grid is its lone run's, so a model of a pack sums
// in the order of its lone run (Note [a pack and a lone run] in lenet/pack.py).
#ifdef LENET_PACK
#define HEAD_PACK_PARAMS , int ps, const float* __restrict__ eps_models, long long part_stride
#define HEAD_MODEL(ptr, per, m) ((ptr) = (ptr) ? (ptr) + (size_t)(m) * (size_t)(per) : (ptr))
#else
#define HEAD_PACK_PARAMS
#endif
