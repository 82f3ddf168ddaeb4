"""The whole training step in one launch of thread-block clusters (lenet/kernels/step_cluster.cu; Note [a whole
step] in lenet/steps.py) against the chain of planned operations and against PyTorch, on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from lenet.kernels.step import FORMS, LIMIT

pytestmark = pytest.mark.gpu

RULES = {   # the update's rules and the loss's smoothing the kernel takes
    "plain": {},
    "momentum": {"momentum": 0.9, "weight_decay": 5e-4},
    "nesterov+smoothing": {"momentum": 0.9, "weight_decay": 1e-3, "nesterov": True, "label_smoothing": 0.1},
    "average": {"momentum": 0.9, "ema_decay": 0.99, "label_smoothing": 0.05},
}


def _clusters():
    from lenet.kernels import arch

    if arch() < 90:
        pytest.fail(f"these kernels are compiled for compute capability {arch() / 10:.1f}: the whole step needs 9.0 "
                    "(run this file without LENET_KERNEL_ARCH)")


def _model(n, **rule):
    from lenet.engines import Policy
    from lenet.model import LeNet

    return LeNet(max_batch=n, policy=Policy.parse("heuristic", engine="ours"), seed=3, cuda_graph=False, **rule)


def _inputs(n, seed=0):
    """Random normals; pictures on a constant background with blank images among them (exact ties in every
    pooling window, exact zeros after a ReLU); Fashion-MNIST's images where the data is found."""
    from lenet import data as D

    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, n).astype(np.int32)
    out = [("random", rng.standard_normal((n, 1, 28, 28), dtype=np.float32), y)]
    x = np.full((n, 1, 28, 28), -0.4242, np.float32)
    for i in range(n):
        r, c = rng.integers(2, 12, 2)
        x[i, 0, r:r + 12, c:c + 10] = np.float32(rng.integers(1, 6) * 0.5)
    x[::3] = 0.0
    out.append(("pictures", x, y))
    root = D.find_dataset()
    if root is not None:
        images, labels = D.load_split(root, "train")
        mean, std = D.pixel_stats(images)
        real = ((images[:n].astype(np.float32) / 255.0 - mean) / std).reshape(n, 1, 28, 28).astype(np.float32)
        out.append(("fashion-mnist", real, labels[:n].astype(np.int32)))
    return out


def _well_decided(state, source, n, margin=1e-5):
    """n images of ``source`` (random normals, or Fashion-MNIST's training images from its first) and their labels,
    each of whose pooling and ReLU decisions is at least ``margin`` from a tie in float64 at ``state``
    (tests/torch_lenet.py's margins_past_ties). A decision within rounding of its tie may be taken either way by two float32 sums in
    different orders, and moves a gradient by a whole term (tests/numerics.py, Note [step numerics]): 1 of 80
    Fashion-MNIST images put conv1's weight gradient 7e-4 from the chain's."""
    from torch_lenet import margins_past_ties

    if source == "random":
        rng = np.random.default_rng(11)
        x = rng.standard_normal((4 * n, 1, 28, 28), dtype=np.float32)
        y = rng.integers(0, 10, 4 * n).astype(np.int32)
    else:
        x, y = _inputs(4 * n)[-1][1:]
    keep = np.flatnonzero(margins_past_ties(state, x) >= margin)[:n]
    assert len(keep) == n, f"{len(keep)} of {4 * n} {source} images decide every pooling and ReLU clearly"
    return x[keep], y[keep]


def _state(model):
    model.stream.synchronize()
    arrays = {"params": model.params, "grads": model.grads, "velocity": model.velocity, "ema": model.ema}
    return {k: v.get() for k, v in arrays.items() if v is not None} | {
        "loss": float(model.loss_dev.get()[0]), "correct": int(model.correct_dev.get()[0]),
        "running": float(model.running_loss.get()[0]), "logits": model.logits()}


def _padding():
    """The flat buffers' padding between two tensors (lenet/params.py): zero (the update's second kernel writes
    its zeros back; nothing writes anything else there)."""
    from lenet import params as P

    pad = np.ones(P.TOTAL, bool)
    for p, off in P.OFFSETS.items():
        pad[off:off + int(np.prod(P.SHAPES[p]))] = False
    return pad


def _whole(model, n, form="cluster step"):
    """The whole step of one form bound by our engine for the model's batch n (whatever the planner's timing
    chose)."""
    from lenet.engines.base import Named
    from lenet.engines.ours import Ours

    return Ours().bind(model.operations.step, n, Named("ours", form), model.planner)


# Each form at the ends of its batch sizes and between (an odd batch: the two-image form's last cluster half full)
SIZES = {"cluster step": (1, 5, 32), "cluster step, 256 threads": (24, 40), "cluster step, 2 images a cluster": (33, 56),
         "cluster step, 2 images a cluster, 256 threads": (57, 80)}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("form, n", [(f.name, n) for f in FORMS for n in SIZES[f.name]])
def test_the_whole_step_is_the_chains_step(form, n, rule):
    """From one state (two steps in, so the momentum and the average are not zero), one step by the chain and
    one by the whole step (each form): every gradient, parameter, momentum and average within 1e-5 of the
    chain's (relative L2 a parameter), the loss, its running sum and the logits too, on random, picture-like
    and real images (random and real ones whose decisions are clear at that state: ``_well_decided``)."""
    from lenet import params as P

    _clusters()
    for name, x, y in _inputs(n):
        model = _model(n, **RULES[rule])
        model.load_batch(x, y)
        model.set_lr(0.05)
        step = model.plan(n)
        for _ in range(2):
            step.chain()
        model.stream.synchronize()
        if name != "pictures":   # the compared step's batch: images no decision of which is a near-tie there
            model.load_batch(*_well_decided(model.state_dict(), name, n))
        before = {k: a.copy() for k, a in (("p", model.params), ("v", model.velocity), ("e", model.ema),
                                           ("r", model.running_loss)) if a is not None}
        step.chain()
        ref = _state(model)
        with model.stream:
            for k, a in (("p", model.params), ("v", model.velocity), ("e", model.ema), ("r", model.running_loss)):
                if a is not None:
                    a[...] = before[k]
            model.grads.fill(0)
        _whole(model, n, form).train()
        mine = _state(model)
        what = f"{form}, batch {n} {rule} {name}"
        assert mine["correct"] == ref["correct"], what
        for k in ("loss", "running"):
            assert abs(mine[k] - ref[k]) <= 1e-5 * abs(ref[k]), f"{what}: {k} {mine[k]} vs {ref[k]}"
        np.testing.assert_allclose(mine["logits"], ref["logits"], rtol=1e-5, atol=1e-6, err_msg=what)
        for key in ("grads", "params", "velocity", "ema"):
            if key not in ref:
                continue
            for p, off in P.OFFSETS.items():
                size = int(np.prod(P.SHAPES[p]))
                a, b = mine[key][off:off + size].astype(np.float64), ref[key][off:off + size].astype(np.float64)
                d = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
                assert d <= 1e-5, f"{what}: {key} {p} {d:.2e} from the chain's"
            if key != "params":
                assert not mine[key][_padding()].any(), f"{what}: {key}'s padding is not zero"
        model.close()


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("n", [1, 8])
def test_a_model_training_with_the_whole_step_matches_pytorch(n, graph):
    """A model whose Step trains with the whole step (set before its first step, whatever the planner's timing
    chose): one step through model.step, eager and captured, against PyTorch's float32 step (tests/
    test_model_gpu.py's check: logits, loss, gradients, the parameters after SGD)."""
    import torch

    from lenet.engines.base import Chosen
    from lenet.engines import Policy
    from lenet.model import LeNet
    from test_model_gpu import check_one_step_graph

    _clusters()
    model = LeNet(max_batch=n, policy=Policy.parse("heuristic", engine="ours"), seed=0, cuda_graph=graph)
    model.plan(n).whole = Chosen(_whole(model, n), None, {}, {})
    check_one_step_graph(torch, model, n, what=f"whole step, batch {n}, graph {graph}")
    model.close()


def test_twenty_steps_of_the_whole_step_stay_with_the_chain():
    """Two models from one initialization, one training with the chain and one with the whole step, 20 steps of
    momentum SGD on the same batches: their parameters stay within 1e-4 (float32 rounding compounds)."""
    from lenet.engines.base import Chosen

    _clusters()
    n = 8
    chain, whole = (_model(n, momentum=0.9, weight_decay=5e-4) for _ in range(2))
    whole.plan(n).whole = Chosen(_whole(whole, n), None, {}, {})
    chain.plan(n).whole = None
    rng = np.random.default_rng(7)
    for _ in range(20):
        x, y = rng.standard_normal((n, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, n).astype(np.int32)
        for m in (chain, whole):
            m.train_step(x, y, 0.05)
    for m in (chain, whole):   # a model's stream waits for no other: read once it is done
        m.stream.synchronize()
    a, b = (m.params.get().astype(np.float64) for m in (whole, chain))
    d = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert d <= 1e-4, f"after 20 steps the whole step's parameters are {d:.2e} from the chain's"
    assert abs(whole.loss() - chain.loss()) <= 1e-4 * abs(chain.loss())
    for m in (chain, whole):
        m.close()


def test_planning_the_whole_step_leaves_the_models_state_as_it_was():
    """Checking and timing the whole step runs many training steps: the parameters, momentum, average and loss
    totals after model.plan(n) are those before it, bit for bit."""
    _clusters()
    n = 5
    model = _model(n, momentum=0.9, ema_decay=0.99)
    model.set_lr(0.05)
    model.train_step(*_inputs(n)[0][1:], 0.05)   # a state that is not the initial one (momentum, average)
    model.stream.synchronize()
    arrays = (model.params, model.velocity, model.ema, model.loss_dev, model.correct_dev, model.running_loss)
    before = [a.get() for a in arrays]
    model.plan(3)   # a batch size not planned yet: the whole step checked and timed against the chain
    model.stream.synchronize()
    table = next(d for k, d in model.planner.decisions.items() if '"op": "step train step"' in k and '"n": 3' in k)
    assert len(table.table) == 2, table
    for a, b in zip(arrays, before):
        assert np.array_equal(a.get(), b)
    model.close()


def test_the_planner_weighs_the_whole_step_only_where_it_may(monkeypatch):
    """--engine ours at batch 4: the decision's table times the chain and the whole step (each checked first);
    at 40, the chain and the two forms offered there; above LIMIT, and under --engine legacy, the whole step is not a candidate and the chain runs; under a
    reproducible policy the chain runs (it is first)."""
    from lenet.engines import Policy
    from lenet.model import LeNet

    _clusters()
    model = _model(LIMIT + 1)
    step = model.plan(4)
    table = next(d for k, d in model.planner.decisions.items() if '"op": "step train step"' in k)
    labels = [t.candidate.engine + ":" + t.candidate.name for t in table.table]
    assert set(labels) == {"chain:planned operations", "ours:cluster step"}, (labels, table.refused)
    assert all(t.ms and t.ms > 0 for t in table.table)
    fastest = table.table[0].candidate.engine
    assert (step.whole is not None) == (fastest == "ours"), (fastest, step.whole)
    if step.whole is not None:
        assert step.describe()[0]["algo"] == "step_cluster"
    assert model.plan(LIMIT + 1).whole is None
    model.plan(40)   # two forms offered there
    table = next(d for k, d in model.planner.decisions.items() if '"op": "step train step"' in k and '"n": 40' in k)
    assert {t.candidate.engine + ":" + t.candidate.name for t in table.table} == {
        "chain:planned operations", "ours:cluster step, 256 threads", "ours:cluster step, 2 images a cluster"}, table
    model.close()
    m = LeNet(max_batch=4, policy=Policy.parse("heuristic", engine="legacy"), seed=0)
    assert m.plan(4).whole is None
    assert not any('"op": "step train step"' in k for k in m.planner.decisions), "no engine may run it: no decision"
    m.close()
    # Reproducible: the chain, first, is taken untimed, and the whole step is neither checked nor timed.
    m = LeNet(max_batch=4, policy=Policy.parse("heuristic", engine="ours", deterministic=True), seed=0)
    assert m.plan(4).whole is None
    table = next(d for k, d in m.planner.decisions.items() if '"op": "step train step"' in k)
    assert [(t.candidate.engine, t.ms) for t in table.table] == [("chain", None)] and not table.refused, table
    m.close()


def test_the_workbench_checks_the_whole_step_and_its_variants_against_the_chain():
    """dev/step_cluster.py --check-only: what ships and the form before it (dev/step_cluster_v1.cu), one step
    against the chain's on random and real (or picture-like) images, at batch sizes of one cluster and of
    several; every line OK."""
    import subprocess
    import sys
    from pathlib import Path

    _clusters()
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "dev" / "step_cluster.py"), "--check-only", "--batch", "1", "3",
                          "9"], capture_output=True, text=True, timeout=600, cwd=root)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "FAIL" not in out, out[-3000:]
    assert out.count("OK  ") >= (len(FORMS) + 1) * 3 * 2, out[-3000:]   # variants x batches x input sets
