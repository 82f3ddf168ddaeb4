"""Can a process's first cuDNN graph (~0.23 s of one-time set-up) be paid beside CuPy's import
instead of after it? Each mode runs in a fresh process, as a program's start-up threads do:

- chain: what lenet.startup.preload did first. The driver's thread (cuInit, primary context); on the
  other, import CuPy, start its runtime, import descriptors and the frontend, make a cuDNN
  handle (descriptors.Handle, which needs CuPy) and build a 1x1 graph.
- split: the driver's thread goes on, through ctypes and the frontend alone (no CuPy): it
  loads libcudnn, imports the frontend, makes a handle with cudnnCreate and builds the 1x1
  graph on it, while the other thread imports CuPy and starts its runtime.
- create: as split, but the driver's thread stops after cudnnCreate; the graph is built after
  CuPy, as in chain. Says whether cudnnCreate alone carries the one-time cost.
- legacy: as create, then the descriptor API's heuristic query for a 1x1 convolution
  (cudnnGetConvolutionForwardAlgorithm_v7, through ctypes, which lets go of the GIL), as
  lenet.startup.warm_cudnn does it on the programs' driver thread now.
- dlopen: as create, then every libcudnn_*.so sub-library loaded through ctypes.

The main thread's first graph is timed step by step (the frontend's calls).

Each prints the seconds from process start to: CuPy imported, runtime started, first graph
built, everything done; and a second graph (conv2's forward, one plan) after it all.

    python3 scripts/probes/warm_overlap.py [--rounds 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("chain", "split", "create", "legacy", "dlopen")


class RawHandle:
    """A cudnnHandle_t from cudnnCreate through ctypes, in the shape ConvGraph reads."""

    class _Stream:
        ptr = 0

    def __init__(self):
        import ctypes

        from descriptors import _lib

        p = ctypes.c_void_p()
        _lib.call("cudnnCreate", ctypes.byref(p))
        self.ptr, self.device_id, self.stream = p.value, 0, self._Stream()


def first_graph_steps(cudnn, h, mark) -> None:
    """ConvGraph(h, "fwd", (1, 1, 4, 4), (1, 1, 1, 1), only=0), the frontend's calls one by one."""
    from descriptors.graph import _frontend_handle

    f32 = cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=f32, intermediate_data_type=f32, compute_data_type=f32,
                      handle=_frontend_handle(h))
    x = g.tensor(name="x", dim=[1, 1, 4, 4], stride=[16, 16, 4, 1], data_type=f32)
    w = g.tensor(name="w", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
    y = g.conv_fprop(image=x, weight=w, padding=[0, 0], stride=[1, 1], dilation=[1, 1])
    y.set_output(True).set_dim([1, 1, 4, 4]).set_stride([16, 16, 4, 1]).set_data_type(f32)
    mark(" pygraph + tensors")
    g.validate()
    mark(" validate")
    g.build_operation_graph()
    mark(" build_operation_graph")
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    mark(" create_execution_plans")
    g.build_plan_at_index(0)
    mark(" build_plan_at_index(0)")


def child(mode: str) -> dict:
    import threading

    sys.path.insert(0, str(ROOT))
    from lenet import startup

    t0 = time.perf_counter() - startup.process_seconds()
    at = {}

    def mark(name):
        at[name] = time.perf_counter() - t0

    ctx = threading.Event()

    def side():
        startup.start_context()
        mark("context")
        ctx.set()
        if mode == "chain":
            return
        from descriptors import _lib   # imports descriptors (numpy, ctypes): no CuPy
        _lib.version()
        if mode == "split":
            from descriptors.graph import ConvGraph, frontend

            frontend()
            mark("frontend (side)")
            h = RawHandle()
            mark("cudnnCreate (side)")
            ConvGraph(h, "fwd", (1, 1, 4, 4), (1, 1, 1, 1), only=0).close()
            mark("first graph")
        else:
            h = RawHandle()
            mark("cudnnCreate (side)")
            if mode == "legacy":
                startup.warm_cudnn(_lib.library_path())   # what python -m lenet.train's driver thread does
                mark("legacy heuristic (side)")
            elif mode == "dlopen":
                import ctypes

                for lib in sorted(Path(_lib.library_path()).parent.glob("libcudnn_*.so*")):
                    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                mark("sub-libraries loaded (side)")

    th = threading.Thread(target=side)
    th.start()
    import cupy

    mark("cupy imported")
    ctx.wait()
    cupy.cuda.runtime.free(0)
    mark("runtime started")
    import descriptors
    from descriptors.graph import ConvGraph, frontend

    if mode != "split":
        cudnn = frontend()
        mark("frontend imported")
        h = descriptors.Handle()
        mark("Handle")
        first_graph_steps(cudnn, h, mark)
        mark("first graph")
    th.join()
    h = descriptors.Handle()
    mark("all done")
    t = time.perf_counter()
    ConvGraph(h, "fwd", (64, 6, 12, 12), (16, 6, 5, 5), fuse="bias_relu", only=0).close()
    at["second graph took"] = time.perf_counter() - t
    return at


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    runs = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for m in MODES:
            r = subprocess.run([sys.executable, __file__, "--child", m], capture_output=True, text=True, cwd=ROOT)
            try:
                runs[m].append(json.loads(r.stdout.strip().splitlines()[-1]))
            except (IndexError, ValueError):
                print(m, "failed:", r.stderr.strip()[-800:])
    for m, rs in runs.items():
        print(f"--- {m}")
        for key in (rs[0] if rs else {}):
            vals = " ".join(f"{r.get(key, float('nan')):.3f}" for r in rs)
            print(f"  {key:<24s} {vals}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
