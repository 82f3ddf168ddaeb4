"""Where the start-up seconds of a program go: each phase of building and running one step,
timed in a fresh process (run it twice: the second sees warm on-disk caches).

    python3 scripts/probes/startup.py [--batch 64] [--algo heuristic] [--json PATH]
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--algo", default="heuristic")
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows, last = [], [T0]

    def mark(name):
        now = time.perf_counter()
        rows.append((name, now - last[0]))
        last[0] = now

    import numpy as np
    mark("import numpy")
    import cupy
    mark("import cupy")
    import descriptors
    mark("import descriptors (libcudnn)")
    try:
        importlib.import_module("cudnn")
    except ImportError:
        pass
    mark("import cudnn frontend")
    from lenet import kernels, model as lenet_model
    mark("import lenet.model")
    cupy.cuda.runtime.getDeviceCount()
    cupy.zeros(1)
    mark("CUDA context + first allocation")
    h = descriptors.Handle()
    mark("cuDNN handle")
    for mod in ("data", "sgd", "softmax_ce"):
        kernels._module(mod).get_function({"data": "gather_batch_kernel", "sgd": "sgd_kernel",
                                           "softmax_ce": "softmax_ce_kernel"}[mod])
    mark("compile/load our kernels")
    from lenet.engines import Policy

    policy = Policy.parse(args.algo, engine=args.engine)
    m = lenet_model.LeNet(max_batch=args.batch, policy=policy, cuda_graph=True, stream=h.stream)
    mark("LeNet(...) (buffers, cuBLAS)")
    m.plan(args.batch)
    mark(f"plan({args.batch}) ({args.algo} search)")
    rng = np.random.default_rng(0)
    m.load_batch(rng.standard_normal((args.batch, 1, 28, 28)).astype(np.float32),
                 rng.integers(0, 10, args.batch).astype(np.int32))
    m.step(args.batch, 0.01)
    m.stream.synchronize()
    mark("first step (eager warm-up + capture + replay)")
    m.step(args.batch, 0.01)
    m.stream.synchronize()
    mark("second step")
    total = time.perf_counter() - T0
    for name, s in rows:
        print(f"{name:<48s} {s * 1000:9.1f} ms")
    print(f"{'total (from interpreter start of this file)':<48s} {total * 1000:9.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "total_s": total}, indent=1))


if __name__ == "__main__":
    main()
