"""Every gradient of the step within 1e-5 in relative L2 norm of a float64 recomputation at the step's
own pooling and ReLU decisions, for every engine, at batch 1, 64 and 8192, and for ours at 65536, where
a block of stage 2's backward sums 165 images (Note [an image's own sums] in
lenet/kernels/stage2_backward_roles.cu) (Note [step numerics] in tests/numerics.py; the script also
reports the distance from float64's own decisions and the decisions that differ)."""

from __future__ import annotations

import numpy as np
import pytest

from lenet.engines import Policy

pytestmark = pytest.mark.gpu

CASES = [(n, e, "heuristic") for n in (1, 64, 8192) for e in ("auto", "ours", "legacy", "graph")]
CASES += [(64, "auto", "exhaustive"), (8192, "auto", "exhaustive"), (65536, "ours", "heuristic")]


@pytest.mark.parametrize("n,engine,algo", CASES, ids=[f"{n}-{e}-{a}" for n, e, a in CASES])
def test_every_gradient_within_1e_5_of_float64(torch_ref, n, engine, algo):
    from numerics import RTOL_L2, measure

    from lenet.model import LeNet
    from lenet.params import init_host

    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    model = LeNet(max_batch=n, policy=Policy.parse(algo, engine=engine), seed=0)
    r = measure(model, init_host(n), x, y)
    over = {k: v for k, v in r["same"].items() if not v[0] <= RTOL_L2}
    assert not over, (f"n={n} {engine} {algo}: relative L2 over {RTOL_L2:g} at the same decisions: {over}; "
                      f"from float64's own: {r['ours']}; windows that differ "
                      f"{r['windows']}, ReLU decisions that differ {r['relu']}; PyTorch float32: {r['torch']}")


REAL = [(n, e) for n in (64, 1000) for e in ("ours", "legacy", "graph")]


@pytest.mark.parametrize("n,engine", REAL, ids=[f"{n}-{e}" for n, e in REAL])
def test_pictures_are_judged_per_decision(torch_ref, n, engine):
    """What real data has (Note [real-data operands] in lenet/engines/reference.py): quantized pictures on a
    constant background, every window of it an exact tie and every pooled output over it the same. Each
    decision our step takes otherwise than float64 must be within 1e-6 of its layer's scale of a tie (a
    wider one is a wrong argmax or mask), and the images whose decisions all agree within 1e-5 of float64
    on every gradient (Note [judging per decision] in tests/numerics.py; the script reports them against
    1e-6)."""
    from numerics import MARGIN, judge

    from lenet.engines.reference import pictures
    from lenet.model import LeNet
    from lenet.params import init_host

    rng = np.random.default_rng(n)
    x = pictures(rng, n, (1, 28, 28))
    y = rng.integers(0, 10, n).astype(np.int32)
    model = LeNet(max_batch=n, policy=Policy(engine=engine), seed=0)
    r = judge(model, init_host(n), x, y)
    assert r["kept"] >= n // 2, r
    assert r["worst_margin"] <= MARGIN, f"{engine}: a decision {r['worst_margin']:.1e} of its scale from a tie: {r['decisions'][:5]}"
    over = {k: v for k, v in r["agree"].items() if not v[0] <= 1e-5}
    assert not over, f"{engine}: the agreeing images' gradients are off: {over}"
