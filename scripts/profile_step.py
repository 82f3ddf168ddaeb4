"""Run training steps of our LeNet (and optionally PyTorch's) for a profiler to look at.

    ncu --clock-control none --nvtx --nvtx-include "step/" --metrics gpu__time_duration.sum \
        --print-summary per-kernel python3 scripts/profile_step.py --batch 64

The model is planned as the CUDA-graph step plans it (the search times candidates as a graph
runs them) and warmed up; then --steps steps run with the same planned operations launched
one by one, inside an NVTX range named "step", so a profiler sees each kernel of the step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lenet.engines import FLAGS, Policy  # noqa: E402
from lenet.model import LeNet  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--algo", default="exhaustive")
    ap.add_argument("--engine", default="auto", choices=FLAGS)
    ap.add_argument("--models", type=int, default=1, help="a pack of this many models (lenet sweep), each at --batch")
    ap.add_argument("--graph", action="store_true", help="replay the profiled steps from the CUDA graph")
    ap.add_argument("--no-fused", action="store_true", help="the plain step (no cuDNN/cuBLASLt fusion)")
    ap.add_argument("--torch", action="store_true", help="profile PyTorch's step instead (float32, no TF32)")
    ap.add_argument("--deterministic", action="store_true",
                    help="reproducible choices: no timing decides (fewest kernels: for compute-sanitizer)")
    ap.add_argument("--plan-cache", action="store_true",
                    help="build from the stored choices (an earlier train_step's), so a profiler sees what the "
                         "program chose, not a search that the profiler's serialized launches timed")
    args = ap.parse_args()
    if args.torch:
        return torch_steps(args)
    rng = np.random.default_rng(0)
    K = args.models
    x = rng.standard_normal((K, args.batch, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, (K, args.batch)).astype(np.int32)
    if K == 1:
        x, y = x[0], y[0]
    import cupy

    m = LeNet(max_batch=args.batch, policy=Policy.parse(args.algo, engine=args.engine, deterministic=args.deterministic,
                                                       fused=not args.no_fused),
              cuda_graph=True, plan_cache=args.plan_cache, models=K, seed=list(range(K)), momentum=0.9)
    m.load_batch(x, y)
    for _ in range(5):
        m.step(args.batch, 0.01)
    m.cuda_graph = args.graph   # the same planned operations, launched one by one unless --graph
    m.stream.synchronize()
    cupy.cuda.nvtx.RangePush("step")
    for _ in range(args.steps):
        m.step(args.batch, 0.01)
    m.stream.synchronize()
    cupy.cuda.nvtx.RangePop()
    print("loss " + " ".join(f"{v:.4f}" for v in np.atleast_1d(m.loss())))
    # Free everything before exit, so a leak check lists only what was really lost.
    import gc

    m.close()   # what the engines made for it (Note [search state] in lenet/plan.py)
    del m
    gc.collect()
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    print(f"after cleanup: pool holds {pool.total_bytes()} bytes ({pool.used_bytes()} in use)")
    if pool.used_bytes():
        report_holders()


def report_holders(depth: int = 6) -> None:
    """Print what keeps a model or a random generator alive: the chain of referrers up to ``depth``."""
    import gc
    import types

    roots = [o for o in gc.get_objects() if type(o).__name__ in ("LeNet", "XORWOW", "Workspace")]
    print(f"alive: {len(roots)} of LeNet / XORWOW / Workspace")
    for i in range(min(4, len(roots))):
        chain, obj, ours = [], roots[i], {id(roots)}
        for _ in range(depth):
            refs = gc.get_referrers(obj)
            ours.add(id(refs))
            refs = [r for r in refs if id(r) not in ours
                    and not (isinstance(r, types.FrameType) and r.f_code.co_name == "report_holders")]
            ours.add(id(refs))
            if not refs:
                break
            obj = refs[0]
            ours.add(id(obj))
            chain.append(f"frame {obj.f_code.co_name} {obj.f_code.co_filename}:{obj.f_lineno}"
                         if isinstance(obj, types.FrameType) else
                         f"{type(obj).__name__} keys={list(obj)[:5]}" if isinstance(obj, dict) else
                         f"{type(obj).__name__} {str(obj)[:100]}")
            del refs
        print(f"  {type(roots[i]).__name__} <- " + " <- ".join(chain))


def torch_steps(args):
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # the PyTorch reference
    from torch_lenet import exact_float32, from_state

    from lenet.params import init_host
    exact_float32()
    m = from_state(init_host(0))
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.batch, 1, 28, 28, device="cuda")
    y = torch.randint(0, 10, (args.batch,), device="cuda")
    for _ in range(5 + args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
