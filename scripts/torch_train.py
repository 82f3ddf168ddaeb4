"""The PyTorch reference trainer: the same LeNet, init, data, normalization, batch order,
SGD rule and schedule as python -m lenet.train, so the two can be compared epoch by epoch.

    python3 scripts/torch_train.py --epochs 20 [same flags as lenet.train] [--json PATH]

The recipe flags are PyTorch's own pieces: SGD(nesterov=True), cross_entropy(label_smoothing=),
AveragedModel with get_ema_multi_avg_fn (started at the initial weights, as ours), the
augmentation ours draws (lenet.data.augment_params), applied by indexing a zero-padded copy,
and test-time augmentation as the mean of an image's and its mirror's logits.
The last line gives the wall clock from the process's start, as python -m lenet.train does.

cudnn.benchmark is on (--no-cudnn-benchmark turns it off): PyTorch's convolutions timed once per shape, as
a speed-minded user runs them; float32 with TF32 off, as ours; the plain loop's SGD its fused kernel. Evaluation keeps its sums on the GPU and
reads them once per evaluation, not once per batch.

--cuda-graph is PyTorch's fastest loop, as a user who writes for speed would: the data on the GPU,
each training step (the batch's gather and augmentation from a per-epoch order, forward, loss,
backward, the SGD update with its momentum, Nesterov and weight decay as torch.optim.SGD computes
them, the moving average) captured once in a CUDA graph and replayed, the learning rate and the
batch's position read from device tensors inside it, so the host never waits inside an epoch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # the PyTorch reference: tests/torch_lenet.py

from lenet import startup  # noqa: E402

startup.keep_bytecode()   # as python -m lenet.train does, before the imports: the comparison is of trainers

import numpy as np  # noqa: E402
import torch  # noqa: E402

from lenet import cli, data  # noqa: E402
from lenet.params import init_host  # noqa: E402
from lenet.schedule import SCHEDULES, Schedule  # noqa: E402
from torch_lenet import exact_float32, from_state  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--schedule", choices=SCHEDULES, default="inv")
    p.add_argument("--gamma", type=float, default=1e-4)
    p.add_argument("--power", type=float, default=0.75)
    p.add_argument("--step-size", type=int, default=10)
    p.add_argument("--step-gamma", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-size", type=int)
    p.add_argument("--eval-batch-size", type=int, default=1000)
    p.add_argument("--nesterov", action="store_true")
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--warmup-epochs", type=float, default=0.0)
    p.add_argument("--ema", type=float, default=None)
    p.add_argument("--shift", type=int, default=0)
    p.add_argument("--flip", action="store_true")
    p.add_argument("--cutout", type=int, default=0, help="accepted at 0 only: this reference has no cutout")
    p.add_argument("--tta", action="store_true", help="score on the mean of each test image's and its mirror's logits")
    p.add_argument("--target-accuracy", type=cli.accuracy, default=None)
    p.add_argument("--quiet", action="store_true", help="accepted for the same command line; no effect")
    p.add_argument("--json", help="write the per-epoch metrics here")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture each training step in a CUDA graph, data and learning rate on the GPU")
    p.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True,
                   help="let cuDNN time its algorithms per shape (torch.backends.cudnn.benchmark; default: on)")
    return p


def main():
    args = parser().parse_args()
    if args.cutout:
        parser().error(f"--cutout {args.cutout}: PyTorch's reference trainer has no cutout (0 only); compare a "
                       f"recipe without it")
    exact_float32()
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    root = data.find_dataset(args.data_dir)
    if root is None:
        sys.exit(data.not_found_message(args.data_dir))
    tx, ty = data.load_split(root, "train")
    vx, vy = data.load_split(root, "test")
    tx, ty = tx[: args.train_size], ty[: args.train_size]
    mean, std = data.pixel_stats(tx)
    dev = "cuda"
    timg, tlab = torch.as_tensor(tx, device=dev), torch.as_tensor(ty, device=dev).long()
    vimg, vlab = torch.as_tensor(vx, device=dev), torch.as_tensor(vy, device=dev).long()
    norm = lambda u8: u8.float().div(255).sub(mean).div(std).unsqueeze(1)  # noqa: E731  same ops as the kernel
    model = from_state(init_host(args.seed))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                          nesterov=args.nesterov, fused=True)   # its fastest kernel (the graph's loop does its own)
    ema = None
    if args.ema is not None:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.ema))
        ema.update_parameters(model)   # starts at the initial weights, as ours does
    B, N = args.batch_size, len(tx)
    steps = math.ceil(N / B)
    sched = Schedule(args.schedule, args.lr, args.gamma, args.power, args.step_size, args.step_gamma,
                     warmup=round(args.warmup_epochs * steps))
    S = args.shift
    padded = torch.nn.functional.pad(timg, (S, S, S, S)) if S else timg   # (N, 28+2S, 28+2S) uint8
    ar = torch.arange(28, device=dev)
    t_start = time.perf_counter() - startup.process_seconds()
    total = steps * args.epochs
    it, history = 0, []
    graphed = None
    if args.cuda_graph:
        lrs = torch.tensor([sched.at(i, steps, total) for i in range(total)], device=dev, dtype=torch.float32)
        graphed = GraphSteps(model, opt, ema, padded, tlab, norm, lrs, B, N, S, args)
    for epoch in range(args.epochs):
        if graphed is not None:
            order = torch.as_tensor(data.epoch_order(args.seed, epoch, N).astype(np.int64), device=dev)
            aug = (data.augment_params(args.seed, epoch, np.arange(N), S, args.flip) if S or args.flip else None)
            model.train()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run = graphed.epoch(order, aug)
            torch.cuda.synchronize()
            secs = time.perf_counter() - t0
            it += steps
            history.append(evaluate(args, model, ema, vimg, vlab, norm, vx, run, steps, epoch, secs, N, t_start))
            if target_reached(args, history):
                break
            continue
        order = torch.as_tensor(data.epoch_order(args.seed, epoch, N).astype(np.int64), device=dev)
        if S or args.flip:
            dy, dx, mir = (torch.as_tensor(a, device=dev) for a in data.augment_params(args.seed, epoch, np.arange(N),
                                                                                       S, args.flip))
            rows_all = ar[None, :] - dy[:, None] + S                                    # (N, 28)
            cols_all = torch.where(mir[:, None], 27 - ar[None, :], ar[None, :]) - dx[:, None] + S   # (N, 28)
        model.train()
        run = torch.zeros((), device=dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(steps):
            idx = order[s * B: (s + 1) * B]
            for g in opt.param_groups:
                g["lr"] = sched.at(it, steps, total)
            opt.zero_grad(set_to_none=True)
            if S or args.flip:
                r, c = rows_all[s * B: (s + 1) * B], cols_all[s * B: (s + 1) * B]
                images = padded[idx[:, None, None], r[:, :, None], c[:, None, :]]
            else:
                images = timg[idx]
            loss = torch.nn.functional.cross_entropy(model(norm(images)), tlab[idx],
                                                     label_smoothing=args.label_smoothing)
            loss.backward()
            opt.step()
            if ema is not None:
                ema.update_parameters(model)
            run += loss.detach()
            it += 1
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        history.append(evaluate(args, model, ema, vimg, vlab, norm, vx, run, steps, epoch, secs, N, t_start))
        if target_reached(args, history):
            break
    print(f"torch final | test accuracy {100 * history[-1]['test_accuracy']:.2f}% | "
          f"mean epoch {np.mean([h['seconds'] for h in history]):.2f} s")
    print(f"torch wall clock {time.perf_counter() - t_start:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(history, indent=1))


def evaluate(args, model, ema, vimg, vlab, norm, vx, run, steps, epoch, secs, N, t_start) -> dict:
    """The epoch's record after evaluating on the test split (printed)."""
    model.eval()
    judge = ema.module if ema is not None else model
    ls, correct = test_sums(judge, vimg, vlab, norm, args.eval_batch_size, args.tta)
    rec = {"epoch": epoch + 1, "train_loss": float(run) / steps, "test_loss": ls / len(vx),
           "test_accuracy": correct / len(vx), "seconds": secs, "images_per_s": N / secs,
           "wall_s": time.perf_counter() - t_start}
    print(f"torch epoch {epoch + 1}/{args.epochs} | train loss {rec['train_loss']:.4f} | test loss "
          f"{rec['test_loss']:.4f} | test acc {100 * rec['test_accuracy']:.2f}% | {secs:.2f} s", flush=True)
    return rec


def test_sums(judge, vimg, vlab, norm, batch: int, tta: bool) -> tuple[float, int]:
    """(summed cross-entropy, right answers) of ``judge`` on the test images, batch by batch, the sums kept
    on the device and read once at the end (no host synchronization per batch)."""
    with torch.no_grad():
        ls = torch.zeros((), dtype=torch.float64, device=vlab.device)
        correct = torch.zeros((), dtype=torch.int64, device=vlab.device)
        for s in range(0, len(vlab), batch):
            views = vimg[s: s + batch]
            lg = judge(norm(views))
            if tta:
                lg = (lg + judge(norm(views.flip(-1)))) / 2
            lab = vlab[s: s + batch]
            ls += torch.nn.functional.cross_entropy(lg, lab, reduction="sum")
            correct += (lg.argmax(1) == lab).sum()
        both = torch.stack([ls, correct.double()]).tolist()   # the one read
    return both[0], int(both[1])


def target_reached(args, history) -> bool:
    rec = history[-1]
    if args.target_accuracy is not None and rec["test_accuracy"] >= args.target_accuracy:
        print(f"torch target accuracy {100 * args.target_accuracy:.2f}% reached at epoch {rec['epoch']}, "
              f"{rec['wall_s']:.2f} s after the program started")
        return True
    return False


class GraphSteps:
    """Training steps captured in CUDA graphs (one for a full batch, one for the epoch's last, shorter
    batch): each reads the batch's position and the learning rate from device counters, gathers and
    augments its images from the epoch's order (refilled before each epoch, outside the graphs), and
    runs forward, loss, backward and the update as torch.optim.SGD computes it (foreach kernels, the
    learning rate a tensor), then the moving average."""

    def __init__(self, model, opt, ema, padded, labels, norm, lrs, B, N, S, args):
        dev = labels.device
        self.model, self.ema, self.padded, self.labels, self.norm = model, ema, padded, labels, norm
        self.lrs, self.B, self.N, self.S, self.args = lrs, B, N, S, args
        g = opt.param_groups[0]
        self.momentum, self.wd, self.nesterov = g["momentum"], g["weight_decay"], g["nesterov"]
        self.params = [p for p in model.parameters()]
        self.bufs = [torch.zeros_like(p) for p in self.params]
        self.order = torch.zeros(N, dtype=torch.int64, device=dev)
        self.rows = torch.zeros((N, 28), dtype=torch.int64, device=dev)
        self.cols = torch.zeros((N, 28), dtype=torch.int64, device=dev)
        self.pos = torch.zeros((), dtype=torch.int64, device=dev)     # the batch's first position in the epoch
        self.it = torch.zeros((), dtype=torch.int64, device=dev)      # the step's index into lrs
        self.run = torch.zeros((), device=dev)                        # the epoch's loss sum
        self.ar = torch.arange(28, device=dev)
        self.ema_params = [p for p in ema.module.parameters()] if ema is not None else None
        self.steps = -(-N // B)
        rest = N - (self.steps - 1) * B
        # Warm up on a side stream (what capture needs), then put every tensor the warm-up changed back.
        saved = [t.detach().clone() for t in (*self.params, *self.bufs, *(self.ema_params or []))]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in {B, rest}:
                for _ in range(3):
                    self.pos.zero_()
                    self._step(b)
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():
            for t, v in zip((*self.params, *self.bufs, *(self.ema_params or [])), saved):
                t.copy_(v)
        self.graphs = {}
        for b in {B, rest}:
            self.graphs[b] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graphs[b]):
                self._step(b)
        self.it.zero_()
        self.rest = rest

    def _step(self, b: int) -> None:
        idx = self.order[self.pos + torch.arange(b, device=self.order.device)]
        if self.S or self.args.flip:
            r, c = self.rows[idx], self.cols[idx]
            images = self.padded[idx[:, None, None], r[:, :, None], c[:, None, :]]
        else:
            images = self.padded[idx]
        for p in self.params:
            p.grad = None
        loss = torch.nn.functional.cross_entropy(self.model(self.norm(images)), self.labels[idx],
                                                 label_smoothing=self.args.label_smoothing)
        loss.backward()
        with torch.no_grad():
            grads = [p.grad for p in self.params]
            if self.wd:
                torch._foreach_add_(grads, self.params, alpha=self.wd)
            if self.momentum:
                torch._foreach_mul_(self.bufs, self.momentum)
                torch._foreach_add_(self.bufs, grads)
                if self.nesterov:
                    torch._foreach_add_(grads, self.bufs, alpha=self.momentum)
                else:
                    grads = self.bufs
            lr = self.lrs.index_select(0, self.it.view(1)).squeeze(0)   # a device read, no host sync
            torch._foreach_add_(self.params, torch._foreach_mul(grads, -lr))
            if self.ema_params is not None:
                torch._foreach_lerp_(self.ema_params, self.params, 1.0 - self.args.ema)
            self.run.add_(loss.detach())
            self.pos.add_(b)
            self.it.add_(1)

    def epoch(self, order, aug):
        """Replay one epoch's steps; returns the device sum of their losses."""
        self.order.copy_(order)
        if aug is not None:
            dy, dx, mir = (torch.as_tensor(a, device=order.device) for a in aug)
            S, ar = self.S, self.ar
            self.rows.copy_(ar[None, :] - dy[:, None] + S)
            self.cols.copy_(torch.where(mir[:, None], 27 - ar[None, :], ar[None, :]) - dx[:, None] + S)
        self.pos.zero_()
        self.run.zero_()
        for s in range(self.steps):
            self.graphs[self.B if s < self.steps - 1 else self.rest].replay()
        return self.run


if __name__ == "__main__":
    main()
