"""Many LeNets at once, ours beside PyTorch's best way, in one process on one GPU: K models at 128 images each
on Fashion-MNIST's training split, each model its own data order and learning rate, the same training on
both sides (SETTINGS: SGD with momentum 0.9, Nesterov, weight decay 5e-4, label smoothing 0.05, a constant
learning rate per model from 0.05 to 0.15, no augmentation, no moving average).

  ours     lenet.pack.Pack: one step of K models captured in a CUDA graph, each step's batches gathered
           by one launch beside it (what `lenet sweep` runs)
  PyTorch  the faster of its two ensembles (scripts/torch_ensembles.py): torch.func (stack_module_state +
           vmap(grad(functional_call))) and the K models as groups of one grouped convolution (the head as
           baddbmm), each step (its batches' gather included) captured in one CUDA graph, cudnn.benchmark
           on; and at K = 1 PyTorch's plain step (its LeNet, fused SGD, the whole step and its gather
           captured in one CUDA graph), which an ensemble of one does not beat

Each is timed over one whole epoch (468 steps of 128) after one epoch of warm-up, float32 with TF32 off;
prints us per step, images per second over all models and seconds per model-epoch, every PyTorch form's
time beside its fastest, and writes them to --json.

    python scripts/sweep_bench.py --models 1 4 16 64 [--data-dir DIR] [--torch func grouped] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # the PyTorch reference: tests/torch_lenet.py

B = 128
# The training both sides run (lenet.pack.Config's names); each model's learning rate from lrs().
SETTINGS = {"momentum": 0.9, "nesterov": True, "weight_decay": 5e-4, "label_smoothing": 0.05}
TORCH_FORMS = ("plain", "func", "grouped")   # plain: K = 1 only


def lrs(K: int) -> list[float]:
    """Each model's constant learning rate: evenly from 0.05 to 0.15."""
    return [0.05 + 0.1 * k / max(K - 1, 1) for k in range(K)]


def configs(K: int, batch: int = B):
    """Ours' configurations of the K models: SETTINGS, their learning rates, a constant schedule, no warm-up,
    no augmentation, no moving average."""
    from lenet.pack import Config

    return [Config(seed=k, lr=lr, schedule="constant", warmup_epochs=0, shift=0, flip=False, ema=None, epochs=3,
                   batch_size=batch, **SETTINGS) for k, lr in enumerate(lrs(K))]


def torch_forms(K: int, kinds) -> list[str]:
    """PyTorch's forms timed at K: the ensembles asked for, and its plain step at K = 1."""
    return (["plain"] if K == 1 else []) + [k for k in kinds if k != "plain"]


def ours(train, test, K: int, algo: str, deterministic: bool = False) -> float:
    """Seconds per step of a pack of K."""
    from lenet.data import GpuDataset, pixel_stats
    from lenet.engines import Policy
    from lenet.pack import Pack

    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    mean, std = pixel_stats(train[0])
    tr, te = GpuDataset(*train, mean, std, stream), GpuDataset(*test, mean, std, stream)
    pack = Pack(configs(K, B), tr, te, policy=Policy(fwd=algo, bwd_data=algo, bwd_filter=algo, deterministic=deterministic),
                plan_cache=True, models=max(K, 2) if K > 1 else 1)
    steps = tr.size // B   # whole batches, as PyTorch's
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


def torch_run(train, K: int, form: str) -> tuple[float, str]:
    """Seconds per step of PyTorch's ``form`` of K models (plain, func or grouped), and how it ran."""
    import torch

    from lenet.data import pixel_stats
    from lenet.params import init_host
    from torch_lenet import exact_float32, from_state

    exact_float32()
    torch.backends.cudnn.benchmark = True
    mean, std = pixel_stats(train[0])
    X = torch.as_tensor(train[0].copy()).cuda().float().div(255).sub(mean).div(std)   # (N, 28, 28)
    Y = torch.as_tensor(train[1].copy()).long().cuda()
    steps = len(Y) // B
    ib = torch.zeros(K, B, dtype=torch.long, device="cuda")   # each model's batch: refilled before each step
    if form == "plain":
        from torch_forms import Form, TorchStep

        v = TorchStep(Form("graph", True, "fused"), B, inputs=lambda: (X[ib[0]].unsqueeze(1), Y[ib[0]]), lr=lrs(1)[0],
                      weight_decay=SETTINGS["weight_decay"], nesterov=SETTINGS["nesterov"],
                      label_smoothing=SETTINGS["label_smoothing"])
        run, stream, mode = v.step, v.stream, "CUDA graph"
    else:
        import torch_ensembles

        models = [from_state(init_host(k)) for k in range(K)]
        ens = torch_ensembles.make(form, models, torch.tensor(lrs(K), device="cuda"),
                                   **SETTINGS)
        del models

        def step():
            ens.step(X[ib], Y[ib])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.synchronize()
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                step()
            run, mode = graph.replay, "CUDA graph"
        except Exception as e:  # noqa: BLE001
            run, mode = step, f"eager ({type(e).__name__})"
    g = torch.Generator(device="cuda").manual_seed(K)
    perms = torch.stack([torch.randperm(len(Y), device="cuda", generator=g)[: steps * B].view(steps, B)
                         for _ in range(K)], 1)   # (steps, K, B)
    for _ in range(2):   # a warm-up epoch, then the timed one
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.cuda.stream(stream):
            for i in range(steps):
                ib.copy_(perms[i])
                run()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    if form == "plain":
        v.close()
    del perms, X, Y
    torch.cuda.empty_cache()
    return dt / steps, mode


def row_of(K: int, ours_s: float | None, theirs: dict) -> dict:
    """One K's results: ours, every PyTorch form's (seconds per step, or an error), and the fastest."""
    steps = 60000 // B
    timed = {f: v["s_per_step"] for f, v in theirs.items() if "s_per_step" in v}
    best = min(timed, key=timed.get) if timed else None
    row = {"models": K, "batch": B, "ours_us": None if ours_s is None else ours_s * 1e6, "torch": theirs,
           "fastest_torch": best}
    if ours_s is not None:
        row.update(ours_m_img_s=K * B / ours_s / 1e6, ours_s_per_model_epoch=ours_s * steps / K)
    if best is not None:
        t = timed[best]
        row.update(torch_us=t * 1e6, torch_m_img_s=K * B / t / 1e6, torch_s_per_model_epoch=t * steps / K)
        if ours_s is not None:
            row["speedup"] = t / ours_s
    return row


def table_line(row: dict) -> str:
    def f(key, fmt):
        return "-" if row.get(key) is None else format(row[key], fmt)
    forms = ", ".join(f"{k} {v['s_per_step'] * 1e6:.1f}" if "s_per_step" in v else f"{k} failed"
                      for k, v in row["torch"].items()) or "-"
    cells = [str(row["models"]), f("ours_us", ".1f"), f("ours_m_img_s", ".2f"), f("ours_s_per_model_epoch", ".4f"),
             row["fastest_torch"] or "-", f("torch_us", ".1f"), f("torch_m_img_s", ".2f"),
             f("torch_s_per_model_epoch", ".4f"), "-" if row.get("speedup") is None else f"{row['speedup']:.2f}x", forms]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| models K | ours us/step | ours M img/s | ours s per model-epoch | PyTorch's fastest | PyTorch us/step | "
          "PyTorch M img/s | PyTorch s per model-epoch | ours / PyTorch | every PyTorch form, us/step |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--algo", default="exhaustive", help="ours' search (default: exhaustive, kept in the plan cache)")
    p.add_argument("--torch", nargs="*", choices=("func", "grouped"), default=["func", "grouped"],
                   help="PyTorch's ensembles to time, the faster one the yardstick (default: both; none: ours "
                        "alone); at K = 1 its plain captured step as well")
    p.add_argument("--no-torch", dest="torch", action="store_const", const=[], help="ours alone")
    p.add_argument("--batch", type=int, default=B, help=f"images per model a step (default: {B})")
    p.add_argument("--deterministic", action="store_true",
                   help="ours under --deterministic: each model its lone run's grid, candidates and matmuls")
    p.add_argument("--json", help="write every result here")
    return p


def main(argv=None) -> int:
    global B
    args = parser().parse_args(argv)
    B = args.batch
    from lenet import data

    root = data.find_dataset(args.data_dir)
    if root is None:
        print(data.not_found_message(args.data_dir), file=sys.stderr)
        return 2
    (train, test) = data.load_splits(root, ("train", "test"))
    import cupy

    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"GPU {gpu} | {data.dataset_name(root)} | batch {B} per model | {len(train[0]) // B} steps an epoch | "
          f"{', '.join(f'{k} {v}' for k, v in SETTINGS.items())}, lr 0.05..0.15 | float32, TF32 off")
    print(HEADER)
    rows = []
    for K in args.models:
        o = ours(train, test, K, args.algo, args.deterministic)
        theirs = {}
        for form in torch_forms(K, args.torch) if args.torch else []:
            try:
                s, mode = torch_run(train, K, form)
                theirs[form] = {"s_per_step": s, "mode": mode}
            except Exception as e:  # noqa: BLE001  a form that cannot run is reported, not fatal
                theirs[form] = {"error": f"{type(e).__name__}: {str(e).strip()[:200]}"}
        rows.append(row_of(K, o, theirs))
        print(table_line(rows[-1]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"gpu": gpu, "settings": SETTINGS, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
