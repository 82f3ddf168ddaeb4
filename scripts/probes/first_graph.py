"""What the first cuDNN graph of a process costs, and what of it can be paid earlier: loading
cuDNN's sub-libraries, the frontend's import, a first graph of any shape.

    python3 scripts/probes/first_graph.py [--warm none|dlopen|graph|one] [--plans all|one]

Run once per --warm in fresh processes: the times printed are that process's first and
second graphs (conv2's forward with bias and ReLU, then conv1's weight gradient, batch 64),
with every listed plan built or only the first (a stored choice builds one: Note [one plan]
in descriptors/graph.py). --warm one: the warm-up graph builds one plan only.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm", choices=("none", "dlopen", "graph", "one"), default="none")
    ap.add_argument("--plans", choices=("all", "one"), default="all")
    args = ap.parse_args()
    rows = []

    def timed(name, fn):
        t = time.perf_counter()
        out = fn()
        rows.append((name, time.perf_counter() - t))
        return out

    import descriptors
    from descriptors import _lib, graph

    timed("libcudnn + frontend import", lambda: (_lib.version(), graph.frontend()))
    h = timed("cuDNN handle (context)", descriptors.Handle)
    if args.warm == "dlopen":
        folder = Path(_lib.library_path()).parent

        def load():
            for p in sorted(folder.glob("libcudnn_*.so*")):
                ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)
        timed(f"dlopen {len(list(folder.glob('libcudnn_*.so*')))} cuDNN sub-libraries", load)
    if args.warm in ("graph", "one"):
        timed(f"a 1x1 warm-up graph (batch 1), {'all plans' if args.warm == 'graph' else 'one plan'}",
              lambda: graph.ConvGraph(h, "fwd", (1, 1, 4, 4), (1, 1, 1, 1), only=0 if args.warm == "one" else None))
    only = 0 if args.plans == "one" else None
    timed(f"graph 1: conv2 fwd+bias+relu, {args.plans} plans",
          lambda: graph.ConvGraph(h, "fwd", (64, 6, 12, 12), (16, 6, 5, 5), fuse="bias_relu", only=only))
    timed(f"graph 2: conv1 wgrad, {args.plans} plans",
          lambda: graph.ConvGraph(h, "bwd-filter", (64, 1, 28, 28), (6, 1, 5, 5), only=only))
    for name, s in rows:
        print(f"{name:<46s} {s * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
