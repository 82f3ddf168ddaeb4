"""What programmatic dependent launch (PDL) saves in a chain of small dependent kernels inside a CUDA graph.

    python3 scripts/probes/pdl.py

K kernels of one block (or 64 blocks), each doing about a microsecond of dependent arithmetic on a
buffer the previous one wrote, captured once and replayed: launched plainly (CuPy), and launched with
cuLaunchKernelEx's programmatic-stream-serialization attribute, each kernel calling
griddepcontrol.launch_dependents on entry and griddepcontrol.wait before it reads. Prints us per
replay for both and the saving per edge.
"""

from __future__ import annotations

import ctypes

import cupy as cp
import numpy as np
from cuda.bindings import driver

SRC = r"""
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
extern "C" __global__ void work_kernel(float* p, int iters, int pdl) {
    if (pdl) { pdl_trigger(); pdl_wait(); }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = p[i];
    for (int k = 0; k < iters; ++k) v = v * 0.999f + 0.001f;
    p[i] = v;
}
"""


def launch_pdl(fn, grid, block, stream, args):
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
    cfg.sharedMemBytes = 0
    cfg.hStream = driver.CUstream(stream.ptr)
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    vals = (args[0].data.ptr, int(args[1]), int(args[2]))
    types = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int)
    err, = driver.cuLaunchKernelEx(cfg, driver.CUfunction(fn.kernel.ptr), (vals, types), 0)
    assert err == driver.CUresult.CUDA_SUCCESS, err


def time_graph(stream, body, reps=500):
    with stream:
        body()
        stream.synchronize()
        stream.begin_capture()
        body()
        g = stream.end_capture()
        for _ in range(20):
            g.launch(stream)
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        for _ in range(reps):
            g.launch(stream)
        b.record(stream)
        b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) * 1000 / reps


def main():
    mod = cp.RawModule(code=SRC)
    fn = mod.get_function("work_kernel")
    buf = cp.ones(64 * 256, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    for grid in (1, 64):
        for iters in (0, 500):
            for k in (2, 6, 12):
                plain = time_graph(stream, lambda: [fn((grid,), (256,), (buf, np.int32(iters), np.int32(0)))
                                                    for _ in range(k)])
                pdl = time_graph(stream, lambda: [launch_pdl(fn, grid, 256, stream, (buf, iters, 1))
                                                  for _ in range(k)])
                print(f"grid {grid:>3} iters {iters:>4} K={k:>2}: plain {plain:6.2f} us  pdl {pdl:6.2f} us"
                      f"  saving {(plain - pdl) / max(1, k - 1):5.2f} us per edge")
    # correctness: PDL chain gives the plain chain's result
    a = cp.ones(256, cp.float32)
    b = cp.ones(256, cp.float32)
    with stream:
        for _ in range(8):
            fn((1,), (256,), (a, np.int32(300), np.int32(0)))
            launch_pdl(fn, 1, 256, stream, (b, 300, 1))
        stream.synchronize()
    print("pdl result equals plain:", bool(cp.array_equal(a, b)))


if __name__ == "__main__":
    main()
