"""Side-by-side benchmark: a full LeNet training step (forward, backward, momentum SGD), ours
and PyTorch's, in one process on one GPU, interleaved.

    python3 scripts/bench.py                       # batch sizes 1 64 256 1024 8192 65536
    python3 scripts/bench.py --batch 64 256 --repeats 9 --json bench.json

PyTorch, plain float32 (TF32 off): eager and CUDA graph, each with cudnn.benchmark off and on, and
above 8192 images the whole step as gradient accumulation over 8192-image micro-batches in one CUDA
graph (how a PyTorch user runs a large batch); its fastest is the yardstick. PyTorch with TF32 convolutions (its default), CUDA graph, is an extra
line, compared with ours under --allow-tf32. Ours, all as CUDA graphs: --engine legacy, graph, ours
and auto (exact float32), auto with --allow-tf32, and auto eager. --variants picks some of them. Each repeat times a run of steps
with CUDA events after warm-up (planning and search excluded); the table shows the median over
repeats. Also times one epoch of 60,000 GPU-resident images at batch 64.
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

from lenet.engines import Policy  # noqa: E402
from lenet import data  # noqa: E402
from lenet.model import LeNet  # noqa: E402
from lenet.params import init_host  # noqa: E402
from torch_lenet import exact_float32, from_state  # noqa: E402

LR = 0.01


def steps_for(batch: int) -> int:
    """Steps per timed run: enough for ~20 ms of work, at least 5."""
    return int(max(5, min(200, 2_000_000 // (batch * 100))))


def lt_workspace(model) -> int:
    """Bytes of the model's cuBLASLt workspace, where its head made one."""
    lazy = model.planner.state("cublaslt").get("lt")
    return lazy.made.workspace_bytes if lazy is not None and lazy.made is not None else 0


class Ours:
    def __init__(self, batch, graph, policy, fused=True):
        """policy: a lenet.engines.Policy (engine, TF32 and the rest)."""
        import gc

        import cupy
        self.cupy = cupy
        pool = cupy.get_default_memory_pool()
        gc.collect()
        pool.free_all_blocks()
        base = pool.used_bytes()
        self.m = LeNet(max_batch=batch, policy=policy, seed=0, cuda_graph=graph, fused=fused, momentum=0.9)
        rng = np.random.default_rng(0)
        self.m.load_batch(rng.standard_normal((batch, 1, 28, 28)).astype(np.float32),
                          rng.integers(0, 10, batch).astype(np.int32))
        self.batch = batch
        self.m.plan(batch)
        pool.free_all_blocks()   # the search's temporaries
        self.step()
        self.m.stream.synchronize()
        self.rows = self.m.describe(batch)
        # A step allocates nothing: what is in use after one is its peak (search temporaries excluded).
        self.peak = pool.used_bytes() - base
        # What the step needs: activations and their gradients, parameters, gradients, momentum,
        # the cuDNN and cuBLAS workspaces.
        self.tensor_bytes = (sum(a.nbytes for a in self.m.buf.values()) + 3 * self.m.params.nbytes
                             + self.m.workspace.size + self.m.blas.workspace_bytes
                             + lt_workspace(self.m))
        self.stream = self.m.stream

    def step(self):
        self.m.step(self.batch, LR)

    def close(self):
        del self.m
        self.cupy.get_default_memory_pool().free_all_blocks()


class Torch:
    """PyTorch's step with its own backend flags (cudnn.benchmark, TF32), set before every use."""

    def __init__(self, batch, graph, benchmark=False, tf32=False, compile_=False, micro=None):
        self.flags, self.micro, self.batch = (benchmark, tf32), micro, batch
        self._flags()
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
            for _ in range(3):   # warm-up (and cudnn.benchmark's search), on the side stream capture wants
                self._step()
        torch.cuda.synchronize()
        if graph:
            self.graph = torch.cuda.CUDAGraph()
            self.opt.zero_grad(set_to_none=True)
            with torch.cuda.graph(self.graph, stream=self.stream):
                self._step()
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated() - base

    def _flags(self):
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = self.flags

    def _step(self):
        self.opt.zero_grad(set_to_none=self.graph is None)
        if self.micro is None:
            loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
            loss.backward()
        else:   # the mean over the whole batch, accumulated micro-batch by micro-batch
            for s in range(0, self.batch, self.micro):
                xs, ys = self.x[s:s + self.micro], self.y[s:s + self.micro]
                loss = torch.nn.functional.cross_entropy(self.model(xs), ys, reduction="sum") / self.batch
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
    v._flags()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(v.stream):
        s.record()
        for _ in range(k):
            v.step()
        e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1000 / k


TORCH_FP32 = ("torch eager", "torch eager bench", "torch graph", "torch graph bench", "torch graph accum")
MICRO = 8192   # PyTorch's micro-batch above this batch size


def makers(batch, algo, compile_):
    ours = lambda engine, graph=True, tf32=False: (lambda: Ours(  # noqa: E731
        batch, graph, Policy.parse(algo, engine=engine, allow_tf32=tf32)))
    m = {"torch eager": lambda: Torch(batch, False),
         "torch eager bench": lambda: Torch(batch, False, benchmark=True),
         "torch graph": lambda: Torch(batch, True),
         "torch graph bench": lambda: Torch(batch, True, benchmark=True),
         "torch graph tf32": lambda: Torch(batch, True, benchmark=True, tf32=True),
         "ours eager auto": ours("auto", graph=False),
         "ours legacy": ours("legacy"),
         "ours graph": ours("graph"),
         "ours ours": ours("ours"),
         "ours auto": ours("auto"),
         "ours auto tf32": ours("auto", tf32=True)}
    if batch > MICRO:
        m["torch graph accum"] = lambda: Torch(batch, True, micro=MICRO)
    if compile_:
        m["torch compile"] = lambda: Torch(batch, False, compile_=True)
    return m


def bench_batch(batch, repeats, algo, compile_, only=None) -> dict:
    variants, out = {}, {}
    for name, make in makers(batch, algo, compile_).items():
        if only and name not in only:
            continue
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
            out[n]["operations"] = v.rows
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
    ap.add_argument("--no-epoch", action="store_true", help="skip the epoch timing")
    ap.add_argument("--variants", nargs="+", default=None, help="only these variants (names as printed)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    exact_float32()
    import descriptors
    from descriptors.graph import available
    gpu = torch.cuda.get_device_name()
    print(f"GPU {gpu} | cuDNN {descriptors.version_string()} | graph API {available()[1]} | torch "
          f"{torch.__version__} (cuDNN {torch.backends.cudnn.version()}) | ours: --algo {args.algo}, fused, "
          f"CUDA graph unless eager | momentum SGD")
    results = {}
    hdr = f"{'batch':>6} | {'variant':<17} | {'us/step':>10} | {'M img/s':>8} | {'peak MB':>8} | {'spread':>6}"
    print(hdr)
    print("-" * len(hdr))
    for b in args.batch:
        r = bench_batch(b, args.repeats, args.algo, args.compile, args.variants)
        results[b] = r
        for name, v in r.items():
            if "error" in v:
                print(f"{b:>6} | {name:<17} | {v['error']}")
                continue
            print(f"{b:>6} | {name:<17} | {v['us_per_step']:>10.1f} | {v['m_img_per_s']:>8.3f} | "
                  f"{v['peak_bytes'] / 2**20:>8.1f} | {v['spread_pct']:>5.1f}%")
        fp32 = {k: r[k]["us_per_step"] for k in TORCH_FP32 if "us_per_step" in r.get(k, {})}
        if not fp32:
            continue
        best_name = min(fp32, key=fp32.get)
        summary = {}
        for ours in ("ours legacy", "ours graph", "ours ours", "ours auto"):
            if "us_per_step" in r.get(ours, {}):
                summary[ours] = fp32[best_name] / r[ours]["us_per_step"]
        r["speedup_vs_best_torch_fp32"] = summary
        line = ", ".join(f"{k[5:]} {v:.2f}x" for k, v in summary.items())
        print(f"{b:>6} | vs the fastest PyTorch float32 ({best_name}, {fp32[best_name]:.1f} us): {line}")
        if "us_per_step" in r.get("ours auto tf32", {}) and "us_per_step" in r.get("torch graph tf32", {}):
            t = r["torch graph tf32"]["us_per_step"] / r["ours auto tf32"]["us_per_step"]
            t32 = r["torch graph tf32"]["us_per_step"] / r["ours auto"]["us_per_step"] if "ours auto" in summary \
                else float("nan")
            r["tf32_speedup"] = {"ours_tf32": t, "ours_fp32": t32}
            print(f"{b:>6} | vs PyTorch TF32 ({r['torch graph tf32']['us_per_step']:.1f} us): ours auto tf32 {t:.2f}x, "
                  f"ours auto float32 {t32:.2f}x")
    if not args.no_epoch:
        e = bench_epoch(Policy.parse(args.algo))
        results["epoch"] = e
        print(f"epoch of 60,000 GPU-resident images at batch 64 ({e['source']}): ours {e['ours_s']:.3f} s | "
              f"PyTorch eager {e['torch_eager_s']:.3f} s | {e['torch_eager_s'] / e['ours_s']:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": gpu, "results": {str(k): v for k, v in results.items()}},
                                              indent=1, default=str))


if __name__ == "__main__":
    main()
