"""The whole training step as one launch of thread-block clusters (lenet/kernels/step_cluster.cu, sm_90 and
newer), its forms that ship, dev/step_cluster.cu's variants of it and the form before it (dev/step_cluster_v1.cu),
against the chain of launches (LeNet, ``--engine auto``, its Steps made without the whole step), on one GPU,
in one process.

    python dev/step_cluster.py [--batch 1 8 64] [--variants ...] [--barriers] [--check-only] [--data DIR]

check  for each batch size and input set, one step from the same state (weights and momentum after two
       steps) by the chain and by the cluster kernel: the loss, each parameter's gradient and its value
       after the update, as relative L2 distances from the chain's. Input sets: random normals; and
       Fashion-MNIST's first training images (normalized as the trainer does) where the data is found, else
       pictures on constant backgrounds (exact ties in the pooling windows, exact zeros after a ReLU).
       "OK" where every distance is below --tol (the two sum in different orders: float32's rounding;
       a pooling or ReLU decision decided by a hair could differ, and would show as a FAIL to look into).
time   each step replayed from a CUDA graph (the chain's as the package captures it, the cluster's one or
       two launches captured the same way), CUDA events around --steps replays, the best of --repeats; and
       each variant's phases from its clock (SC_PROFILE: rank 0's globaltimer between the phases'
       barriers); its parts: each of its launches replayed alone, and across its clusters the spread of
       their starts and the last one's end (the clock's first and last marks of every cluster); with
       --barriers, the cost of one cluster barrier (ten more of them in the first phase).
Exits 1 when a check fails, 2 where the GPU cannot run clusters (compute capability below 9.0).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lenet.kernels.step import FORMS, RANKS, shape  # noqa: E402

HERE = Path(__file__).resolve().parent
OFFSETS = {"conv1.weight": 0, "conv1.bias": 192, "conv2.weight": 256, "conv2.bias": 2688, "fc1.weight": 2752,
           "fc1.bias": 33472, "fc2.weight": 33600, "fc2.bias": 34816}   # step_common.cu's OFF_*
SETTINGS = {"momentum": 0.9, "weight_decay": 5e-4, "label_smoothing": 0.1}
LR = 0.05
# What ships (lenet/kernels/step_cluster.cu's forms), then dev/step_cluster.cu's variants (its comment says what
# each is).
SHIPPED = tuple(f.module for f in FORMS)
VARIANTS = SHIPPED + ("step_cluster_dev", "step_cluster_t256_dev", "step_cluster_g3",
                      "step_cluster_g3_t256", "step_cluster_g4", "step_cluster_g8", "step_cluster_g4_t256",
                      "step_cluster_acqrel", "step_cluster_v1")
# The same step with ten more cluster barriers in its first phase (a barrier's cost: the difference / 10): the
# shipped barrier, the one with release/acquire in every thread, a relaxed one, and the shipped one at 256 threads.
PROBES = {"step_cluster_syncs": "step_cluster_dev", "step_cluster_syncs_acqrel": "step_cluster_dev",
          "step_cluster_syncs_relaxed": "step_cluster_dev", "step_cluster_syncs_t256": "step_cluster_t256_dev",
          "step_cluster_empty": None}   # empty: the launch floor
# Each module's phases, between its clock's marks (SC_MARK): what ships and its variants, and the form before it.
PHASES = {None: ("loads", "conv1", "conv2", "fc1", "h1", "fc2", "loss", "dh1", "dp2 parts", "dp2", "conv2-dW",
                 "dp1 part", "barrier", "conv1-bwd"),
          "step_cluster_v1": ("loads", "conv1", "conv2", "fc1", "head", "dp2 conv2-bwd", "dp1 conv1-bwd", "update")}


def phases_of(module: str) -> tuple:
    return PHASES.get(module, PHASES[None])


def cluster_step(model, n: int, module: str, prof=None):
    """The package's launcher (lenet.kernels.step.ClusterStep) on a model's buffers, of one module."""
    from lenet.kernels.step import ClusterStep

    ops = model.operations
    return ClusterStep(model.buf["x"][:n], model.buf["labels"][:n], ops.loss_tensors, ops.update.tensors, n,
                       model.stream, module, prof)


def replayed(fn, stream):
    """fn captured once in a CUDA graph, replayed by each call (as the package replays a step)."""
    graph = []

    def replay():
        if not graph:
            stream.begin_capture()
            try:
                fn()
            finally:
                graph.append(stream.end_capture())
            graph[0].upload(stream)
        graph[0].launch(stream)
    return replay


def inputs(n: int, data: Path | None, seed: int = 0):
    """[(name, x (n, 1, 28, 28) float32, labels (n,) int32)]: random normals, then real or picture-like images."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = [("random", rng.standard_normal((n, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, n).astype(np.int32))]
    if data is not None:
        from lenet import data as D

        images, labels = D.load_split(data, "train")
        mean, std = D.pixel_stats(images)
        x = ((images[:n].astype(np.float32) / 255.0 - mean) / std).astype(np.float32).reshape(n, 1, 28, 28)
        out.append(("fashion-mnist", x, labels[:n].astype(np.int32)))
    else:
        x = np.full((n, 1, 28, 28), -0.5, np.float32)   # a constant background
        for i in range(n):
            r, c, h, w = rng.integers(2, 10, 4)
            x[i, 0, r:r + 8 + h % 8, c:c + 8 + w % 8] = np.float32(rng.integers(1, 5) * 0.25)   # quantized blocks
        x[::3] = 0.0   # all-zero images: every window an exact tie
        out.append(("pictures", x, rng.integers(0, 10, n).astype(np.int32)))
    return out


def _model(n: int):
    """A model whose step at batch n runs the chain, whatever the planner chose (Note [a whole step] in
    lenet/steps.py), before its first step is captured."""
    from lenet.engines import Policy
    from lenet.model import LeNet

    model = LeNet(max_batch=n, policy=Policy.parse("heuristic", engine="auto"), seed=0, cuda_graph=True, **SETTINGS)
    model.plan(n).whole = None
    return model


def _state(model) -> dict:
    model.stream.synchronize()
    return {"params": model.params.get(), "grads": model.grads.get(), "velocity": model.velocity.get(),
            "loss": float(model.loss_dev.get()[0]), "correct": int(model.correct_dev.get()[0]), "logits": model.logits()}


def _distances(ours: dict, ref: dict) -> dict:
    import numpy as np

    from lenet import params as P

    out = {"loss": abs(ours["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30),
           "logits": float(np.linalg.norm(ours["logits"] - ref["logits"]) / np.linalg.norm(ref["logits"]))}
    for key in ("grads", "params", "velocity"):
        for name in P.NAMES:
            o = P.OFFSETS[name]
            size = int(np.prod(P.SHAPES[name]))
            a, b = ours[key][o:o + size].astype(np.float64), ref[key][o:o + size].astype(np.float64)
            out[f"{key}:{name}"] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    return out


def check(n: int, data: Path | None, tol: float, modules) -> bool:
    import cupy

    ok = True
    for name, x, y in inputs(n, data):
        model = _model(n)
        model.load_batch(x, y)
        for _ in range(2):
            model.step(n, LR)
        model.stream.synchronize()
        p0, v0 = model.params.copy(), model.velocity.copy()
        model.step(n, LR)
        ref = _state(model)
        for module in modules:
            with model.stream:
                model.params[...] = p0
                model.velocity[...] = v0
                model.grads.fill(0)
            cluster_step(model, n, module)()
            mine = _state(model)
            d = _distances(mine, ref)
            worst = max(d.items(), key=lambda kv: kv[1])
            good = worst[1] <= tol and mine["correct"] == ref["correct"]
            ok &= good
            print(f"{'OK  ' if good else 'FAIL'} {module:24s} batch {n:4d} {name:14s} loss {mine['loss']:.6f} "
                  f"(chain {ref['loss']:.6f}) correct {mine['correct']}/{ref['correct']} worst {worst[0]} {worst[1]:.2e}")
            if not good:
                for k, v in d.items():
                    print(f"       {k:24s} {v:.3e}")
        model.close()
        cupy.get_default_memory_pool().free_all_blocks()
    return ok


def _us(step, stream, steps: int, repeats: int) -> float:
    """us a call of ``step``: ``steps`` eager calls between two events, the best of ``repeats`` (lenet.timing's
    eager form, its call count fixed)."""
    from lenet.timing import time_launcher

    return time_launcher(step, stream, budget_ms=1e12, max_calls=steps, repeats=repeats, graph=False) * 1e3


def time_both(n: int, steps: int, repeats: int, modules) -> tuple[float, dict, dict, dict]:
    """(the chain's us a step, each variant's, each variant's phases in us from one profiled step, each variant's
    parts: {"clusters": its clusters' launch alone, "update": the update's alone (us; absent with one cluster),
    "starts": the spread of its clusters' first marks, "ends": its last cluster's last mark after the first
    cluster's first (us; from a profiled step, where the variant has the clock)})."""
    import cupy
    import numpy as np

    model = _model(n)
    x, y = inputs(n, None)[0][1:]
    model.load_batch(x, y)
    model.set_lr(np.float32(LR))
    chain = _us(lambda: model.step(n), model.stream, steps, repeats)
    mine, phases, parts = {}, {}, {}
    for module in modules:
        step = cluster_step(model, n, module)
        mine[module] = _us(replayed(step, model.stream), model.stream, steps, repeats)
        part = parts[module] = {}
        for name, launch in zip(("clusters", "update"), step.launches):
            part[name] = _us(replayed(launch, model.stream), model.stream, steps, repeats)
        prof = cupy.zeros(16 * n, cupy.uint64)
        profiled = cluster_step(model, n, module, prof)
        for _ in range(3):
            profiled()
        model.stream.synchronize()
        last = len(phases_of(module))
        rows = prof.get().reshape(-1, 16)[:profiled.clusters].astype(np.int64)
        marks = rows[0, :last + 1]
        phases[module] = [(b - a) / 1000 for a, b in zip(marks[:-1], marks[1:])] if marks.all() else []
        if rows[:, [0, last]].all():
            first = rows[:, 0].min()
            part["starts"], part["ends"] = (rows[:, 0].max() - first) / 1000, (rows[:, last].max() - first) / 1000
    chain2 = _us(lambda: model.step(n), model.stream, steps, repeats)   # interleaved: the machine's drift
    model.close()
    return min(chain, chain2), mine, phases, parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 64, 128, 256])
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--data", type=Path, default=HERE.parent / "data" / "fashion-mnist")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=[*SHIPPED, "step_cluster_v1"],
                    choices=VARIANTS + tuple(PROBES))
    ap.add_argument("--barriers", action="store_true", help="also time the barrier probes (PROBES)")
    args = ap.parse_args(argv)
    from descriptors import NoGpuError, require_gpu
    from lenet import kernels
    from lenet import params as P

    try:
        require_gpu()
    except NoGpuError as e:   # one line, not CUDA's traceback
        print(f"step_cluster.py: {e}", file=sys.stderr)
        return 2
    if OFFSETS != P.OFFSETS:
        raise SystemExit(f"step_common.cu's offsets are not lenet/params.py's: {P.OFFSETS}")
    kernels.declare(HERE / "step_cluster.cu")
    kernels.declare(HERE / "step_cluster_v1.cu")
    if kernels.arch() < 90:
        print(f"compute capability {kernels.arch() / 10:.1f}: thread-block clusters need 9.0")
        return 2
    for module in args.variants:
        fn = kernels.kernel(module, "step_cluster_kernel")
        threads, smem, maxg = shape(module)
        print(f"{module}: {fn.attributes['num_regs']} registers, {fn.attributes['local_size_bytes']} B local, "
              f"{smem} B shared, {threads} threads, {maxg} images a cluster")
    data = args.data if args.data.is_dir() else None
    ok = all([check(n, data, args.tol, args.variants) for n in args.batch])
    if args.barriers:
        args.variants += [p for p in PROBES if p not in args.variants]
    if not args.check_only:
        print(f"{'batch':>6} {'chain':>7} " + " ".join(f"{m[13:] or 'shipped':>10}" for m in args.variants) + "   (us a step)")
        for n in args.batch:
            chain, mine, phases, parts = time_both(n, args.steps, args.repeats, args.variants)
            print(f"{n:6d} {chain:7.2f} " + " ".join(f"{mine[m]:10.2f}" for m in args.variants))
            for m in args.variants:
                print(f"         {m:24s} phases (us): " + ", ".join(f"{p} {v:.2f}" for p, v in zip(phases_of(m), phases[m])))
                print(f"         {m:24s} parts (us): " + ", ".join(
                    f"{k} {v:.2f}" for k, v in parts[m].items()) + "  (each launch alone; the clusters' first marks' "
                    "spread, the last cluster's end after the first's start)")
                if m in PROBES and PROBES[m] in phases:
                    print(f"         {m:24s} a cluster barrier: {(phases[m][0] - phases[PROBES[m]][0]) / 10:.3f} us "
                          f"({shape(m)[0]} threads a block, {RANKS} blocks)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
