"""A pack of K models (lenet sweep, Note [packs] in lenet/ops.py) against the same models trained alone:
the first step's loss and gradients, the parameters after SGD steps with each model's own constants
(momentum, Nesterov, weight decay, label smoothing, moving average), and evaluation.

Note [pack tolerance]: without --deterministic a pack sums the same products as a lone model, in another
order (Note [a pack and a lone run] in lenet/pack.py) once it holds more than a few images per SM: our stage
kernels split a model's images over fewer blocks when K models share the SMs, and the head may run as
batched cuBLASLt matmuls. Random normal batches (no ReLU or pooling
decision within float32 rounding of its threshold at these sizes) agree to a few 1e-7 in relative L2;
the bar is 1e-6 per model, the bar against float64 for images whose decisions agree (ARCHITECTURE.md). Ranking
its candidates at K n images, a pack may also take another kernel version than its lone runs: stage 2's
forward on the tensor cores (three TF32 products a product, from 6 images an SM) at 3 x 300 images, where
each lone run of 300 takes the float32 multiply-adds of version 1. The two forwards round differently, and
the first-step gradients then differ by 1.2e-6 (an H200); each within 1e-6 of float64's, two such runs are
within 2e-6 of each other: the bar where the pack's forward is another version than the lone run's.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import rel_err

pytestmark = pytest.mark.gpu

SETTINGS = {"seed": [0, 1, 2], "momentum": [0.9, 0.0, 0.5], "weight_decay": [5e-4, 0.0, 1e-3],
            "nesterov": [True, False, False], "label_smoothing": [0.1, 0.0, 0.05], "ema_decay": [None, 0.99, None]}
LR = [0.1, 0.05, 0.02]
K = 3


def flat(d: dict) -> np.ndarray:
    return np.concatenate([np.asarray(v, np.float64).ravel() for _, v in sorted(d.items())])


def lone(m: int, n: int, **kw):
    from lenet.model import LeNet

    return LeNet(max_batch=n, **{k: v[m] for k, v in SETTINGS.items()}, **kw)


def forwards(model, n: int) -> list[str]:
    """The versions of our stage forwards a model planned at n images (Note [pack tolerance])."""
    algos = [str(row.get("algo")) for row in model.describe(n)]
    return [a.split("-i")[0] for a in algos if a.startswith("fused-fwd-")]


def batches(n: int, steps: int, seed: int = 5):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((K, n, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, (K, n)).astype(np.int32))
            for _ in range(steps)]


@pytest.mark.parametrize("n,graph", [(64, True), (7, False), (300, True)])
def test_pack_trains_each_model_as_it_trains_alone(n, graph):
    """At 64 and 7 images a model the pack sums as its lone runs (sums_as_lone); at 300 (900 images, more
    than 4 an SM on an H100) its models share the SMs' grids and sum in another order."""
    from lenet.model import LeNet

    data = batches(n, 4)
    pack = LeNet(max_batch=n, models=K, cuda_graph=graph, **SETTINGS)
    alone = [lone(m, n, cuda_graph=graph) for m in range(K)]
    for m in range(K):   # the same initialization as the lone model of the same seed
        assert rel_err(flat(pack.state_dict(m)), flat(alone[m].state_dict())) == 0.0
    x, y = data[0]
    pack.load_batch(x, y)
    pack.forward(n)
    pack.backward(n)
    losses = pack.loss()
    ours = forwards(pack, n), forwards(alone[0], n)   # the bar loosens only where both run our forwards
    worst, bar = 0.0, (2e-6 if all(ours) and ours[0] != ours[1] else 1e-6)   # Note [pack tolerance]
    for m, a in enumerate(alone):
        a.load_batch(x[m], y[m])
        a.forward(n)
        a.backward(n)
        assert abs(losses[m] - a.loss()) <= 1e-6 * abs(a.loss())
        err = rel_err(flat(pack.grad_dict(m)), flat(a.grad_dict()))
        worst = max(worst, err)
        assert err <= bar, f"model {m}: first-step gradients differ by {err:.2e} (relative L2; the bar {bar:.0e})"
    for x, y in data:
        pack.train_step(x, y, LR)
        for m, a in enumerate(alone):
            a.train_step(x[m], y[m], LR[m])
    for m, a in enumerate(alone):
        err = rel_err(flat(pack.state_dict(m)), flat(a.state_dict()))
        assert err <= 1e-6, f"model {m}: parameters after {len(data)} steps differ by {err:.2e}"
        err = rel_err(flat(pack.eval_state_dict(m)), flat(a.eval_state_dict()))
        assert err <= 1e-6, f"model {m}: evaluated weights differ by {err:.2e}"
    # a model of the pack that keeps no average evaluates its own weights, exactly
    assert rel_err(flat(pack.eval_state_dict(0)), flat(pack.state_dict(0))) == 0.0
    from lenet.engines.base import sums_as_lone

    print(f"pack of {K} at {n} (sums as its lone runs: {sums_as_lone(K, n, pack.policy)}; forwards {forwards(pack, n)}"
          f" against {forwards(alone[0], n)} alone): first-step gradients within {worst:.2e} of the lone models")


def test_pack_evaluates_each_model_as_it_evaluates_alone():
    from lenet.data import GpuDataset
    from lenet.model import LeNet

    rng = np.random.default_rng(3)
    images, labels = rng.integers(0, 256, (1500, 28, 28), dtype=np.uint8), rng.integers(0, 10, 1500).astype(np.uint8)
    pack = LeNet(max_batch=500, models=K, cuda_graph=True, **SETTINGS)
    split = GpuDataset(images, labels, 72.9, 90.0, pack.stream)
    for tta in (False, True):
        loss, acc = pack.evaluate(split, batch=400, tta=tta)   # 400 + 400 + 400 + 300: two batch sizes
        for m in range(K):
            a = lone(m, 500, cuda_graph=True)
            one = GpuDataset(images, labels, 72.9, 90.0, a.stream)
            ref_loss, ref_acc = a.evaluate(one, batch=400, tta=tta)
            assert abs(loss[m] - ref_loss) <= 1e-5 * ref_loss and abs(acc[m] - ref_acc) <= 1 / 1500


def test_pack_of_one_is_a_lone_model():
    from lenet.model import LeNet

    (x, y), = batches(32, 1)
    one, plain = LeNet(max_batch=32, models=1, seed=4), LeNet(max_batch=32, seed=4)
    for model in (one, plain):
        model.train_step(x[0], y[0], 0.1)
    assert one.describe(32) == plain.describe(32) or [r["algo"] for r in one.describe(32)] == \
        [r["algo"] for r in plain.describe(32)]
    assert rel_err(flat(one.state_dict()), flat(plain.state_dict())) == 0.0


def test_a_pack_of_one_configuration_trains_and_reports_its_epochs():
    """`lenet sweep` of one model: its pack is a lone model (LeNet(models=1)), whose evaluation gives numbers
    where a pack's gives rows; the epoch's figures are read as one row (they once failed on it)."""
    import cupy

    from lenet.data import GpuDataset
    from lenet.pack import Config, Pack

    rng = np.random.default_rng(5)
    images, labels = rng.integers(0, 256, (300, 28, 28), dtype=np.uint8), rng.integers(0, 10, 300).astype(np.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    train, test = (GpuDataset(images[:200], labels[:200], 70.0, 80.0, stream),
                   GpuDataset(images[200:], labels[200:], 70.0, 80.0, stream))
    pack = Pack([Config(seed=2, epochs=2, batch_size=64, cutout=6, ema=0.99)], train, test, tta=True,
                keep_average=True)
    for epoch in range(2):
        pack.steps_of(pack.begin_epoch())
        done = pack.end_epoch(0.01)
    (r,) = done
    assert r.done and len(r.accuracy) == len(r.loss) == len(r.train_loss) == 2
    assert all(0.0 <= a <= 1.0 for a in r.accuracy) and all(np.isfinite(r.loss + r.train_loss))
    pack.close()


def test_each_model_of_a_pack_gathers_what_its_lone_run_gathers():
    """gather_pack (one launch for the pack) against gather_batch (a lone run's), model by model: its own
    permutation, augmentation draws, epoch, labels and learning rate."""
    import cupy

    from lenet.data import GpuDataset
    from lenet.kernels import Augment, gather_batch
    from lenet.pack import Config, Pack

    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (700, 28, 28), dtype=np.uint8), rng.integers(0, 10, 700).astype(np.uint8)
    configs = [Config(seed=3, flip=True, epochs=4, lr=0.2, batch_size=128),
               Config(seed=8, shift=2, flip=False, epochs=4, lr=0.05, batch_size=128),
               Config(seed=1, schedule="step", epochs=4, lr=0.1, cutout=10, batch_size=128)]
    stream = cupy.cuda.Stream(non_blocking=True)
    train, test = GpuDataset(images, labels, 70.0, 80.0, stream), GpuDataset(images[:100], labels[:100], 70.0, 80.0,
                                                                              stream)
    pack = Pack(configs, train, test, cuda_graph=False)
    pack.slots[1].accuracy = [0.5, 0.5]   # model 1 in its third epoch: its own epoch's order and draws
    orders = pack.begin_epoch()
    n, s = 100, 3
    pack.model.load_pack(train, orders, s * 128, n, pack.aug, pack.epoch_dev, pack.lr_table, pack.lr_at, s)
    pack.model.stream.synchronize()   # read below on another stream, which does not wait for the pack's
    with stream:
        x, y = cupy.zeros((n, 1, 28, 28), cupy.float32), cupy.zeros(n, cupy.int32)
    for m, c in enumerate(configs):
        epoch = len(pack.slots[m].accuracy)
        with stream:
            gather_batch(train.images, train.labels, train.order(c.seed, epoch), s * 128, n, train.mean, train.std,
                         x, y, 0.0, None, Augment(c.shift, c.flip, c.seed, cutout=c.cutout), epoch)
        stream.synchronize()
        rows = slice(m * n, (m + 1) * n)
        assert cupy.array_equal(pack.model.buf["x"][rows], x) and cupy.array_equal(pack.model.buf["labels"][rows], y)
        want = np.float32(c.schedule_of(pack.steps).at(epoch * pack.steps + s, pack.steps, pack.steps * c.epochs))
        assert float(pack.model.lr_dev[m].get()) == want
    pack.close()


@pytest.mark.parametrize("engine,n,deterministic", [("auto", 128, True), ("auto", 7, True), ("ours", 300, True),
                                                    ("legacy", 32, True), ("graph", 32, True), ("ours", 128, False)])
def test_a_deterministic_pack_is_each_models_lone_run(engine, n, deterministic):
    """Note [a pack and a lone run] in lenet/pack.py: under --deterministic, and without it in a pack of few
    images (3 models of 128: sums_as_lone), each model of a pack sums as its lone run does, on our kernels
    (its lone grid and candidates, our head on its lone grid) and on cuDNN's (each model's lone calls, Note
    [a pack on cuDNN]; each model's lone matmuls, Note [a deterministic pack's head]): every model's
    gradients and parameters after SGD steps are its lone run's, bit for bit. At 300 images our head sums
    its weight gradients over two ranges of 256 (the pack's reduction)."""
    from lenet.engines import Policy
    from lenet.engines.base import sums_as_lone
    from lenet.model import LeNet

    policy = Policy(engine=engine, deterministic=deterministic)
    assert sums_as_lone(K, n, policy)
    data = batches(n, 3, seed=9)
    pack = LeNet(max_batch=n, models=K, policy=policy, cuda_graph=True, **SETTINGS)
    alone = [lone(m, n, policy=policy, cuda_graph=True) for m in range(K)]
    plans = [[(r["layer"], r["engine"], r["algo"]) for r in model.describe(n)] for model in (pack, alone[0])]
    assert plans[0] == plans[1], plans   # the lone run's engines and candidates
    if engine in ("legacy", "graph"):
        assert all(r["engine"] != "ours" for r in pack.describe(n) if r["layer"].startswith("conv"))
    else:
        assert all(r["engine"] == "ours" for r in pack.describe(n) if r["layer"] != "sgd"), pack.describe(n)
    x, y = data[0]
    pack.load_batch(x, y)
    pack.forward(n)
    pack.backward(n)
    same = []
    for m, a in enumerate(alone):
        a.load_batch(x[m], y[m])
        a.forward(n)
        a.backward(n)
        err = rel_err(flat(pack.grad_dict(m)), flat(a.grad_dict()))
        assert err <= 1e-6, f"model {m}: first-step gradients differ by {err:.2e}"
        same.append(all(np.array_equal(pack.grad_dict(m)[k], a.grad_dict()[k]) for k in a.grad_dict()))
    for x, y in data:
        pack.train_step(x, y, LR)
        for m, a in enumerate(alone):
            a.train_step(x[m], y[m], LR[m])
    identical = [np.array_equal(flat(pack.state_dict(m)), flat(a.state_dict())) for m, a in enumerate(alone)]
    for m, a in enumerate(alone):
        assert rel_err(flat(pack.state_dict(m)), flat(a.state_dict())) <= 1e-6
    print(f"pack of {K} at {n} on {engine}, deterministic {deterministic}: first-step conv gradients bit-identical {same}; parameters "
          f"after {len(data)} steps bit-identical {identical}")
    assert all(same) and all(identical)   # Note [a deterministic pack's head] in lenet/engines/fc.py


def test_the_pack_versions_of_our_kernels_pass_cudnns_check():
    """Note [checking a pack] in lenet/engines/ours_check.py: each launch shape's pack version, as a pack launches
    it, against cuDNN's exact result, model by model; and a planned pack's decisions carry the checks."""
    from lenet.engines.ours import Ours
    from lenet.model import STAGES, LeNet

    model = LeNet(max_batch=64, models=3)
    ours = Ours()
    for spec in STAGES:
        fwds, bwds = ours.stage_candidates(spec, model.policy, 192)
        for c in fwds[:2] + bwds[:2]:
            check = ours.check_stage(model.planner, spec, c, 3)
            assert check.why is None and check.error is not None and check.error < 1e-5, (spec.name, c.name, check)
    rows = [r for r in model.describe(64) if r["layer"].startswith("conv") and r["engine"] == "ours"]
    assert rows and all(r.get("error") is not None for r in rows)
