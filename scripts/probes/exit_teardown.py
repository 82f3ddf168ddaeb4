"""Probe (GPU): what a program's exit costs once its GPU work is done, and whether that cost can run
beside something else (the plotting child's last drawing, Note [fast exit] in lenet/cli.py).

Each variant runs in a child process that builds a LeNet (--engine ours, the fast recipe's batch), holds
about as much device memory as a training run (the dataset's upload), runs a few steps, and then:

    exit      os._exit at once (what cli.leave does): the driver's teardown happens in the kernel's
              closing of the process
    release   the primary context released first (cuDevicePrimaryCtxReset), timed, then os._exit
    thread    the release on a thread while the main thread sleeps --overlap seconds (a stand-in for the
              wait on the plotting child), then os._exit once both are done
    nocuda    (for scale) CuPy and NumPy imported, no CUDA context, then os._exit
    context   only GPU 0's primary context (cuInit, the CUDA runtime), then os._exit
    nomem     the LeNet and its steps without the 220 MB, then os._exit

The parent reports, per variant and repeat, the child's own clock for the release (where there is one)
and the time from the child's last timestamp to the process gone (its exit, measured by the parent).

    python3 scripts/probes/exit_teardown.py [--repeats 3] [--overlap 0.1] [--variants exit nocuda context nomem]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(variant: str, overlap: float) -> None:
    sys.path.insert(0, str(ROOT))
    import threading

    import cupy
    import numpy as np

    if variant in ("nocuda", "context"):
        if variant == "context":
            cupy.cuda.runtime.free(0)
        print(f"last {time.time():.6f} release None", flush=True)
        os._exit(0)
    from lenet.model import LeNet
    from lenet.engines import Policy

    rng = np.random.default_rng(0)
    m = LeNet(max_batch=128, policy=Policy.parse("heuristic", engine="ours"), cuda_graph=True)
    m.load_batch(rng.standard_normal((128, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 128).astype(np.int32))
    if variant != "nomem":
        data = cupy.empty((70000, 784), cupy.float32)   # the dataset's upload: 220 MB
        data.fill(0)
    for _ in range(20):
        m.step(128, 0.01)
    m.stream.synchronize()

    def release():
        from cuda.bindings import driver

        t = time.perf_counter()
        cupy.cuda.Device().synchronize()
        (err,) = driver.cuDevicePrimaryCtxReset(0)
        return time.perf_counter() - t, err

    took = None
    if variant == "release":
        took, err = release()
    elif variant == "thread":
        out = []
        th = threading.Thread(target=lambda: out.append(release()))
        t = time.perf_counter()
        th.start()
        time.sleep(overlap)
        th.join()
        took = time.perf_counter() - t
    print(f"last {time.time():.6f} release {took if took is None else f'{took:.4f}'}", flush=True)
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--overlap", type=float, default=0.1)
    ap.add_argument("--variants", nargs="+", default=["exit", "release", "thread"],
                    choices=["exit", "release", "thread", "nocuda", "context", "nomem"])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.overlap)
        return 0
    for r in range(args.repeats):
        for variant in args.variants:
            p = subprocess.run([sys.executable, __file__, "--child", variant, "--overlap", str(args.overlap)],
                               capture_output=True, text=True)
            gone = time.time()
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("last ")]
            if p.returncode or not line:
                print(f"{variant}: failed ({p.returncode}): {p.stderr.strip()[-300:]}")
                continue
            _, last, _, took = line[-1].split()
            print(f"repeat {r} {variant:<8} release (child's clock) {took:>7} s | last line to process gone "
                  f"{gone - float(last):.4f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
