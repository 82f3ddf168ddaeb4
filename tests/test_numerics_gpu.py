"""Every gradient of the step against a float64 recomputation in relative L2 norm, for every engine, at
batch 1, 64 and 8192: within 1e-5 on our kernels, and within 1e-5 or 1.5 x PyTorch's own float32
distance where cuDNN's convolutions may run (Note [step numerics] in scripts/numerics.py; the script
reports the max-elementwise distances and the decisions that differ beside them)."""

from __future__ import annotations

import numpy as np
import pytest

from descriptors import AlgoPolicy

pytestmark = pytest.mark.gpu

CASES = [(n, e, "heuristic") for n in (1, 64, 8192) for e in ("auto", "ours", "legacy", "graph")]
CASES += [(64, "auto", "exhaustive"), (8192, "auto", "exhaustive")]


@pytest.mark.parametrize("n,engine,algo", CASES, ids=[f"{n}-{e}-{a}" for n, e, a in CASES])
def test_every_gradient_near_float64(torch_ref, n, engine, algo):
    from numerics import bound, measure

    from lenet.model import LeNet
    from lenet.params import init_host

    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    model = LeNet(max_batch=n, policy=AlgoPolicy.parse(algo, engine=engine), seed=0)
    r = measure(model, init_host(n), x, y)
    over = {k: v for k, v in r["ours"].items() if not v[0] <= bound(engine, r["torch"][k][0])}
    assert not over, (f"n={n} {engine} {algo}: relative L2 over the bar: {over}; windows that differ "
                      f"{r['windows']}, ReLU decisions that differ {r['relu']}; PyTorch float32: {r['torch']}")
