"""The LeNet step against PyTorch: logits, loss, every gradient and every parameter after
SGD, at several batch sizes and for every algorithm choice (see Note [tolerance])."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import WINOGRAD_RTOL, assert_close
from descriptors import AlgoPolicy, Direction

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, n).astype(np.int32)


def torch_step(torch, state, x, y, lr, momentum=0.0, wd=0.0, steps=1):
    from torch_lenet import from_state
    m = from_state(state)
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum, weight_decay=wd)
    tx, ty = torch.as_tensor(x, device="cuda"), torch.as_tensor(y, device="cuda").long()
    out = []
    for _ in range(steps):
        opt.zero_grad()
        logits = m(tx)
        loss = torch.nn.functional.cross_entropy(logits, ty)
        loss.backward()
        grads = {k: p.grad.detach().cpu().numpy().copy() for k, p in m.named_parameters()}
        out.append((logits.detach().cpu().numpy(), loss.item(), grads))
        opt.step()
    after = {k: v.detach().cpu().numpy() for k, v in m.state_dict().items()}
    return out, after


def check_one_step(torch, model, n, lr=0.1, seed=0, what="", winograd=False):
    from lenet.params import init_host
    from torch_lenet import well_conditioned_batch
    # A fresh PyTorch-default init each time: a model trained on the same few batches
    # becomes so confident that softmax - onehot cancels (1 - p_y ~ 1e-4) and float32
    # rounding, on both sides, shows up magnified.
    model.load_state_dict(init_host(1000 + seed + n))
    state = model.state_dict()
    x, y = well_conditioned_batch(state, n, seed)
    [(ref_logits, ref_loss, ref_grads)], ref_after = torch_step(torch, state, x, y, lr)
    model.load_batch(x, y)
    model.forward(n)
    logits, loss = model.logits(), model.loss()
    model.backward(n)
    grads = model.grad_dict()
    model.sgd_step(lr)
    after = model.state_dict()
    if winograd:
        # See Note [tolerance]: Winograd's own error moves decisions at any margin we can
        # afford, so only the continuous outputs are held to WINOGRAD_RTOL, and the
        # gradients to pointing the same way (a wrong gradient has cosine ~0).
        assert_close(logits, ref_logits, f"{what} logits", WINOGRAD_RTOL)
        assert abs(loss - ref_loss) <= WINOGRAD_RTOL * abs(ref_loss), f"{what} loss {loss} vs {ref_loss}"
        for k in ref_grads:
            a, b = grads[k].ravel().astype(np.float64), ref_grads[k].ravel().astype(np.float64)
            cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
            assert cos > 0.99, f"{what} grad {k}: cosine {cos:.4f} with PyTorch's"
        return
    assert_close(logits, ref_logits, f"{what} logits")
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), f"{what} loss {loss} vs {ref_loss}"
    for k in ref_grads:
        assert_close(grads[k], ref_grads[k], f"{what} grad {k}")
        assert_close(after[k], ref_after[k], f"{what} {k} after SGD")


@pytest.fixture(scope="module")
def models():
    from lenet.model import LeNet
    return {n: LeNet(max_batch=n, seed=n) for n in (1, 7, 64, 256)}


@pytest.mark.parametrize("n", [1, 7, 64, 256])
@pytest.mark.parametrize("policy", ["heuristic", "exhaustive"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_parity_policies(torch_ref, models, n, policy, fused):
    model = models[n]
    model.set_policy(AlgoPolicy.parse(policy))
    model.set_fused(fused)
    check_one_step(torch_ref, model, n, what=f"n={n} {policy} {'fused' if fused else 'unfused'}")


def test_fusion_is_planned(models):
    # cuDNN fuses conv+bias+ReLU for some forward algorithms (Note [fused convolution]); the plan
    # times both paths where it can and takes the faster one. With the heuristic's choice on this
    # GPU, at least one layer can fuse.
    model = models[64]
    model.set_policy(AlgoPolicy())
    model.set_fused(True)
    pl = model.plan(64)
    assert any(t is not None for t in pl.fused_ms.values()), model.algorithms(64)
    for layer, t in pl.fused_ms.items():
        assert pl.fused[layer] == (t is not None and t[0] <= t[1])
    model.set_fused(False)
    assert not any(model.plan(64).fused.values()) and model.plan(64).lt is None
    model.set_fused(True)
    assert pl.lt is not None, f"cuBLASLt epilogues unavailable: {pl.lt_note}"


def _fixed_combinations(model, n, winograd=False):
    """Every (fwd, bwd-data, bwd-filter) name combination both layers support at batch n;
    with winograd=False none of them Winograd, with True each combination that has one."""
    names = model.supported_names(n)
    combos = list(itertools.product(*(names[d] for d in Direction)))
    return [c for c in combos if any(a.startswith("winograd") for a in c) == winograd]


@pytest.mark.parametrize("n", [1, 7, 64, 256])
def test_parity_every_fixed_combination(torch_ref, models, n):
    model = models[n]
    combos = _fixed_combinations(model, n)
    assert combos
    model.set_fused(True)   # each layer fused where cuDNN runs it with that algorithm, plain elsewhere
    for fwd, bd, bf in combos:
        model.set_policy(AlgoPolicy(fwd=fwd, bwd_data=bd, bwd_filter=bf))
        check_one_step(torch_ref, model, n, seed=len(fwd) + len(bd),
                       what=f"n={n} {fwd}/{bd}/{bf} fused={model.plan(n).fused}")
    print(f"n={n}: {len(combos)} combinations")


@pytest.mark.parametrize("n", [1, 64])
def test_parity_winograd_combinations(torch_ref, models, n):
    model = models[n]
    combos = _fixed_combinations(model, n, winograd=True)
    assert combos, "cuDNN reports no Winograd algorithm for LeNet's shapes"
    for fwd, bd, bf in combos:
        model.set_policy(AlgoPolicy(fwd=fwd, bwd_data=bd, bwd_filter=bf))
        check_one_step(torch_ref, model, n, seed=3, what=f"n={n} {fwd}/{bd}/{bf}", winograd=True)


def test_deterministic_policy_switches_pooling(models):
    model = models[7]
    model.set_policy(AlgoPolicy(deterministic=True))
    assert model.pool.read()["mode"] == "max_deterministic"
    assert all(r.deterministic for r in model.algorithms(7).values())
    model.set_policy(AlgoPolicy())
    assert model.pool.read()["mode"] == "max"


def test_smaller_batch_than_max(torch_ref):
    from lenet.model import LeNet
    model = LeNet(max_batch=64, seed=3)
    for n in (64, 5, 33):
        check_one_step(torch_ref, model, n, seed=n, what=f"n={n} of 64")


def test_cuda_graph_parity(torch_ref):
    from lenet.model import LeNet
    torch = torch_ref
    from torch_lenet import well_conditioned_batch
    eager = LeNet(max_batch=64, seed=9, fused=False)
    graph = LeNet(max_batch=64, seed=9, cuda_graph=True, fused=True)
    state = eager.state_dict()
    x, y = well_conditioned_batch(state, 64, 5)
    ref, ref_after = torch_step(torch, state, x, y, lr=0.05, steps=5)
    for m in (eager, graph):
        m.load_batch(x, y)
        losses = []
        for _ in range(5):
            m.step(64, 0.05)
            losses.append(m.loss())
        np.testing.assert_allclose(losses, [r[1] for r in ref], rtol=1e-4)
        after = m.state_dict()
        for k in ref_after:
            assert_close(after[k], ref_after[k], f"{'graph' if m.cuda_graph else 'eager'} {k} after 5 steps")


def test_ten_steps_follow_pytorch_and_fall(torch_ref):
    from lenet.model import LeNet
    torch = torch_ref
    x, y = batch(64, 11)
    model = LeNet(max_batch=64, seed=1)
    ref, _ = torch_step(torch, model.state_dict(), x, y, lr=0.05, steps=10)
    model.load_batch(x, y)
    ours = []
    for _ in range(10):
        model.step(64, 0.05)
        ours.append(model.loss())
    refl = [r[1] for r in ref]
    for i, (a, b) in enumerate(zip(ours, refl)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {i}: ours {a} vs PyTorch {b}"
    assert all(b < a for a, b in zip(ours, ours[1:])) and ours[-1] < 0.95 * ours[0], f"loss did not fall: {ours}"


def test_momentum_and_weight_decay(torch_ref):
    from lenet.model import LeNet
    torch = torch_ref
    from torch_lenet import well_conditioned_batch
    model = LeNet(max_batch=32, seed=2, momentum=0.9, weight_decay=5e-4)
    x, y = well_conditioned_batch(model.state_dict(), 32, 12)
    ref, ref_after = torch_step(torch, model.state_dict(), x, y, lr=0.02, momentum=0.9, wd=5e-4, steps=4)
    model.load_batch(x, y)
    for i in range(4):
        model.step(32, 0.02)
        assert abs(model.loss() - ref[i][1]) <= 1e-4 * ref[i][1]
    after = model.state_dict()
    for k in ref_after:
        assert_close(after[k], ref_after[k], f"momentum {k}")


def test_evaluation_totals(torch_ref):
    from lenet.model import LeNet
    from torch_lenet import from_state
    torch = torch_ref
    model = LeNet(max_batch=100, seed=4)
    m = from_state(model.state_dict())
    model.evaluate_begin()
    ref_loss, ref_correct = 0.0, 0
    for seed, n in ((1, 100), (2, 37)):
        x, y = batch(n, seed)
        model.load_batch(x, y)
        model.evaluate_batch(n)
        with torch.no_grad():
            lg = m(torch.as_tensor(x, device="cuda"))
        ty = torch.as_tensor(y, device="cuda").long()
        ref_loss += float(torch.nn.functional.cross_entropy(lg, ty, reduction="sum"))
        ref_correct += int((lg.argmax(1) == ty).sum())
    loss, correct = model.evaluate_end()
    assert abs(loss - ref_loss) <= 1e-4 * ref_loss and correct == ref_correct


@pytest.mark.parametrize("bad,msg", [
    (lambda x, y: (x, np.where(np.arange(len(y)) == 3, 10, y)), r"labels must be in \[0, 10\)"),
    (lambda x, y: (x, y - 1 - y), r"labels must be in \[0, 10\)"),
    (lambda x, y: (np.where(np.arange(x.size).reshape(x.shape) == 7, np.nan, x).astype(np.float32), y),
     "NaN or infinite"),
    (lambda x, y: (x[:, :, :27], y), r"images must have shape \(N, 1, 28, 28\)"),
    (lambda x, y: (x, y[:-1]), r"labels must have shape \(8,\)"),
    (lambda x, y: (x, y.astype(np.float32)), "labels must be integers"),
    (lambda x, y: (np.concatenate([x, x]), np.concatenate([y, y])), "this model takes 1 to 8"),
])
def test_bad_batches_refused_before_gpu_work(bad, msg):
    from lenet.model import LeNet
    model = LeNet(max_batch=8, seed=0)
    x, y = batch(8, 0)
    before = model.state_dict()
    with pytest.raises(ValueError, match=msg):
        model.train_step(*bad(x, y), lr=0.1)
    after = model.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before), "a refused batch changed the model"


def test_dump_reproduces_gradients_in_pytorch(torch_ref, tmp_path):
    torch = torch_ref
    dump = tmp_path / "step.npz"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "lenet.train_step", "--batch-size", "16", "--synthetic",
                          "--lr", "0.1", "--dump", str(dump)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    d = np.load(dump)
    from lenet.params import NAMES
    state = {k: d[k] for k in NAMES}
    [(logits, loss, grads)], after = torch_step(torch, state, d["x"], d["y"], lr=0.1)
    for k in NAMES:
        assert_close(d[f"grad.{k}"], grads[k], f"dump grad.{k}")
        assert_close(d[f"after.{k}"], after[k], f"dump after.{k}")


def test_train_step_program(tmp_path):
    import json
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for algo in ("heuristic", "exhaustive", "fwd=implicit_gemm,bwd-data=algo_1,bwd-filter=algo_1"):
        out = subprocess.run([sys.executable, "-m", "lenet.train_step", "--synthetic", "--json", "--steps", "3",
                              "--algo", algo], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        facts = json.loads(out.stdout)
        assert len(facts["algorithms"]) == 5 and facts["step_ms"] > 0
        assert facts["loss_after"] < facts["loss_before"]
    out = subprocess.run([sys.executable, "-m", "lenet.train_step", "--synthetic", "--algo", "fwd=fft",
                          "--batch-size", "8", "--workspace-limit", "0"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "supported here" in out.stderr, out.stderr


def test_pooling_in_chunks(torch_ref, monkeypatch):
    # Batches above POOL_CHUNK pool in several cuDNN calls (Note [pooling batch limit]); a small
    # chunk size exercises the same code a batch of 65536 takes.
    import lenet.model as M
    monkeypatch.setattr(M, "POOL_CHUNK", 16)
    model = M.LeNet(max_batch=40, seed=6)
    assert [c[:2] for c in model.plan(40).pool_chunks] == [(0, 16), (16, 16), (32, 8)]
    check_one_step(torch_ref, model, 40, seed=8, what="pooling in chunks of 16")
