"""What one more kernel costs inside a CUDA graph: K dependent launches of an empty kernel (and of a
one-block kernel that does a little work), captured once and replayed, for several K.

    python3 scripts/probes/graph_nodes.py

Prints us per replay and the slope per launch: the price of a launch the step could fuse away.
"""

from __future__ import annotations

import cupy as cp

SRC = r"""
extern "C" __global__ void empty_kernel(float* p) {}
extern "C" __global__ void small_kernel(float* p) { p[threadIdx.x] = p[threadIdx.x] * 0.5f + 1.f; }
"""


def main():
    mod = cp.RawModule(code=SRC)
    buf = cp.zeros(1024, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    for name, grid, threads in (("empty", 1, 32), ("small", 1, 256), ("small", 132, 256)):
        fn = mod.get_function(f"{name}_kernel")
        rows = []
        for k in (1, 2, 5, 10, 20, 40):
            with stream:
                fn((grid,), (threads,), (buf,))
                stream.synchronize()
                stream.begin_capture()
                for _ in range(k):
                    fn((grid,), (threads,), (buf,))
                g = stream.end_capture()
                for _ in range(20):
                    g.launch(stream)
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(stream)
                for _ in range(500):
                    g.launch(stream)
                b.record(stream)
                b.synchronize()
            rows.append((k, cp.cuda.get_elapsed_time(a, b) * 1000 / 500))
        slope = (rows[-1][1] - rows[0][1]) / (rows[-1][0] - rows[0][0])
        print(f"{name} grid {grid}: " + "  ".join(f"K={k}: {us:.1f} us" for k, us in rows)
              + f"  | {slope:.2f} us per launch")


if __name__ == "__main__":
    main()
