"""python -m lenet.train_step: one SGD step (or --steps K) on one batch, with the facts.

Prints the GPU, cuDNN, cuBLAS and graph-API versions; for each planned operation the
engine, plan or algorithm, fusion, chunk size, measured time, workspace and distance from
the exact reference; the workspace total, the loss before and after, and the mean step time
(CUDA events, after warm-up; the search excluded).
"""

from __future__ import annotations

if __name__ == "__main__":   # python -m lenet.train_step: the GPU's start-up threads begin before the imports below
    from lenet.startup import begin   # (Notes [bytecode cache], [overlapped start-up] in lenet/startup.py)

    begin(reads=("train",))   # its training split only

import json

import numpy as np

from . import cli, data, files, startup


def parser() -> cli.Parser:
    p = cli.Parser(prog=cli.prog("train_step"),
                   description="Run one SGD step (or --steps K) of LeNet-5 on one batch, on cuDNN + cuBLAS, "
                               "and report the algorithms, workspace, loss and step time.")
    p.add_argument("--batch-size", type=cli.batch_size, default=64, metavar="N",
                   help="images in the batch (default: 64)")
    p.add_argument("--lr", type=cli.nonneg_float, default=0.01, help="learning rate (default: 0.01)")
    p.add_argument("--steps", type=cli.positive_int, default=1, metavar="K",
                   help="SGD steps on the same batch (default: 1)")
    p.add_argument("--warmup", type=cli.nonneg_int, default=3, metavar="W",
                   help="untimed steps first, their updates undone (default: 3)")
    p.add_argument("--seed", type=cli.nonneg_int, default=0,
                   help="seed of the parameters and the batch, an integer >= 0 (default: 0)")
    from .engines import FLAGS, Policy

    cli.add_algorithm_flags(p, FLAGS, Policy.parse)
    cli.add_speed_flags(p)
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="IDX dataset to take the batch from (default: look in $LENET_DATA, ./data/<name>, "
                        "/usr/share/datasets/fashion-mnist; a seeded synthetic batch if none is found)")
    p.add_argument("--synthetic", action="store_true", help="use a seeded synthetic batch even if data exists")
    cli.add_data_cache_flag(p)
    p.add_argument("--json", action="store_true", help="print the same facts as one JSON object")
    p.add_argument("--dump", metavar="PATH",
                   help="write an .npz: the batch (x, y), the parameters before (state_dict names), their "
                        "gradients (grad.<name>) and the parameters after all steps (after.<name>); never over "
                        "a run's checkpoint, over another file only with --overwrite")
    p.add_argument("--overwrite", action="store_true", help="let --dump replace an existing file (never a run's "
                                                            "checkpoint)")
    return p


def make_batch(args) -> tuple[np.ndarray, np.ndarray, str]:
    """(x float32 (N,1,28,28), y int32 (N,), description of where it came from)."""
    root = None if args.synthetic else data.find_dataset(args.data_dir)
    if args.data_dir is not None and root is None and not args.synthetic:
        raise data.DataError(data.not_found_message(args.data_dir))
    rng = np.random.Generator(np.random.PCG64(args.seed))
    n = args.batch_size
    if root is None:
        x = rng.random((n, 1, 28, 28), dtype=np.float32)
        y = rng.integers(0, 10, n).astype(np.int32)
        return (x - 0.5) / 0.25, y, f"synthetic (seeded uniform pixels, seed {args.seed})"
    cache, pending = cli.data_cache(args), []
    (images, labels), = data.load_splits(root, ("train",), cache, pending)
    if pending:
        files.write_later(data.commit, pending, cache)   # Note [dataset cache] in lenet/data.py
    size = images.shape[0]
    if n <= size:
        idx, how = rng.permutation(size)[:n], f"{n} images of a seeded permutation"
    else:   # a batch larger than the split: seeded draws with replacement, said in the output
        idx, how = rng.integers(0, size, n), f"{n} images drawn with replacement from its {size}"
    mean, std = data.pixel_stats(images)
    x = ((images[idx].astype(np.float32) / 255.0 - mean) / std).reshape(n, 1, 28, 28)
    return x, labels[idx].astype(np.int32), f"{root} (train split, {how})"


def check_dump(args) -> None:
    """--dump's file and --overwrite, checked before anything runs."""
    if args.overwrite and args.dump is None:
        raise ValueError("--overwrite is for --dump PATH: without it the program writes nothing")
    if args.dump is not None:
        from .checkpoint import refuse_overwriting

        files.check_output_file(args.dump, "--dump")
        refuse_overwriting(args.dump, "--dump")
        files.check_output_file(args.dump, "--dump", overwrite=args.overwrite)


def time_steps(model, n: int, args) -> dict:
    """The warm-up's steps (kernel compilation, lazy library init, graph capture; their updates undone), then
    --steps timed steps and a forward after them: the parameters before and after, the first step's
    gradients (with --dump), the losses and each step's milliseconds."""
    import cupy

    from .kernels import fill

    before = model.state_dict()
    stream = model.stream
    if args.warmup > 0:
        for _ in range(args.warmup):
            model.step(n, args.lr)
        model.load_state_dict(before)
        with stream:
            fill(model.velocity, 0)

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times, first_grads, first_loss = [], None, None
    for i in range(args.steps):
        start.record(stream)
        model.step(n, args.lr)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
        if i == 0:
            first_loss = model.loss()
            first_grads = model.grad_dict() if args.dump else None
    model.forward(n)
    after_loss = model.loss()
    return {"before": before, "after": model.state_dict(), "first_grads": first_grads, "first_loss": first_loss,
            "after_loss": after_loss, "times": times}


def show(facts: dict, args, policy, rows: list, workspace: int) -> None:
    """The step's facts as lines (without --json)."""
    n, source, first_loss, after_loss = facts["batch_size"], facts["data"], facts["loss_before"], facts["loss_after"]
    print(f"GPU {facts['gpu']} | cuDNN {facts['cudnn']} | cuBLAS {facts['cublas']} | graph API: {facts['graph_api']}")
    print(f"batch {n} from {source}")
    print(f"operations ({policy}, fusion {'on' if args.fused else 'off'}):")
    print(cli.format_rows(rows, workspace))
    print(f"loss before {first_loss:.6f} | after {args.steps} step{'s' if args.steps > 1 else ''} "
          f"{after_loss:.6f}")
    pc = facts["plan_cache"]
    print(f"plan cache {pc['path']}: {pc['hits']} stored choices used, {pc['searched']} searched" if pc
          else "plan cache off (--no-plan-cache)")
    print(f"step {facts['step_ms'] * 1000:.1f} us mean over {args.steps} | {facts['images_per_s'] / 1e6:.3f} M img/s "
          f"| cuda graph {'on' if args.cuda_graph else 'off'}")
    if args.dump:
        print(f"dump written to {files.show(args.dump)}")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from .engines import Policy

    policy = cli.policy_from(args, Policy)
    check_dump(args)
    with startup.starting(args.engine, (args.batch_size,), policy=policy):   # Note [overlapped start-up]
        x, y, source = make_batch(args)   # the data is checked before the GPU is touched
    from descriptors import require_gpu

    require_gpu()

    from .model import LeNet

    model = LeNet(max_batch=args.batch_size, policy=policy, seed=args.seed, cuda_graph=args.cuda_graph,
                  fused=args.fused, plan_cache=args.plan_cache)
    n = model.load_batch(x, y)
    r = time_steps(model, n, args)
    mean_ms = float(np.mean(r["times"]))
    rows = model.describe(n)
    facts = {**cli.device_facts(model), "batch_size": n, "data": source, "policy": str(policy),
             "engine": args.engine, "cuda_graph": args.cuda_graph, "fused": args.fused, "operations": rows,
             "algorithms": cli.conv_rows(rows), "workspace_bytes": model.workspace.size,
             "lr": args.lr, "steps": args.steps, "loss_before": r["first_loss"], "loss_after": r["after_loss"],
             "step_ms": mean_ms, "images_per_s": n / (mean_ms / 1000.0),
             "plan_cache": model.plan_cache.summary() if model.plan_cache is not None else None}
    if args.dump:
        arrays = {"x": x, "y": y, **r["before"], **{f"grad.{k}": v for k, v in r["first_grads"].items()},
                  **{f"after.{k}": v for k, v in r["after"].items()}}
        files.save_npz(args.dump, arrays)
        facts["dump"] = args.dump
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    show(facts, args, policy, rows, model.workspace.size)
    return 0


def run() -> None:
    cli.run(main, cli.prog("train_step"))


if __name__ == "__main__":
    run()
