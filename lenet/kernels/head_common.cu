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
