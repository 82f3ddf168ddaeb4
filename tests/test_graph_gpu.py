"""The graph-API engine on the GPU: every plan cuDNN builds for LeNet's convolutions against
PyTorch (see Note [tolerance]), fused and unfused, at batch 1 and 64; chunked directions through
the search; TF32 within its stated bound; errors that explain themselves."""

from __future__ import annotations

import numpy as np
import pytest

import descriptors as D
from conftest import assert_close
from descriptors.graph import ConvGraph
from descriptors.exact import EXACT_RTOL, TF32_RTOL

pytestmark = pytest.mark.gpu

LAYERS = {"conv1": ((1, 28, 28), (6, 1, 5, 5)), "conv2": ((6, 12, 12), (16, 6, 5, 5))}
# (direction, fuse) variants of each layer that LeNet runs.
VARIANTS = [("fwd", ""), ("fwd", "bias_relu"), ("bwd-data", ""), ("bwd-data", "drelu"), ("bwd-filter", "")]


def _inputs(g, seed=0):
    import cupy
    rng = cupy.random.default_rng(seed)
    a = {r: rng.standard_normal(g.shapes[r], dtype=cupy.float32) for r in g.roles}
    cupy.cuda.Device().synchronize()
    return a


def _reference(torch, g, a):
    """What the graph computes, by PyTorch in float64."""
    F = torch.nn.functional
    t = {k: torch.as_tensor(v.get(), dtype=torch.float64) for k, v in a.items()}
    kw = dict(padding=g.pad, stride=g.stride, dilation=g.dilation)
    if g.direction == "fwd":
        y = F.conv2d(t["x"], t["w"], **kw)
        return torch.relu(y + t["b"]) if g.fuse else y
    if g.direction == "bwd-data":
        dx = torch.nn.grad.conv2d_input(g.x_shape, t["w"], t["dy"], **kw)
        return dx * (t["act"] > 0) if g.fuse else dx
    return torch.nn.grad.conv2d_weight(t["x"], g.w_shape, t["dy"], **kw)


# LeNet never computes conv1's input gradient.
CASES = [(layer, d, f) for layer in LAYERS for d, f in VARIANTS if not (layer == "conv1" and d == "bwd-data")]


@pytest.mark.parametrize("n", [1, 64])
@pytest.mark.parametrize("layer,direction,fuse", CASES, ids=[f"{c[0]}-{c[1]}{'+' + c[2] if c[2] else ''}"
                                                            for c in CASES])
def test_every_exact_plan_against_torch(handle, torch_ref, n, layer, direction, fuse):
    xs, ws = LAYERS[layer]
    g = ConvGraph(handle, direction, (n, *xs), ws, fuse=fuse)
    if fuse == "drelu" and not g.plans:
        # Measured on an H100: NCHW float32 has no engine for dgrad + ReLU backward. Then cuDNN
        # must say why, and the search composes the unfused plan with cuDNN's activation backward.
        assert g.rejected and "(every plan)" in g.rejected, g.rejected
        return
    assert g.plans, f"no plan built for {g}: {g.rejected}"
    a = _inputs(g)
    ref = _reference(torch_ref, g, a).numpy()
    out = a[g.roles[-1]]
    ws_ = D.Workspace(max(p.workspace_bytes for p in g.plans))
    errors = {}
    for p in g.plans:
        out.fill(np.nan)
        g.run(p, g.pack(a), ws_, handle)
        handle.stream.synchronize()
        errors[p.name] = np.linalg.norm(out.get() - ref) / np.linalg.norm(ref)
    exact = {k: e for k, e in errors.items() if e <= EXACT_RTOL}
    # Note [exact candidates]: a plan may be less exact than its notes say; the search drops it.
    # Every other plan computes the same function to float32 rounding.
    assert exact, errors
    assert all(e < 1e-2 for e in errors.values()), f"a plan computes something else: {errors}"
    print(f"{g}: {len(exact)}/{len(errors)} plans within {EXACT_RTOL:.0e}: "
          + ", ".join(f"{k} {e:.1e}" for k, e in errors.items()))


def test_tf32_plans_within_their_bound(handle, torch_ref):
    # With allow_tf32 the TF32 plans compete; each must stay within TF32_RTOL of float64 (measured
    # 2e-4..3e-3 on an H100). The same plans are refused without allow_tf32.
    exact = ConvGraph(handle, "fwd", (64, 6, 12, 12), (16, 6, 5, 5))
    g = ConvGraph(handle, "fwd", (64, 6, 12, 12), (16, 6, 5, 5), allow_tf32=True)
    assert len(g.plans) > len(exact.plans), "expected TF32 plans beyond the exact ones"
    a = _inputs(g, 3)
    ref = _reference(torch_ref, g, a).numpy()
    ws = D.Workspace(max(p.workspace_bytes for p in g.plans))
    worst = 0.0
    for p in g.plans:
        g.run(p, g.pack(a), ws, handle)
        handle.stream.synchronize()
        worst = max(worst, np.linalg.norm(a["y"].get() - ref) / np.linalg.norm(ref))
    assert worst <= TF32_RTOL, worst
    print(f"worst TF32 plan: {worst:.1e}")


@pytest.mark.parametrize("direction,epilogue", [("fwd", "bias_relu"), ("bwd-data", "drelu"), ("bwd-filter", "")])
@pytest.mark.parametrize("engine", ["graph", "auto"])
def test_chunked_direction_against_torch(handle, torch_ref, direction, epilogue, engine):
    # A batch of 2500 in chunks of 1024, 1024 and a remainder of 452, each with its own plan;
    # a chunked weight gradient sums per-chunk partials (Note [chunked weight gradient]).
    from conftest import make_planner
    from lenet.engines import BY_NAME, Policy
    from lenet.engines.cudnn import BoundConv
    spec = D.ConvSpec(direction, 2500, *LAYERS["conv2"], epilogue=epilogue)
    planner, cudnn = make_planner(handle, Policy(engine=engine, chunk=1024), 2500), BY_NAME["cudnn"]
    choice = cudnn.conv_choice(planner, spec)
    assert [(s, k) for s, k, _ in choice.calls()] == [(0, 1024), (1024, 1024), (2048, 452)]
    g = ConvGraph(None, direction, spec.x_shape, spec.w, fuse=epilogue)   # shapes and roles, no plans
    a = _inputs(g, 5)
    run = BoundConv(cudnn, planner, choice, a)
    planner.ctx.workspace.reserve(run.workspace_bytes)
    a[spec.output].fill(np.nan)
    run()
    handle.stream.synchronize()
    ref = _reference(torch_ref, g, a).numpy()
    assert_close(a[spec.output].get(), ref, f"{spec} in chunks ({choice.full.candidate.label})")


def test_graph_errors_name_the_problem(handle):
    g = ConvGraph(handle, "fwd", (4, 1, 28, 28), (6, 1, 5, 5))
    a = _inputs(g)
    with pytest.raises(ValueError, match=r"x has shape \(2, 1, 28, 28\), the descriptor wants \(4, 1, 28, 28\)"):
        g.pack({**a, "x": a["x"][:2]})
    with pytest.raises(ValueError, match="missing w"):
        g.pack({"x": a["x"], "y": a["y"]})
    with pytest.raises(ValueError, match="y must be a CuPy array"):
        g.pack({**a, "y": a["y"].get()})
    big = [p for p in g.plans if p.workspace_bytes > 0]
    if big:
        with pytest.raises(ValueError, match="needs a workspace of"):
            g.run(big[0], g.pack(a), D.Workspace(1), handle)
    with pytest.raises(ValueError, match="x has 2 channels, w expects 1"):
        ConvGraph(handle, "fwd", (4, 2, 28, 28), (6, 1, 5, 5))
    pack = g.pack(a)
    g.close()
    with pytest.raises(ValueError, match="closed"):
        g.run(g.plans[0], pack, D.Workspace(1 << 20), handle)


@pytest.mark.parametrize("direction,epilogue", [("fwd", "bias_relu"), ("bwd-data", "drelu"), ("bwd-filter", "")])
def test_the_heuristic_builds_each_graphs_first_plan_only(handle, direction, epilogue):
    """Note [the heuristic's one plan]: with ``first`` a graph builds cuDNN's listed plans in order until one
    builds: each graph's candidate is then the first of the candidates the whole graph lists, fused first, and
    binding it (by name, as the search does) finds that graph instead of building a second."""
    from descriptors.algorithms import AlgoPolicy
    from descriptors.candidates import ConvSpec, GraphConvs

    spec = ConvSpec(direction, 64, (6, 12, 12), (16, 6, 5, 5), epilogue=epilogue)
    policy = AlgoPolicy()
    whole_src, first_src = GraphConvs("graph"), GraphConvs("graph")
    try:
        whole, _ = whole_src.candidates(handle, spec, policy, True)
        first, _ = first_src.candidates(handle, spec, policy, True, first=True)
        forms = (True, False) if epilogue else (False,)
        expected = [next(c for c in whole if c.fused == f) for f in forms if any(c.fused == f for c in whole)]
        assert first == expected and len(whole) > len(first), (first, len(whole))
        filters = GraphConvs.filters(policy)
        for c in first:
            fuse = epilogue if c.fused else ""
            g = first_src.graph(handle, spec, fuse, filters, first=True)
            assert [p.name for p in g.plans] == [c.name]
            assert first_src.graph(handle, spec, fuse, filters, only=c.name) is g
            assert first_src.offers(handle, spec, c, policy)
    finally:
        whole_src.close()
        first_src.close()
