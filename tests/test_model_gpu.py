"""The LeNet step against PyTorch: logits, loss, every gradient and every parameter after
SGD, at several batch sizes and for every algorithm choice (see Note [tolerance])."""

from __future__ import annotations

import functools
import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import WINOGRAD_RTOL, assert_close
from lenet.engines import BY_NAME, Policy

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


def check_one_step(torch, model, n, lr=0.1, seed=0, what="", winograd=False, rtol=1e-4):
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
    model.update(lr)
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
    assert_close(logits, ref_logits, f"{what} logits", rtol)
    assert abs(loss - ref_loss) <= rtol * abs(ref_loss), f"{what} loss {loss} vs {ref_loss}"
    for k in ref_grads:
        assert_close(grads[k], ref_grads[k], f"{what} grad {k}", rtol)
        assert_close(after[k], ref_after[k], f"{what} {k} after SGD", rtol)


@pytest.fixture(scope="module")
def models():
    from lenet.model import LeNet
    return {n: LeNet(max_batch=n, seed=n) for n in (1, 7, 64, 256)}


# Every engine x policy x fusion at batch 64; batch 1, 7 and 256 for a few of them.
PARITY = [(64, e, p, f) for e in ("legacy", "graph", "auto") for p in ("heuristic", "exhaustive") for f in (True, False)]
PARITY += [(n, e, p, f) for n in (1, 7, 256) for e, p, f in (("auto", "heuristic", True), ("auto", "exhaustive", True),
                                                             ("graph", "exhaustive", False))]


@pytest.mark.parametrize("n,engine,policy,fused", PARITY,
                         ids=[f"{n}-{e}-{p}-{'fused' if f else 'unfused'}" for n, e, p, f in PARITY])
def test_parity_engines_and_policies(torch_ref, models, n, policy, engine, fused):
    model = models[n]
    model.set_policy(Policy.parse(policy, engine=engine), fused)
    rows = conv_rows(model.describe(n))
    allowed = {"legacy", "graph", "ours"} if engine == "auto" else {engine}
    assert {r["layer"] for r in rows} == {"conv1", "conv2"} and all(r["engine"] in allowed for r in rows), rows
    assert fused or not any(r["fused"] for r in rows)
    check_one_step(torch_ref, model, n, what=f"n={n} {engine} {policy} {'fused' if fused else 'unfused'}")


def test_the_heuristic_takes_the_measured_engine_untimed(models):
    """Note [the heuristic's engine] (lenet/engines/registry.py): where this GPU's generation has measured rows (an
    H100's or H200's), the heuristic plans the stages and the head on our kernels with no other engine timed;
    exhaustive times cuDNN's stage and cuBLASLt's head beside them; elsewhere both time every engine."""
    from lenet.engines import registry
    from lenet.kernels import arch

    model = models[256]
    try:
        for spec in ("heuristic", "exhaustive"):
            model.set_policy(Policy.parse(spec, engine="auto"), True)
            rows = model.describe(256)
            stages, head = conv_rows(rows), next(r for r in rows if r["layer"] == "fc1+fc2")
            untimed = registry.measured_first("stage", model.policy, arch()) == "ours"
            for r in [*stages, head]:
                engines = {k.split(":")[0] for k in r["candidates_ms"]}
                assert r["engine"] == "ours" or not untimed, r
                assert (engines == {"ours"}) == untimed, (spec, r)
    finally:
        model.set_policy(Policy(), True)


def conv_rows(rows):
    from lenet.cli import conv_rows as f
    return f(rows)


def test_fusion_is_planned(models):
    # Where fusion is allowed, the stages fuse (our kernels, or cuDNN's conv + bias + ReLU where that is
    # fastest) and the head runs fused (cuBLASLt's epilogues or our kernels, whichever is faster); without
    # fusion nothing fuses and the fully connected layers use cuBLAS.
    model = models[64]
    model.set_policy(Policy.parse("exhaustive"), fused=True)
    rows = model.describe(64)
    assert any(r["fused"] for r in conv_rows(rows)), rows
    assert next(r for r in rows if r["layer"] == "fc1+fc2")["engine"] in ("cublaslt", "ours")
    model.set_fused(False)
    rows = model.describe(64)
    assert not any(r.get("fused") for r in rows) and next(r for r in rows if r["layer"] == "fc1+fc2")["engine"] == \
        "cublas"
    model.set_fused(True)


def _fixed_combinations(model, n, winograd=False, engine="legacy"):
    """Every (fwd, bwd-data, bwd-filter) name combination both layers support at batch n; with
    winograd=False none of them Winograd, with True each combination that has one."""
    from lenet.engines.cudnn import supported_names

    names = supported_names(model.planner, [s.spec for s in model.stages], n, engine)
    combos = list(itertools.product(*(names[d] for d in ("fwd", "bwd-data", "bwd-filter"))))
    return [c for c in combos if any(a.startswith("winograd") for a in c) == winograd]


@pytest.mark.parametrize("n", [1, 7, 64, 256])
def test_parity_every_fixed_combination(torch_ref, models, n):
    model = models[n]
    combos = _fixed_combinations(model, n)
    assert combos
    model.set_fused(True)   # each layer fused where that is fastest with that algorithm
    for fwd, bd, bf in combos:
        model.set_policy(Policy(fwd=fwd, bwd_data=bd, bwd_filter=bf, engine="legacy"))
        check_one_step(torch_ref, model, n, seed=len(fwd) + len(bd), what=f"n={n} {fwd}/{bd}/{bf}")
    print(f"n={n}: {len(combos)} combinations")


@pytest.mark.parametrize("n", [1, 64])
def test_parity_every_graph_plan(torch_ref, models, n):
    # Each exact graph plan both layers build (Note [exact candidates]), named as train_step prints
    # it, one direction at a time.
    model = models[n]
    table = (lambda spec, policy: BY_NAME["cudnn"].table(model.planner, spec, policy).table)
    specs = [s.spec for s in model.stages]
    tried = 0
    for d, field, epilogue in (("fwd", "fwd", "bias_relu"), ("bwd-data", "bwd_data", "drelu"),
                               ("bwd-filter", "bwd_filter", "")):
        chosen = [s for s in specs if d != "bwd-data" or s.dx]
        names = set.intersection(*({t.candidate.name for t in table(s.conv(d, n, epilogue),
                                                                     Policy.parse("exhaustive", engine="graph"))}
                                   for s in chosen))
        assert names, f"no exact graph plan common to both layers for {d}"
        for name in sorted(names):
            model.set_policy(Policy(engine="graph", **{field: name}))
            check_one_step(torch_ref, model, n, seed=tried, what=f"n={n} graph {d}={name}")
            tried += 1
    print(f"n={n}: {tried} graph plans")


@pytest.mark.parametrize("n", [1, 64])
def test_parity_winograd_combinations(torch_ref, models, n):
    model = models[n]
    combos = _fixed_combinations(model, n, winograd=True)
    assert combos, "cuDNN reports no Winograd algorithm for LeNet's shapes"
    for fwd, bd, bf in combos:
        model.set_policy(Policy(fwd=fwd, bwd_data=bd, bwd_filter=bf, engine="legacy"))
        check_one_step(torch_ref, model, n, seed=3, what=f"n={n} {fwd}/{bd}/{bf}", winograd=True)


def test_deterministic_policy(models):
    # With --deterministic and the heuristic, timing decides nothing: the first stage engine that runs
    # (ours), or under a cuDNN engine its first-ranked deterministic candidates.
    model = models[7]
    model.set_policy(Policy(deterministic=True), fused=True)
    pool_modes = (lambda: {r["algo"] for r in model.describe(7) if r["layer"].startswith("pool")})
    rows = conv_rows(model.describe(7))
    assert all(r["deterministic"] for r in rows) and all(r["engine"] == "ours" for r in rows), rows
    model.set_policy(Policy(deterministic=True, engine="legacy"))
    assert pool_modes() == {"max_deterministic"}
    rows = conv_rows(model.describe(7))
    assert all(r["deterministic"] for r in rows) and all(r["engine"] == "legacy" for r in rows), rows
    model.set_policy(Policy(deterministic=True, engine="graph"))
    assert all(r["deterministic"] for r in conv_rows(model.describe(7)))
    model.set_policy(Policy(engine="legacy"))
    assert pool_modes() == {"max"}
    model.set_policy(Policy())


def test_tf32_step_within_its_bound(torch_ref):
    # --allow-tf32: TF32 candidates may win; the step stays within TF32_RTOL of exact float32.
    from descriptors.exact import TF32_RTOL
    from lenet.model import LeNet
    model = LeNet(max_batch=256, seed=4, policy=Policy.parse("exhaustive", allow_tf32=True))
    check_one_step(torch_ref, model, 256, what="allow_tf32", rtol=TF32_RTOL)


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


@pytest.mark.parametrize("engine", ["legacy", "graph", "ours"])
@pytest.mark.parametrize("n", [45, 1000])   # 1000: the evaluation's own size in the fast recipe
def test_a_batch_size_only_evaluated_is_planned_forward_only(torch_ref, engine, n):
    """Note [forward-only plans] in lenet/ops.py: an evaluation's own batch size binds no backward (no gradient
    convolution searched, no backward kernel of ours), its totals are PyTorch's, a training step at that size
    is refused by the forward-only plan and planned whole when asked, and the evaluation then runs that."""
    from lenet.model import LeNet
    from torch_lenet import from_state
    torch = torch_ref
    model = LeNet(max_batch=n, seed=5, policy=Policy.parse("heuristic", engine=engine))
    try:
        step = model.plan_forward(n)
        assert step.forward_only and n not in model.plans.steps
        rows = model.plan_forward(n).describe()
        assert {r["engine"] for r in conv_rows(rows)} <= ({"legacy", "graph"} if engine != "ours" else {"ours"})
        assert not [r for r in rows if r["layer"] in ("conv1", "conv2") and "bwd" in r["op"]], rows
        m = from_state(model.state_dict())
        x, y = batch(n, 9)
        model.load_batch(x, y)
        model.evaluate_begin()
        model.evaluate_batch(n)
        loss, correct = model.evaluate_end()
        with torch.no_grad():
            lg = m(torch.as_tensor(x, device="cuda"))
        ty = torch.as_tensor(y, device="cuda").long()
        ref_loss = float(torch.nn.functional.cross_entropy(lg, ty, reduction="sum"))
        assert abs(loss - ref_loss) <= 1e-4 * ref_loss and correct == int((lg.argmax(1) == ty).sum())
        with pytest.raises(RuntimeError, match="planned forward only"):
            step.stages[0].backward()
        for what in (step.train, step.backward):
            with pytest.raises(RuntimeError, match="planned forward only"):
                what()
        model.runner._graphs["an evaluation's"] = None   # what a graph captured with the forward-only Step leaves
        whole = model.plan(n)
        assert not model.runner._graphs   # captured again with the whole Step
        assert not whole.forward_only and model.plan_forward(n) is whole
        assert [r for r in conv_rows(whole.describe()) if r["op"].startswith("bwd")]
        check_one_step(torch, model, n, what=f"{engine} at {n} after its forward-only plan")
    finally:
        model.close()


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
@pytest.mark.parametrize("where", ["host", "gpu"])
def test_bad_batches_refused_before_gpu_work(bad, msg, where):
    import cupy

    from lenet.model import LeNet
    model = LeNet(max_batch=8, seed=0)
    x, y = bad(*batch(8, 0))
    if where == "gpu":   # the same checks on device arrays (labels read on the host, a reduction of ours)
        x, y = cupy.asarray(x), cupy.asarray(y)
    before = model.state_dict()
    with pytest.raises(ValueError, match=msg):
        model.train_step(x, y, lr=0.1)
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
        assert {r["layer"] for r in facts["algorithms"]} == {"conv1", "conv2"} and facts["step_ms"] > 0
        assert facts["loss_after"] < facts["loss_before"]
    out = subprocess.run([sys.executable, "-m", "lenet.train_step", "--synthetic", "--algo", "fwd=fft",
                          "--batch-size", "8", "--workspace-limit", "0"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "supported here" in out.stderr, out.stderr


def test_chunks_with_a_remainder(torch_ref):
    # Every convolution and pooling in calls of 16 images: 16, 16 and a remainder of 8, each with its
    # own plan (Note [chunks]); the weight gradients sum per-chunk partials.
    from lenet.model import LeNet
    model = LeNet(max_batch=40, seed=6, policy=Policy(chunk=16))
    rows = model.describe(40)
    assert all(r["chunk"] == 16 and r["chunks"] == 3 for r in rows if r["layer"] in ("conv1", "conv2", "pool1", "pool2")
               and r["op"] != "bias-grad"), rows
    check_one_step(torch_ref, model, 40, seed=8, what="chunks of 16")


LARGE = [("graph", False, 8192), ("graph", True, None), ("auto", True, 8192), ("auto", False, None),
         ("ours", False, None)]


@pytest.mark.parametrize("engine,graph,chunk", LARGE, ids=[f"{e}-{'cuda-graph' if g else 'eager'}-{c or 'timed'}"
                                                          for e, g, c in LARGE])
def test_large_batch_with_a_remainder(torch_ref, engine, graph, chunk):
    # n = 20000: chunks of 8192 leave a remainder of 3616 (or whatever the timings choose).
    from lenet.model import LeNet
    n = 20000
    model = LeNet(max_batch=n, seed=11, cuda_graph=graph, policy=Policy(engine=engine, chunk=chunk))
    rows = conv_rows(model.describe(n))
    if chunk:
        assert all(r["chunk"] == 8192 and r["chunks"] == 3 for r in rows), rows
    check_one_step_graph(torch_ref, model, n, what=f"n={n} {engine} {'graph' if graph else 'eager'} chunk={chunk}")


@functools.lru_cache(maxsize=4)
def _conditioned(n, seed):
    from lenet.params import init_host
    from torch_lenet import well_conditioned_batch
    state = init_host(500 + seed)
    return (state, *well_conditioned_batch(state, n, seed))


def check_one_step_graph(torch, model, n, seed=0, what=""):
    """check_one_step through model.step (eager, or the captured CUDA graph)."""
    state, x, y = _conditioned(n, seed)
    model.load_state_dict(state)
    [(ref_logits, ref_loss, ref_grads)], ref_after = torch_step(torch, state, x, y, 0.1)
    model.load_batch(x, y)
    model.step(n, 0.1)
    loss, logits, grads, after = model.loss(), model.logits(), model.grad_dict(), model.state_dict()
    assert_close(logits, ref_logits, f"{what} logits")
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), f"{what} loss {loss} vs {ref_loss}"
    for k in ref_grads:
        assert_close(grads[k], ref_grads[k], f"{what} grad {k}")
        assert_close(after[k], ref_after[k], f"{what} {k} after SGD")


def test_recapture_after_the_workspace_grows(torch_ref):
    # Note [re-capture]: plan and capture batch a, then plan a larger b whose convolution needs a
    # larger workspace (the descriptor API's FFT grows with the batch), then step a again: its graph
    # must be captured anew, or it would read the freed workspace.
    from lenet.model import LeNet
    policy = Policy(bwd_data="fft", bwd_filter="fft", engine="legacy")
    model = LeNet(max_batch=4096, seed=12, cuda_graph=True, policy=policy)   # plans nothing yet
    a, b = 64, 4096
    check_one_step_graph(torch_ref, model, a, what="batch a, first capture")
    gen, size, captures = model.workspace.generation, model.workspace.size, model.runner.captures
    model.plan(b)
    assert model.workspace.size > size and model.workspace.generation > gen, "batch b did not grow the workspace"
    check_one_step_graph(torch_ref, model, a, seed=1, what="batch a after the workspace grew")
    assert model.runner.captures == captures + 1, "batch a's graph was not captured again"
    check_one_step_graph(torch_ref, model, b, seed=2, what="batch b")


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) { }
}
"""


def test_a_device_batch_still_being_made_on_the_models_stream_is_checked_once_made():
    """A CuPy batch whose labels the model's stream is still writing (behind a long kernel), handed over from
    CuPy's default stream: its check reads them once written (on the model's stream, after an event of the
    caller's), so the step trains on them, as on the same batch from NumPy. Checked on the caller's stream,
    the labels read were the ones before (99: out of range)."""
    import cupy

    from lenet.model import LeNet

    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((16, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 16).astype(np.int32)
    model, twin = (LeNet(max_batch=16, seed=1, policy=Policy(deterministic=True)) for _ in range(2))   # one rule's plans
    with model.stream:
        xd, yd = cupy.zeros(x.shape, cupy.float32), cupy.full(16, 99, cupy.int32)
    model.stream.synchronize()
    spin = cupy.RawKernel(_SPIN, "spin")
    rate = cupy.cuda.Device().attributes["ClockRate"] * 1000   # cycles a second
    with model.stream:
        spin((1,), (1,), (np.int64(rate // 5),))   # 0.2 s
        xd.set(x, stream=model.stream)
        yd.set(y, stream=model.stream)
    model.train_step(xd, yd, 0.05)   # from CuPy's default stream
    twin.train_step(x, y, 0.05)
    assert model.loss() == twin.loss()
    assert np.array_equal(model.state_dict()["conv1.weight"], twin.state_dict()["conv1.weight"])
    model.close()
    twin.close()
