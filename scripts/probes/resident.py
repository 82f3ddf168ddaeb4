"""Probe (GPU): how many blocks of each of our stage kernels' launch shapes one SM holds at once (the
occupancy API, lenet.kernels.launch.resident), beside the blocks per SM each shape asks for, for the
kernels compiled for this GPU or for LENET_KERNEL_ARCH (Note [launch shapes from the device] in
lenet/kernels/launch.py). A shape whose ask is above what fits runs as a smaller grid of one wave.

    LENET_KERNEL_ARCH=75 python3 scripts/probes/resident.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    import cupy

    from lenet import kernels
    from lenet.kernels import stages
    from lenet.kernels.launch import resident

    d = cupy.cuda.Device()
    print(f"GPU {cupy.cuda.runtime.getDeviceProperties(d.id)['name'].decode()} ({d.compute_capability}), kernels "
          f"for {kernels.arch()}, {kernels.sm_count()} SMs, {d.attributes['MaxSharedMemoryPerMultiprocessor']} B "
          f"shared memory an SM, {d.attributes['MaxThreadsPerMultiProcessor']} threads an SM")
    heuristic = {name for rows in stages.table().values() for _, name in rows}
    for ks in stages.kernels().values():
        for c in ks.forward_candidates() + ks.backward_candidates():
            m = ks.module(c)
            fn = stages.function(m)
            images = getattr(c, "images", 0)
            threads = m.threads * (images or 1)
            fits = resident(fn, threads, m.smem_bytes(images))
            print(f"{ks.stage} {c.name:<22} {'heuristic' if c.name in heuristic else '':<9} threads {threads:>4} "
                  f"smem {m.smem_bytes(images):>6} B  regs {fn.num_regs:>3}  asks {c.per_sm:>2}  fits "
                  f"{fits:>2}{'  (grid capped)' if fits < c.per_sm else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
