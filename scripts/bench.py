"""Side-by-side benchmark: a full LeNet training step (forward, backward, SGD), ours and PyTorch's,
in one process on one GPU, interleaved.

    python3 scripts/bench.py                       # batch sizes 1 64 256 1024 8192 65536
    python3 scripts/bench.py --batch 64 256 --repeats 9 --json bench.json

Variants: ours eager, ours CUDA graph (fused, the default), PyTorch eager and PyTorch with
the whole step in a CUDA graph (and torch.compile with --compile). Each repeat times a run of
steps with CUDA events after warm-up (algorithm search excluded); the table shows the median
over repeats. Both sides compute in plain float32 (no TF32; PyTorch's own default would let
cuDNN use TF32 for convolutions: --torch-tf32 to compare against that). Also times one epoch
of 60,000 GPU-resident images at batch 64.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from descriptors import AlgoPolicy  # noqa: E402
from lenet import data  # noqa: E402
from lenet.model import LeNet  # noqa: E402
from lenet.params import init_host  # noqa: E402
from torch_lenet import exact_float32, from_state  # noqa: E402

LR = 0.01


def steps_for(batch: int) -> int:
    """Steps per timed run: enough for ~20 ms of work, at least 5."""
    return int(max(5, min(200, 2_000_000 // (batch * 100))))


class Ours:
    def __init__(self, batch, graph, policy, fused=True):
        import cupy
        self.cupy = cupy
        pool = cupy.get_default_memory_pool()
        pool.free_all_blocks()
        base = pool.used_bytes()
        self.m = LeNet(max_batch=batch, policy=policy, seed=0, cuda_graph=graph, fused=fused, momentum=0.9)
        rng = np.random.default_rng(0)
        self.m.load_batch(rng.standard_normal((batch, 1, 28, 28)).astype(np.float32),
                          rng.integers(0, 10, batch).astype(np.int32))
        self.batch = batch
        self.step()
        self.m.stream.synchronize()
        # A step allocates nothing: what is in use after one is its peak (search temporaries excluded).
        self.peak = pool.used_bytes() - base
        # What the step needs: activations and their gradients, parameters, gradients, momentum,
        # the cuDNN and cuBLAS workspaces.
        self.tensor_bytes = (sum(a.nbytes for a in self.m.buf.values()) + 3 * self.m.params.nbytes
                             + self.m.workspace.size + self.m.blas.workspace_bytes
                             + (self.m.lt.workspace_bytes if self.m.lt is not None else 0))
        self.stream = self.m.stream

    def step(self):
        self.m.step(self.batch, LR)

    def close(self):
        del self.m
        self.cupy.get_default_memory_pool().free_all_blocks()


class Torch:
    def __init__(self, batch, graph, compile_=False):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        self.model = from_state(init_host(0))
        if compile_:
            self.model = torch.compile(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)
        g = torch.Generator(device="cuda").manual_seed(0)
        self.x = torch.randn(batch, 1, 28, 28, device="cuda", generator=g)
        self.y = torch.randint(0, 10, (batch,), device="cuda", generator=g)
        self.stream = torch.cuda.Stream()
        self.graph = None
        with torch.cuda.stream(self.stream):
            for _ in range(3):   # warm-up, also on the side stream as CUDA-graph capture wants
                self._step()
        torch.cuda.synchronize()
        if graph:
            self.graph = torch.cuda.CUDAGraph()
            self.opt.zero_grad(set_to_none=True)
            with torch.cuda.graph(self.graph, stream=self.stream):
                self._step()
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated() - base

    def _step(self):
        self.opt.zero_grad(set_to_none=self.graph is None)
        loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()

    def step(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()

    def close(self):
        del self.model, self.opt, self.graph
        torch.cuda.empty_cache()


def time_run(v, k: int) -> float:
    """Microseconds per step over k steps, CUDA events on the variant's stream."""
    if isinstance(v, Ours):
        import cupy
        s, e = cupy.cuda.Event(), cupy.cuda.Event()
        s.record(v.stream)
        for _ in range(k):
            v.step()
        e.record(v.stream)
        e.synchronize()
        return cupy.cuda.get_elapsed_time(s, e) * 1000 / k
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(v.stream):
        s.record()
        for _ in range(k):
            v.step()
        e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1000 / k


def bench_batch(batch, repeats, policy, compile_) -> dict:
    makers = {"ours eager": lambda: Ours(batch, False, policy, fused=True),
              "ours graph": lambda: Ours(batch, True, policy, fused=True),
              "torch eager": lambda: Torch(batch, False),
              "torch graph": lambda: Torch(batch, True)}
    if compile_:
        makers["torch compile"] = lambda: Torch(batch, False, compile_=True)
    variants, out = {}, {}
    for name, make in makers.items():
        try:
            variants[name] = make()
        except Exception as e:  # noqa: BLE001  a variant that cannot run is reported, not fatal
            out[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
    k = steps_for(batch)
    times = {n: [] for n in variants}
    for n, v in variants.items():
        time_run(v, max(2, k // 4))   # warm-up
    for _ in range(repeats):          # interleaved
        for n, v in variants.items():
            times[n].append(time_run(v, k))
    for n, v in variants.items():
        us = statistics.median(times[n])
        out[n] = {"us_per_step": us, "m_img_per_s": batch / us, "peak_bytes": int(v.peak),
                  "spread_pct": 100 * (max(times[n]) - min(times[n])) / us}
        if isinstance(v, Ours):
            out[n]["tensor_bytes"] = int(v.tensor_bytes)
        v.close()
    return out


def bench_epoch(policy) -> dict:
    """One epoch of 60,000 GPU-resident images at batch 64: ours (gather + graph replay) vs PyTorch."""
    root = data.find_dataset()
    if root is not None:
        x, y = data.load_split(root, "train")
    else:
        rng = np.random.default_rng(0)
        x, y = rng.integers(0, 256, (60000, 28, 28), dtype=np.uint8), rng.integers(0, 10, 60000).astype(np.uint8)
    mean, std = data.pixel_stats(x)
    B, N = 64, len(x)
    steps = -(-N // B)
    res = {"source": str(root) if root else "random uint8"}
    m = LeNet(max_batch=B, policy=policy, cuda_graph=True, momentum=0.9, weight_decay=5e-4)
    ds = data.GpuDataset(x, y, mean, std, m.stream)
    for sz in {B, N - (steps - 1) * B}:
        m.plan(sz)
    for epoch in range(2):   # the first epoch captures the graphs
        order = ds.order(0, epoch)
        m.stream.synchronize()
        t = time.perf_counter()
        for s in range(steps):
            n = min(B, N - s * B)
            m.load_from(ds, order, s * B, n, lr=LR)
            m.step(n)
        m.stream.synchronize()
        res["ours_s"] = time.perf_counter() - t
    timg, tlab = torch.as_tensor(x, device="cuda"), torch.as_tensor(y, device="cuda").long()
    model = from_state(init_host(0))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=5e-4)
    for epoch in range(2):
        order = torch.as_tensor(data.epoch_order(0, epoch, N).astype(np.int64), device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        for s in range(steps):
            idx = order[s * B:(s + 1) * B]
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(
                model(timg[idx].float().div(255).sub(mean).div(std).unsqueeze(1)), tlab[idx])
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        res["torch_eager_s"] = time.perf_counter() - t
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256, 1024, 8192, 65536])
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per variant (median; default 7)")
    ap.add_argument("--algo", default="exhaustive", help="our algorithm policy (default: exhaustive)")
    ap.add_argument("--compile", action="store_true", help="also torch.compile (slow to build)")
    ap.add_argument("--torch-tf32", action="store_true", help="let PyTorch use TF32 (its default) in cuDNN")
    ap.add_argument("--no-epoch", action="store_true", help="skip the epoch timing")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    exact_float32()
    if args.torch_tf32:
        torch.backends.cudnn.allow_tf32 = True
    policy = AlgoPolicy.parse(args.algo)
    import descriptors
    gpu = torch.cuda.get_device_name()
    print(f"GPU {gpu} | cuDNN {descriptors.version_string()} | torch {torch.__version__} "
          f"(cuDNN {torch.backends.cudnn.version()}) | float32{' (torch TF32)' if args.torch_tf32 else ''} "
          f"| ours: {policy}, fused (cuDNN conv+bias+ReLU, cuBLASLt epilogues), momentum SGD")
    results = {}
    hdr = f"{'batch':>6} | {'variant':<13} | {'us/step':>10} | {'M img/s':>8} | {'peak MB':>8} | {'spread':>6}"
    print(hdr)
    print("-" * len(hdr))
    for b in args.batch:
        r = bench_batch(b, args.repeats, policy, args.compile)
        results[b] = r
        best_torch = min((v["us_per_step"] for k, v in r.items() if k.startswith("torch") and "us_per_step" in v),
                         default=float("nan"))
        for name, v in r.items():
            if "error" in v:
                print(f"{b:>6} | {name:<13} | {v['error']}")
                continue
            print(f"{b:>6} | {name:<13} | {v['us_per_step']:>10.1f} | {v['m_img_per_s']:>8.3f} | "
                  f"{v['peak_bytes'] / 2**20:>8.1f} | {v['spread_pct']:>5.1f}%")
        ours = r.get("ours graph", {}).get("us_per_step")
        if ours:
            r["speedup_vs_best_torch"] = best_torch / ours
            mem = r["ours graph"]
            print(f"{b:>6} | ours graph is {best_torch / ours:.2f}x the fastest PyTorch variant | our peak "
                  f"{mem['peak_bytes'] / 2**20:.1f} MB for {mem['tensor_bytes'] / 2**20:.1f} MB of step tensors "
                  f"({mem['peak_bytes'] / mem['tensor_bytes']:.2f}x)")
    if not args.no_epoch:
        e = bench_epoch(policy)
        results["epoch"] = e
        print(f"epoch of 60,000 GPU-resident images at batch 64 ({e['source']}): ours {e['ours_s']:.3f} s | "
              f"PyTorch eager {e['torch_eager_s']:.3f} s | {e['torch_eager_s'] / e['ours_s']:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": gpu, "results": {str(k): v for k, v in results.items()}},
                                              indent=1))


if __name__ == "__main__":
    main()
