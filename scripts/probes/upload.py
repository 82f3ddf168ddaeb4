"""Probe (GPU): the training split's upload (lenet/data.py, GpuDataset), as python -m lenet.train does it
(cupy.asarray of the dataset cache's memory-mapped uint8 array, its pages already read by the pixel
statistics) against other ways, ms each, in a fresh process per repeat:

    asarray   cupy.asarray(images) on the model's stream (what GpuDataset does)
    pinned    the bytes copied into page-locked memory (cupy.cuda.alloc_pinned_memory), then one
              asynchronous copy
    chunks    cupy.asarray per 8 MB slice into one device array

    python3 scripts/probes/upload.py [--data-dir data/fashion-mnist] [--repeats 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(data_dir: str) -> None:
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from lenet import data

    root = data.find_dataset(data_dir)
    x, _ = data.load_split(root, "train", data.cache_dir())   # the memory-mapped inflated copy, as a later run reads it
    data.pixel_stats(x)   # touches every page, as the trainer's start-up does
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    warm = cupy.empty(1 << 20, cupy.uint8)   # the pool's first allocation, outside the timings
    del warm
    out = []
    t = time.perf_counter()
    with s:
        a = cupy.asarray(x)
    s.synchronize()
    out.append(("asarray", time.perf_counter() - t))
    del a
    t = time.perf_counter()
    mem = cupy.cuda.alloc_pinned_memory(x.nbytes)
    t1 = time.perf_counter()
    host = np.frombuffer(mem, np.uint8, x.nbytes).reshape(x.shape)
    np.copyto(host, x)
    t2 = time.perf_counter()
    b = cupy.empty(x.shape, cupy.uint8)
    b.set(host, stream=s)
    s.synchronize()
    out.append(("pinned (alloc / copy / transfer)", time.perf_counter() - t,
                f"{1e3 * (t1 - t):.1f} / {1e3 * (t2 - t1):.1f} / {1e3 * (time.perf_counter() - t2):.1f}"))
    t = time.perf_counter()
    c = cupy.empty(x.shape, cupy.uint8)
    flat, cf = x.reshape(-1), c.reshape(-1)
    step = 8 << 20
    with s:
        for i in range(0, flat.size, step):
            cf[i:i + step].set(np.ascontiguousarray(flat[i:i + step]), stream=s)
    s.synchronize()
    out.append(("chunks", time.perf_counter() - t))
    for row in out:
        print(f"{row[0]:<36} {1e3 * row[1]:7.1f} ms" + (f"  ({row[2]})" if len(row) > 2 else ""), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default="data/fashion-mnist")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.data_dir)
        return 0
    for r in range(args.repeats):
        p = subprocess.run([sys.executable, __file__, "--child", "--data-dir", args.data_dir], capture_output=True,
                           text=True)
        print(f"repeat {r}:\n{p.stdout}{p.stderr[-500:] if p.returncode else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
