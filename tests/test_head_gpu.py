"""Our head's forms against each other: head_split.cu's sums every product in head.cu's order
(Note [head split]), so at every slice size its logits, loss, dlogits, data gradients and weight
gradients are bit-identical to head.cu's; on random normal batches and on pictures (constant
backgrounds: pooled inputs of exactly 0, masked and tied), for a lone model, a pack, and the path where
the caller computes the loss (lenet.torch). The tail form (cuBLASLt's fc1 products and head_tail.cu:
Note [head tail]) sums in other orders: it is held to float64 at its own decisions, and to head.cu's
within float32's rounding. head.cu's own outputs are held to float64 by tests/test_numerics_gpu.py and
to PyTorch by tests/test_model_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def pinned(monkeypatch, shape):
    """Our head offers only ``shape`` (the planner binds it as it would a searched one)."""
    from lenet.kernels import head

    monkeypatch.setattr(head, "shapes", lambda n, heuristic, models=1: [shape])


def run(monkeypatch, shape, x, y, models=1, deterministic=False):
    from lenet.engines import Policy
    from lenet.model import LeNet

    pinned(monkeypatch, shape)
    n = x.shape[-4]
    policy = Policy.parse("exhaustive" if deterministic else "heuristic", engine="ours", deterministic=deterministic)
    model = LeNet(max_batch=n, models=models, policy=policy, seed=3,
                  label_smoothing=[0.1, 0.0, 0.05][:models] if models > 1 else 0.1)
    rows = [r for r in model.describe(n) if r.get("layer") == "fc1+fc2"]
    assert rows and rows[0]["algo"] == shape.name, rows
    model.load_batch(x, y)
    model.forward(n)
    model.backward(n)
    out = {"loss": np.asarray(model.loss(), np.float32)}
    for m in range(models):
        out.update({f"{m}:{k}": v for k, v in model.grad_dict(m if models > 1 else None).items()})
    if models == 1:
        out["logits"] = model.logits()
    model.close()
    return out


def data(n, kind, models=1, seed=0):
    from lenet.engines.reference import pictures

    rng = np.random.default_rng(seed)
    lead = (models, n) if models > 1 else (n,)
    if kind == "pictures":
        x = pictures(rng, models * n, (1, 28, 28)).reshape(*lead, 1, 28, 28)
    else:
        x = rng.standard_normal((*lead, 1, 28, 28)).astype(np.float32)
    return x, rng.integers(0, 10, lead).astype(np.int32)


def assert_identical(a: dict, b: dict, what: str):
    for k in a:
        assert np.array_equal(a[k], b[k], equal_nan=True), \
            f"{what}: {k} differs (max |diff| {np.max(np.abs(a[k].astype(np.float64) - b[k])):.3e})"


CASES = [(n, g, kind) for n, g in ((1, 1), (7, 2), (64, 8), (100, 16), (256, 16), (64, 1)) for kind in ("normal", "pictures")]


@pytest.mark.parametrize("n,group,kind", CASES, ids=[f"{n}-g{g}-{k}" for n, g, k in CASES])
def test_the_split_head_is_head_cu_bit_for_bit(monkeypatch, n, group, kind):
    """Against head.cu's at the same group (8 for a slice of 16, its largest): every output bit-identical,
    the loss too where the groups are the same (summed a group at a time, then the groups in order)."""
    from lenet.kernels.head import HeadShape

    x, y = data(n, kind)
    one = run(monkeypatch, HeadShape("block", min(group, 8), 256), x, y)
    split = run(monkeypatch, HeadShape("split", group, 256), x, y)
    if group > 8:
        a, b = float(split.pop("loss")), float(one.pop("loss"))
        assert abs(a - b) <= 1e-6 * abs(b), f"n={n} split g{group} {kind}: loss {a} against {b}"
    assert_identical(split, one, f"n={n} split g{group} {kind}")


def test_a_packs_split_head_is_its_lone_runs(monkeypatch):
    """The pack version (head_split__pack): each model's outputs bit-identical to head.cu's pack version."""
    from lenet.kernels.head import HeadShape

    x, y = data(64, "pictures", models=3)
    one = run(monkeypatch, HeadShape("block", 8, 256), x, y, models=3)
    split = run(monkeypatch, HeadShape("split", 8, 256), x, y, models=3)
    assert_identical(split, one, "pack of 3 at 64, split g8")


def test_the_split_head_under_a_loss_of_the_callers(monkeypatch, torch_ref):
    """lenet.torch's path: dlogits written by PyTorch's loss, then backward_given (the split forward run
    again, then its data gradients): the loss and the weights' gradients are head.cu's."""
    from lenet.kernels.head import HeadShape

    x, y = data(33, "pictures")
    got = {s.form: through_torch(monkeypatch, s, x, y) for s in (HeadShape("block", 4, 256), HeadShape("split", 4, 256))}
    assert_identical(got["split"], got["block"], "lenet.torch, split g4 at 33")


def through_torch(monkeypatch, shape, x, y) -> dict:
    """lenet.torch's LeNet with our head pinned to ``shape``: PyTorch's cross-entropy loss of the batch
    and the parameters' gradients after its backward."""
    import torch

    from lenet.torch import LeNet

    pinned(monkeypatch, shape)
    net = LeNet(engine="ours", plan_cache=False).cuda()
    loss = torch.nn.functional.cross_entropy(net(torch.as_tensor(x, device="cuda")),
                                             torch.as_tensor(y, device="cuda").long())
    loss.backward()
    return {"loss": loss.detach().cpu().numpy(), **{k: p.grad.cpu().numpy() for k, p in net.named_parameters()}}


TAILS = [(n, kind) for n in (1, 7, 1000, 4099) for kind in ("normal", "pictures")]


@pytest.mark.parametrize("n,kind", TAILS, ids=[f"{n}-{k}" for n, k in TAILS])
def test_the_tail_head_is_float64_at_its_decisions(monkeypatch, torch_ref, n, kind):
    """The whole step with the head in the tail form (one block writing the gradients itself at 1 and 7
    images, 125 and 264 blocks' rows added by stage_reduce at 1000 and 4099) against a float64
    recomputation: every gradient within 1e-5 in relative L2 at the step's own decisions (random
    normals), or, on pictures, each decision that differs from float64's within 1e-6 of its layer's scale
    of a tie and the agreeing images within 1e-5 (Note [judging per decision] in tests/numerics.py)."""
    from lenet.engines import Policy
    from lenet.kernels.head import HeadShape
    from lenet.model import LeNet

    shape = HeadShape("tail", 2, 0)
    pinned(monkeypatch, shape)
    model = LeNet(max_batch=n, policy=Policy(engine="ours"), seed=0)
    assert [r["algo"] for r in model.describe(n) if r.get("layer") == "fc1+fc2"] == [shape.name]
    assert model.plan(n).stages[-1].masks_dy and not model.plan(n).head.masks_dx   # Note [the ReLU bit]
    against_float64(model, n, kind)


def against_float64(model, n: int, kind: str):
    from numerics import MARGIN, RTOL_L2, judge, measure

    from lenet.params import init_host

    x, y = data(n, kind, seed=n)
    if kind == "normal":
        r = measure(model, init_host(n), x, y)
        over = {k: v for k, v in r["same"].items() if not v[0] <= RTOL_L2}
        assert not over, f"tail at {n}: relative L2 over {RTOL_L2:g} at the same decisions: {over}"
    else:
        r = judge(model, init_host(n), x, y)
        assert r["kept"] >= n // 2, r
        assert r["worst_margin"] <= MARGIN, f"tail at {n}: {r['worst_margin']:.1e} from a tie: {r['decisions'][:5]}"
        over = {k: v for k, v in r["agree"].items() if not v[0] <= 1e-5}
        assert not over, f"tail at {n}: the agreeing images' gradients are off: {over}"
    model.close()


@pytest.mark.parametrize("kind", ["normal", "pictures"])
def test_the_tail_head_masks_dp2_above_cudnns_stages(monkeypatch, torch_ref, kind):
    """Our stages mask dp2 by the argmax bytes' ReLU bits (Note [the ReLU bit] in stage_common.cu), so
    above them the tail leaves it unmasked; cuDNN's pooling backward does not, so above cuDNN's stages
    the tail masks it (head_mask_kernel): that step against float64 as above, at 1000 images."""
    from lenet.engines import BY_NAME, Policy
    from lenet.kernels.head import HeadShape
    from lenet.model import LeNet

    ours, lt = type(BY_NAME["ours"]), type(BY_NAME["cublaslt"])
    refuses = ours.refuses
    monkeypatch.setattr(ours, "refuses", lambda self, op, policy: "this test's stages are cuDNN's"
                        if op.kind == "stage" else refuses(self, op, policy))
    monkeypatch.setattr(lt, "refuses", lambda self, op, policy: "this test's head is ours")
    shape = HeadShape("tail", 2, 0)
    pinned(monkeypatch, shape)
    n = 1000
    model = LeNet(max_batch=n, policy=Policy(engine="auto"), seed=0)
    rows = model.describe(n)
    assert "ours" not in {r["engine"] for r in rows if r.get("layer") in ("conv1", "conv2")}, rows
    assert [r["algo"] for r in rows if r.get("layer") == "fc1+fc2"] == [shape.name]
    step = model.plan(n)
    assert not step.stages[-1].masks_dy and step.head.masks_dx
    against_float64(model, n, kind)


def assert_close(a: dict, b: dict, what: str, rtol: float = 1e-5):
    for k in a:
        x, y = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
        d = np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)
        assert d <= rtol, f"{what}: {k} {d:.2e} from head.cu's in relative L2"


def test_a_packs_tail_head_is_head_cus_within_rounding(monkeypatch):
    """The tail's pack version (head_tail__pack, cuBLASLt's batched products) against head.cu's pack
    version: every model's loss, gradients and logits within 1e-5 in relative L2; and a pack that sums
    as its lone runs (--deterministic: each model's products alone; a search, as only a search takes the
    tail for such a pack) the same again."""
    from lenet.kernels.head import HeadShape

    x, y = data(600, "pictures", models=3)
    block = run(monkeypatch, HeadShape("block", 8, 256), x, y, models=3)
    tail = run(monkeypatch, HeadShape("tail", 2, 0), x, y, models=3)
    assert_close(tail, block, "pack of 3 at 600, tail")
    lone = run(monkeypatch, HeadShape("tail", 2, 0), x, y, models=3, deterministic=True)
    assert_close(lone, block, "pack of 3 at 600, tail, each model's products alone")


def test_the_tail_head_under_a_loss_of_the_callers(monkeypatch, torch_ref):
    """lenet.torch's path through the tail: dlogits written by PyTorch's loss, then backward_given (fc1
    again, the tail reading dlogits): the loss and the weights' gradients are head.cu's within 1e-5."""
    from lenet.kernels.head import HeadShape

    x, y = data(700, "normal")
    got = {s.form: through_torch(monkeypatch, s, x, y) for s in (HeadShape("block", 4, 256), HeadShape("tail", 1, 0))}
    assert_close(got["tail"], got["block"], "lenet.torch, tail g1 at 700")


def test_the_tails_cublaslt_choices_are_stored_and_recalled(monkeypatch, tmp_path):
    """The tail's cuBLASLt algorithms and dW1's slices are a decision of the planner's (Ours._tail_picks):
    a second model on the same plan cache binds the tail with the stored ones and times none, and its
    step is the first's bit for bit (the same algorithms, the same slices)."""
    from lenet.blas import LtMatmul
    from lenet.engines import Policy
    from lenet.kernels.head import HeadShape
    from lenet.model import LeNet

    pinned(monkeypatch, HeadShape("tail", 2, 0))
    x, y = data(1000, "pictures")
    path = tmp_path / "plans.json"
    grads = []
    for second in (False, True):
        if second:
            def untimed(self, time):
                raise AssertionError("a stored choice of the tail's algorithms was timed again")
            monkeypatch.setattr(LtMatmul, "tune", untimed)
        model = LeNet(max_batch=1000, seed=0, plan_cache=path, policy=Policy(engine="ours"))
        model.load_batch(x, y)
        model.forward(1000)
        model.backward(1000)
        grads.append(model.grad_dict())
        model.close()
    assert_identical(grads[1], grads[0], "the tail recalled")
