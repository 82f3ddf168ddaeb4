"""Many LeNets at once, ours beside PyTorch's best way, in one process on one GPU: K models at 128 images each
on Fashion-MNIST's training split, each model its own data order and learning rate, SGD with Nesterov
momentum, label smoothing 0.1.

  ours     lenet.pack.Pack: one step of K models captured in a CUDA graph, each step's batches gathered
           by one launch beside it (what `lenet sweep` runs)
  PyTorch  torch.func: stack_module_state + vmap(grad(functional_call)), the whole step (gather included)
           captured in one CUDA graph (the anchor of the sweep issue, scripts/probes/torch_ensemble.py
           of the shared probes)

Each is timed over one whole epoch (468 steps of 128) after one epoch of warm-up; prints us per step,
images per second over all models, and seconds per model-epoch.

    python scripts/sweep_bench.py --models 1 4 16 64 [--data-dir DIR] [--no-torch]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

B = 128


def ours(train, test, K: int, algo: str, deterministic: bool = False) -> float:
    """Seconds per step of a pack of K."""
    from lenet.data import GpuDataset, pixel_stats
    from lenet.engines import Policy
    from lenet.pack import Config, Pack

    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    mean, std = pixel_stats(train[0])
    tr, te = GpuDataset(*train, mean, std, stream), GpuDataset(*test, mean, std, stream)
    configs = [Config(seed=k, lr=0.05 + 0.1 * k / max(K - 1, 1), warmup_epochs=0, flip=False, epochs=3, batch_size=B)
               for k in range(K)]
    pack = Pack(configs, tr, te, policy=Policy(fwd=algo, bwd_data=algo, bwd_filter=algo, deterministic=deterministic),
                plan_cache=True,
                models=max(K, 2) if K > 1 else 1)
    steps = tr.size // B   # whole batches, as the anchor
    for _ in range(2):
        orders = pack.begin_epoch()
        pack.stream.synchronize()
        t = time.perf_counter()
        for s in range(steps):
            pack.model.load_pack(tr, orders, s * B, B, pack.aug, pack.epoch_dev, pack.lr_table, pack.lr_at, s)
            pack.model.step(B)
        pack.stream.synchronize()
        dt = time.perf_counter() - t
    pack.close()
    return dt / steps


def torch_ensemble(train, K: int) -> tuple[float, str]:
    """Seconds per step of PyTorch's torch.func ensemble of K (the anchor)."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad, stack_module_state, vmap
    from torch_lenet import TorchLeNet as LeNet, exact_float32   # the project's PyTorch LeNet (scripts/)

    exact_float32()
    X = torch.as_tensor(train[0].copy()).cuda().float().div(255)
    Y = torch.as_tensor(train[1].copy()).long().cuda()
    X = ((X - X.mean()) / X.std()).unsqueeze(1)
    steps = len(Y) // B
    base = LeNet().to("meta")

    def loss_fn(p, x, y):
        return F.cross_entropy(functional_call(base, p, (x,)), y, label_smoothing=0.1)
    models = [LeNet().cuda() for _ in range(K)]
    params, _ = stack_module_state(models)
    params = {k: v.detach().clone() for k, v in params.items()}
    mom = {k: torch.zeros_like(v) for k, v in params.items()}
    lr = torch.linspace(0.05, 0.15, K, device="cuda")
    ib = torch.zeros(K, B, dtype=torch.long, device="cuda")
    g = vmap(grad(loss_fn))

    def step():
        x, y = X[ib], Y[ib]
        gr = g(params, x, y)
        for k in params:
            m = mom[k]
            m.mul_(0.9).add_(gr[k])
            upd = gr[k].add(m, alpha=0.9)
            params[k].sub_(upd * lr.view(-1, *[1] * (upd.dim() - 1)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run, mode = graph.replay, "CUDA graph"
    except Exception as e:  # noqa: BLE001
        run, mode = step, f"eager ({type(e).__name__})"
    perms = torch.stack([torch.randperm(len(Y), device="cuda")[: steps * B].view(steps, B) for _ in range(K)], 1)
    for _ in range(2):   # a warm-up epoch, then the timed one
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(steps):
            ib.copy_(perms[i])
            run()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    torch.cuda.empty_cache()
    return dt / steps, mode


def main() -> int:
    global B
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--algo", default="exhaustive", help="ours' search (default: exhaustive, kept in the plan cache)")
    p.add_argument("--no-torch", dest="torch", action="store_false")
    p.add_argument("--batch", type=int, default=B, help=f"images per model a step (default: {B}, the anchor's)")
    p.add_argument("--deterministic", action="store_true",
                   help="ours under --deterministic: each model its lone run's grid, candidates and matmuls")
    args = p.parse_args()
    B = args.batch
    from lenet import data

    root = data.find_dataset(args.data_dir)
    if root is None:
        print(data.not_found_message(args.data_dir), file=sys.stderr)
        return 2
    (train, test) = data.load_splits(root, ("train", "test"))
    import cupy

    print(f"GPU {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()} | {data.dataset_name(root)} | batch {B} "
          f"per model | {len(train[0]) // B} steps an epoch")
    print("| models K | ours us/step | ours M img/s | ours s per model-epoch | PyTorch us/step | PyTorch M img/s | "
          "PyTorch s per model-epoch | ours / PyTorch |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for K in args.models:
        o = ours(train, test, K, args.algo, args.deterministic)
        steps = len(train[0]) // B
        row = f"| {K} | {o * 1e6:.1f} | {K * B / o / 1e6:.2f} | {o * steps / K:.4f} |"
        if args.torch:
            t, mode = torch_ensemble(train, K)
            row += f" {t * 1e6:.1f} | {K * B / t / 1e6:.2f} | {t * steps / K:.4f} | {t / o:.2f}x |"
        else:
            row += " - | - | - | - |"
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
