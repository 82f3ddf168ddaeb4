"""A pack's model 0 and its lone run, step by step on real data: where do they part? Both trained on the
first N Fashion-MNIST training images (the fast recipe, seed 0; the pack of 3 holds seeds 0-2), with the
same policy; after every step the batch each gathered, its learning rate and the parameters are compared
bit for bit, and the first step that differs is printed with what differs.

    python scripts/probes/pack_lockstep.py [--train-size 20000] [--steps 200] [--epochs 2] [--deterministic]
        [--no-graph] [--sync] [--tta]

# Note: what it taught (H100, Fashion-MNIST, --deterministic, 2 epochs of 469 steps): the pack's model 0
# and its lone run stayed bit-identical through every step and both evaluations, with and without the
# CUDA graph and test-time mirroring, where `lenet sweep --deterministic` and `lenet train
# --deterministic` ended apart (scripts/probes/pack_vs_lone.sh). The programs, not the pack, differed:
# the sweep searched its plan (its --algo default, exhaustive) even under --deterministic; it now takes
# the heuristic's rule there (lenet/sweep.py), and the two programs agree bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--train-size", type=int, default=20000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--tta", action="store_true")
    p.add_argument("--sync", action="store_true", help="compare the batch, the labels, the rate and the weights "
                   "after every step (else at each epoch's end only, the steps queued as the programs queue them)")
    args = p.parse_args()

    import cupy

    from lenet import data
    from lenet.engines import Policy
    from lenet.kernels import Augment
    from lenet.model import LeNet
    from lenet.pack import Config, Pack

    root = Path(os.environ["LENET_DATA"])
    x, y = data.load_split(root, "train")
    tx, ty = data.load_split(root, "test")
    x, y = x[: args.train_size], y[: args.train_size]
    mean, std = data.pixel_stats(x)
    policy = Policy(deterministic=args.deterministic)
    configs = [Config(seed=s, batch_size=args.batch, epochs=args.epochs) for s in range(3)]
    stream = cupy.cuda.Stream(non_blocking=True)
    train, test = data.GpuDataset(x, y, mean, std, stream), data.GpuDataset(tx, ty, mean, std, stream)
    pack = Pack(configs, train, test, policy=policy, cuda_graph=not args.no_graph, tta=args.tta)
    c = configs[0]
    lone = LeNet(max_batch=pack.model.max_batch, policy=policy, seed=c.seed, momentum=c.momentum,
                 weight_decay=c.weight_decay, nesterov=c.nesterov, label_smoothing=c.label_smoothing,
                 cuda_graph=not args.no_graph)
    ltrain = data.GpuDataset(x, y, mean, std, lone.stream)
    sched, B, steps = c.schedule_of(pack.steps), pack.B, pack.steps
    T = steps * c.epochs
    for a, b in zip(pack.model.describe(B), lone.describe(B)):
        if (a["layer"], a["engine"], a["algo"]) != (b["layer"], b["engine"], b["algo"]):
            print(f"plans differ at {a['layer']} {a['op']}: pack {a['engine']} {a['algo']} | lone {b['engine']} {b['algo']}")
    ltest = data.GpuDataset(tx, ty, mean, std, lone.stream)
    aug = Augment(c.shift, c.flip, c.seed)
    for epoch in range(args.epochs):
        orders = pack.begin_epoch()
        order = ltrain.order(c.seed, epoch)
        for s in range(min(args.steps, steps)):
            n = min(B, train.size - s * B)
            it = epoch * steps + s
            pack.model.load_pack(train, orders, s * B, n, pack.aug, pack.epoch_dev, pack.lr_table, pack.lr_at, s)
            lone.load_from(ltrain, order, s * B, n, lr=sched.at(it, steps, T), augment=aug, epoch=epoch)
            if args.sync:
                pack.model.stream.synchronize()
                lone.stream.synchronize()
                same_x = bool(cupy.array_equal(pack.model.buf["x"][:n], lone.buf["x"][:n]))
                same_y = bool(cupy.array_equal(pack.model.buf["labels"][:n], lone.buf["labels"][:n]))
                same_lr = float(pack.model.lr_dev[0].get()) == float(lone.lr_dev[0].get())
            else:
                same_x = same_y = same_lr = True
            pack.model.step(n)
            lone.step(n)
            if not args.sync and s + 1 < min(args.steps, steps):
                continue
            pw, lw = pack.model.flat_state(0)[0], lone.flat_state()[0]
            if not (same_x and same_y and same_lr and np.array_equal(pw, lw)):
                print(f"epoch {epoch} step {s} (n {n}): batch equal {same_x}, labels equal {same_y}, lr equal {same_lr} "
                      f"({float(pack.model.lr_dev[0].get())!r} / {float(lone.lr_dev[0].get())!r}); "
                      f"parameters equal {np.array_equal(pw, lw)}")
                gp, gl = pack.model.grad_dict(0), lone.grad_dict()
                for k in gl:
                    if not np.array_equal(gp[k], gl[k]):
                        print(f"  gradient {k}: differs in {int((gp[k] != gl[k]).sum())} of {gl[k].size}, "
                              f"largest {float(np.abs(gp[k] - gl[k]).max()):.3e}")
                return
        pack.end_epoch(0.0)
        r = pack.slots[0] if pack.slots[0] is not None else pack.results[0]
        loss, acc = lone.evaluate(ltest, 1000, tta=args.tta)
        print(f"epoch {epoch}: weights equal after training; test accuracy pack {r.accuracy[-1]!r} lone {acc!r}; "
              f"loss pack {r.loss[-1]!r} lone {loss!r}")
        pw, lw = pack.model.flat_state(0)[0], lone.flat_state()[0]
        print(f"  after evaluation, weights equal {np.array_equal(pw, lw)}")
    print(f"{args.epochs} epochs: model 0 of the pack and its lone run bit-identical throughout")


if __name__ == "__main__":
    main()
