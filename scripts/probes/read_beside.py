"""Whether the CPU or the GIL slows the dataset's read on a first run: Fashion-MNIST's training images
(26 MB of gzip) read by lenet.data.read_idx alone, then beside 6 and 12 of our modules compiling on
threads (NVRTC lets go of the GIL: what remains is the CPU they take). No GPU needed.

    python3 scripts/probes/read_beside.py [--data-dir data/fashion-mnist] [--arch 90]

# Note: on the H100 machine (16 cores, NVRTC 13.0, 2026-11-24) the read took 0.30-0.34 s alone and
# 0.40 s beside 12 compiles, where inside a first run of lenet.train it took 0.72-1.65 s: the CPU
# was not what slowed it, the start-up threads' imports holding the GIL were (Note [inflating beside
# threads] in lenet/data.py).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=str(ROOT / "data" / "fashion-mnist"))
    ap.add_argument("--arch", default="90")
    args = ap.parse_args()
    from lenet.kernels import nvrtc as modules

    from lenet import data, kernels

    path = Path(args.data_dir) / "train-images-idx3-ubyte.gz"

    def read() -> float:
        t = time.perf_counter()
        data.read_idx(path, ndim=3)
        return time.perf_counter() - t

    print(f"read alone: {read():.3f} s, {read():.3f} s")
    nv = modules.nvrtc()
    names = [*kernels.COMMON_MODULES, "stage1_forward", "stage1_backward_dense", "stage2_forward", "stage2_forward_tiled",
             "stage2_backward_split4", "stage2_backward_balanced"]
    for k in (6, 12):
        took: dict = {}

        def compile_one(name: str, tag: int = k) -> None:
            t = time.perf_counter()   # a comment makes each source new to NVRTC's own cache
            nv.compile(kernels.source(name) + f"\n// {tag}", name,
                       ("--device-as-default-execution-space", *nv.minimal, *kernels.options(name), f"-arch=sm_{args.arch}"))
            took[name] = time.perf_counter() - t

        threads = [threading.Thread(target=compile_one, args=(n,)) for n in names[:k]]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        r = read()
        for th in threads:
            th.join()
        print(f"beside {k} compiles: read {r:.3f} s, compiles {time.perf_counter() - t0:.3f} s in all")


if __name__ == "__main__":
    main()
