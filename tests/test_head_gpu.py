"""Our head's two forwards against each other: head_split.cu's sums every product in head.cu's order
(Note [head split]), so at every slice size its logits, loss, dlogits, data gradients and weight
gradients are bit-identical to head.cu's; on random normal batches and on pictures (constant
backgrounds: pooled inputs of exactly 0, masked and tied), for a lone model, a pack, and the path where
the caller computes the loss (lenet.torch). head.cu's own outputs are held to float64 by
tests/test_numerics_gpu.py and to PyTorch by tests/test_model_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def pinned(monkeypatch, shape):
    """Our head offers only ``shape`` (the planner binds it as it would a searched one)."""
    from lenet.kernels import head

    monkeypatch.setattr(head, "shapes", lambda n, heuristic: [shape])


def run(monkeypatch, shape, x, y, models=1):
    from lenet.engines import Policy
    from lenet.model import LeNet

    pinned(monkeypatch, shape)
    n = x.shape[-4]
    model = LeNet(max_batch=n, models=models, policy=Policy(engine="ours"), seed=3,
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
    one = run(monkeypatch, HeadShape(False, min(group, 8), 256), x, y)
    split = run(monkeypatch, HeadShape(True, group, 256), x, y)
    if group > 8:
        a, b = float(split.pop("loss")), float(one.pop("loss"))
        assert abs(a - b) <= 1e-6 * abs(b), f"n={n} split g{group} {kind}: loss {a} against {b}"
    assert_identical(split, one, f"n={n} split g{group} {kind}")


def test_a_packs_split_head_is_its_lone_runs(monkeypatch):
    """The pack version (head_split__pack): each model's outputs bit-identical to head.cu's pack version."""
    from lenet.kernels.head import HeadShape

    x, y = data(64, "pictures", models=3)
    one = run(monkeypatch, HeadShape(False, 8, 256), x, y, models=3)
    split = run(monkeypatch, HeadShape(True, 8, 256), x, y, models=3)
    assert_identical(split, one, "pack of 3 at 64, split g8")


def test_the_split_head_under_a_loss_of_the_callers(monkeypatch, torch_ref):
    """lenet.torch's path: dlogits written by PyTorch's loss, then backward_given (the split forward run
    again, then its data gradients): the loss and the weights' gradients are head.cu's."""
    import torch

    from lenet.kernels.head import HeadShape
    from lenet.torch import LeNet

    x, y = data(33, "pictures")
    got = {}
    for shape in (HeadShape(False, 4, 256), HeadShape(True, 4, 256)):
        pinned(monkeypatch, shape)
        net = LeNet(engine="ours", plan_cache=False).cuda()
        tx = torch.as_tensor(x, device="cuda")
        loss = torch.nn.functional.cross_entropy(net(tx), torch.as_tensor(y, device="cuda").long())
        loss.backward()
        got[shape.split] = {"loss": loss.detach().cpu().numpy(),
                            **{k: p.grad.cpu().numpy() for k, p in net.named_parameters()}}
    assert_identical(got[True], got[False], "lenet.torch, split g4 at 33")
