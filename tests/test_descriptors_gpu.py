"""descriptors/ on the GPU: every op against torch.nn.functional / autograd (see Note [tolerance])."""

from __future__ import annotations

import numpy as np
import pytest

import descriptors as D
from descriptors.algorithms import ALGORITHM_NAMES, CALLS, Direction, _max_count
from lenet.engines import Policy
from conftest import WINOGRAD_RTOL, assert_close

pytestmark = pytest.mark.gpu

# (name, x shape without N, w shape, pad, stride, dilation): LeNet's two layers, a padded and
# strided case, and a dilated one.
CASES = [
    ("conv1", (1, 28, 28), (6, 1, 5, 5), 0, 1, 1),
    ("conv2", (6, 12, 12), (16, 6, 5, 5), 0, 1, 1),
    ("pad1-stride2", (3, 17, 17), (8, 3, 3, 3), 1, 2, 1),
    ("pad2-dil2", (4, 15, 13), (5, 4, 3, 3), 2, 1, 2),
]


def _t(torch, a):
    return torch.as_tensor(a.get(), device="cuda")


def _setup(n, case, seed=0):
    import cupy

    _, xs, ws, pad, stride, dil = case
    rng = cupy.random.default_rng(seed)
    conv = D.ConvolutionDescriptor(pad=pad, stride=stride, dilation=dil)
    xd, wd = D.TensorDescriptor((n, *xs)), D.FilterDescriptor(ws)
    yd = D.TensorDescriptor(conv.output_shape(xd, wd))
    x = rng.standard_normal(xd.shape, dtype=cupy.float32)
    w = rng.standard_normal(wd.shape, dtype=cupy.float32)
    dy = rng.standard_normal(yd.shape, dtype=cupy.float32)
    return conv, xd, wd, yd, x, w, dy


def test_handle(handle):
    assert handle.device_id >= 0 and handle.gpu_name and "stream=" in repr(handle)


def test_every_algorithm_cudnn_returns_is_named(handle):
    # cuDNN's MaxCount is not the enum size (9.19 says 10 for 8 forward algorithms: it lists
    # some twice, per math type); what matters is that every id it hands back has a name.
    from ctypes import byref, c_int
    from descriptors._lib import AlgoPerf, call
    conv, xd, wd, yd, *_ = _setup(64, CASES[1])
    operands = {Direction.FORWARD: (xd, wd, yd), Direction.BACKWARD_DATA: (wd, yd, xd),
                Direction.BACKWARD_FILTER: (xd, yd, wd)}
    for d, calls in CALLS.items():
        n = _max_count(handle, calls)
        assert n >= len(ALGORITHM_NAMES[d]), d
        perfs, got = (AlgoPerf * n)(), c_int()
        a, b, o = operands[d]
        call(calls.get, handle.ptr, a.ptr, b.ptr, conv.ptr, o.ptr, n, byref(got), perfs)
        ids = {p.algo for p in perfs[: got.value]}
        assert ids and ids <= set(ALGORITHM_NAMES[d].values()), (d, ids)


@pytest.mark.parametrize("n", [1, 64])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_convolution_every_supported_algorithm(handle, torch_ref, n, case):
    import cupy
    torch = torch_ref
    F = torch.nn.functional
    conv, xd, wd, yd, x, w, dy = _setup(n, case)
    _, _, _, pad, stride, dil = case
    tx, tw, tdy = _t(torch, x), _t(torch, w), _t(torch, dy)
    ref_y = F.conv2d(tx, tw, padding=pad, stride=stride, dilation=dil).cpu().numpy()
    ref_dx = torch.nn.grad.conv2d_input(tx.shape, tw, tdy, padding=pad, stride=stride, dilation=dil).cpu().numpy()
    ref_dw = torch.nn.grad.conv2d_weight(tx, tw.shape, tdy, padding=pad, stride=stride, dilation=dil).cpu().numpy()
    ws = D.Workspace()
    tried = {}
    with handle.stream:
        y, dx, dw = cupy.empty(yd.shape, cupy.float32), cupy.empty(xd.shape, cupy.float32), \
            cupy.empty(wd.shape, cupy.float32)
    refs64 = {}
    t64 = [a.double() for a in (tx, tw, tdy)]
    refs64[Direction.FORWARD] = F.conv2d(t64[0], t64[1], padding=pad, stride=stride, dilation=dil).cpu().numpy()
    refs64[Direction.BACKWARD_DATA] = torch.nn.grad.conv2d_input(
        tx.shape, t64[1], t64[2], padding=pad, stride=stride, dilation=dil).cpu().numpy()
    refs64[Direction.BACKWARD_FILTER] = torch.nn.grad.conv2d_weight(
        t64[0], tw.shape, t64[2], padding=pad, stride=stride, dilation=dil).cpu().numpy()
    for direction, descs, run, out, ref in [
        (Direction.FORWARD, (xd, wd, yd), lambda r: conv.forward(handle, xd, x, wd, w, yd, y, r, ws), y, ref_y),
        (Direction.BACKWARD_DATA, (wd, yd, xd),
         lambda r: conv.backward_data(handle, wd, w, yd, dy, xd, dx, r, ws), dx, ref_dx),
        (Direction.BACKWARD_FILTER, (xd, yd, wd),
         lambda r: conv.backward_filter(handle, xd, x, yd, dy, wd, dw, r, ws), dw, ref_dw),
    ]:
        algos = D.supported_algorithms(handle, direction, conv, *descs)
        assert algos, f"cuDNN reports no {direction} algorithm"
        tried[str(direction)] = [a.name for a in algos]
        for r in algos:
            ws.reserve(r.workspace_bytes)
            with handle.stream:
                out.fill(np.nan)   # poison: every element must be written
            run(r)
            handle.stream.synchronize()
            tol = WINOGRAD_RTOL if r.name.startswith("winograd") else 1e-4
            assert_close(out.get(), ref, f"{case[0]} n={n} {direction} {r.name} vs PyTorch", tol)
            assert_close(out.get(), refs64[direction], f"{case[0]} n={n} {direction} {r.name} vs float64", tol)
    print(tried)


@pytest.mark.parametrize("n", [1, 64])
def test_add_tensor(handle, torch_ref, n):
    import cupy
    torch = torch_ref
    rng = cupy.random.default_rng(1)
    dyd, bd = D.TensorDescriptor((n, 6, 24, 24)), D.TensorDescriptor((1, 6, 1, 1))
    with handle.stream:
        dy = rng.standard_normal(dyd.shape, dtype=cupy.float32)
        b = rng.standard_normal(bd.shape, dtype=cupy.float32)
        y = dy.copy()
    D.add_tensor(handle, bd, b, dyd, y)
    handle.stream.synchronize()
    assert_close(y.get(), (_t(torch, dy) + _t(torch, b)).cpu().numpy(), "add tensor")


POOLS = [("max", 2, 0, 2), ("max_deterministic", 2, 0, 2), ("max", 3, 1, 2), ("average", 2, 0, 2),
         ("average", 3, 1, 2), ("average_exclude_padding", 3, 1, 1)]


@pytest.mark.parametrize("n", [1, 64])
@pytest.mark.parametrize("mode,win,pad,stride", POOLS)
def test_pooling(handle, torch_ref, n, mode, win, pad, stride):
    import cupy
    torch = torch_ref
    F = torch.nn.functional
    p = D.PoolingDescriptor(mode, window=win, pad=pad, stride=stride)
    xd = D.TensorDescriptor((n, 6, 24, 24))
    yd = D.TensorDescriptor(p.output_shape(xd))
    rng = cupy.random.default_rng(2)
    with handle.stream:
        x = rng.standard_normal(xd.shape, dtype=cupy.float32)
        dy = rng.standard_normal(yd.shape, dtype=cupy.float32)
        y = cupy.full(yd.shape, np.nan, cupy.float32)
        dx = cupy.full(xd.shape, np.nan, cupy.float32)
    p.forward(handle, xd, x, yd, y)
    p.backward(handle, yd, y, yd, dy, xd, x, xd, dx)
    handle.stream.synchronize()
    tx = _t(torch, x).requires_grad_()
    if mode.startswith("max"):
        ty = F.max_pool2d(tx, win, stride, pad)
    else:
        ty = F.avg_pool2d(tx, win, stride, pad, count_include_pad=(mode == "average"))
    ty.backward(_t(torch, dy))
    assert_close(y.get(), ty.detach().cpu().numpy(), f"pool {mode} forward")
    assert_close(dx.get(), tx.grad.cpu().numpy(), f"pool {mode} backward")


ACTS = [("relu", 0.0), ("sigmoid", 0.0), ("tanh", 0.0), ("clipped_relu", 0.5), ("elu", 0.7)]


@pytest.mark.parametrize("n", [1, 64])
@pytest.mark.parametrize("mode,coef", ACTS)
def test_activation(handle, torch_ref, n, mode, coef):
    import cupy
    torch = torch_ref
    F = torch.nn.functional
    a = D.ActivationDescriptor(mode, coef=coef)
    xd = D.TensorDescriptor((n, 16, 8, 8))
    rng = cupy.random.default_rng(3)
    with handle.stream:
        x = rng.standard_normal(xd.shape, dtype=cupy.float32)
        dy = rng.standard_normal(xd.shape, dtype=cupy.float32)
        y = cupy.full(xd.shape, np.nan, cupy.float32)
        dx = cupy.full(xd.shape, np.nan, cupy.float32)
    a.forward(handle, xd, x, xd, y)
    a.backward(handle, xd, y, xd, dy, xd, x, xd, dx)
    handle.stream.synchronize()
    fn = {"relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
          "clipped_relu": lambda t: F.hardtanh(t, 0.0, coef), "elu": lambda t: F.elu(t, alpha=coef)}[mode]
    tx = _t(torch, x).requires_grad_()
    ty = fn(tx)
    ty.backward(_t(torch, dy))
    assert_close(y.get(), ty.detach().cpu().numpy(), f"{mode} forward")
    assert_close(dx.get(), tx.grad.cpu().numpy(), f"{mode} backward")


def test_relu_in_place(handle, torch_ref):
    import cupy
    a, xd = D.ActivationDescriptor("relu"), D.TensorDescriptor((8, 6, 24, 24))
    with handle.stream:
        x = cupy.random.default_rng(4).standard_normal(xd.shape, dtype=cupy.float32)
        ref = cupy.maximum(x, 0)
    a.forward(handle, xd, x, xd, x)
    handle.stream.synchronize()
    assert_close(x.get(), ref.get(), "relu in place")


# ------------------------------------------------------------------ search, policy, checks

LENET_CONV2 = dict(x=(6, 12, 12), w=(16, 6, 5, 5))


def _table(handle):
    """The cuDNN stage engine's choice among every convolution engine's candidates for one spec
    (lenet/engines/cudnn.py), as a function of (handle, spec, policy): the candidates passed, fastest first."""
    from conftest import make_planner
    from lenet.engines import BY_NAME

    planner = make_planner(handle)
    return lambda _h, spec, policy: BY_NAME["cudnn"].table(planner, spec, policy).table


def _choose(handle):
    """The cuDNN stage engine's chunk and candidates for a whole batch of one spec, under a policy."""
    from conftest import make_planner
    from lenet.engines import BY_NAME

    return lambda _h, spec, policy: BY_NAME["cudnn"].conv_choice(make_planner(handle, policy), spec)


def test_search_policies(handle):
    from descriptors.exact import EXACT_RTOL
    spec = D.ConvSpec("fwd", 64, **LENET_CONV2)
    table = _table(handle)
    h = table(handle, spec, Policy())
    assert 1 <= len(h) <= 2 and len({t.candidate.engine for t in h}) == len(h), "heuristic: one per engine"
    assert table(handle, spec, Policy()) is h, "a second search comes from the cache"
    assert all(not t.candidate.name.startswith("winograd") and t.error <= EXACT_RTOL for t in h)
    e = table(handle, spec, Policy.parse("exhaustive"))
    assert len(e) > len(h) and [t.ms for t in e] == sorted(t.ms for t in e) and all(t.ms > 0 for t in e)
    assert {t.candidate.engine for t in e} == {"legacy", "graph"}
    assert all(t.error <= EXACT_RTOL for t in e), [(t.candidate.label, t.error) for t in e]
    for r in D.supported_algorithms(handle, "fwd", D.ConvolutionDescriptor(), D.TensorDescriptor((64, 6, 12, 12)),
                                    D.FilterDescriptor((16, 6, 5, 5)), D.TensorDescriptor((64, 16, 8, 8))):
        f = table(handle, spec, Policy(fwd=r.name, engine="legacy"))
        assert {t.candidate.name for t in f} == {r.name}
    graph_plan = next(t.candidate.name for t in e if t.candidate.engine == "graph")
    f = table(handle, spec, Policy(fwd=graph_plan))
    assert {(t.candidate.engine, t.candidate.name) for t in f} == {("graph", graph_plan)}
    wgrad = spec.__class__("bwd-filter", 64, **LENET_CONV2)
    zero = table(handle, wgrad, Policy.parse("exhaustive", workspace_limit=0))
    assert all(t.candidate.workspace_bytes == 0 for t in zero)
    det = table(handle, wgrad, Policy.parse("exhaustive", deterministic=True))
    assert det and all(t.candidate.deterministic for t in det)


def test_fixed_unsupported_lists_supported(handle):
    table = _table(handle)
    conv, xd, wd, yd, *_ = _setup(64, CASES[2])   # strided: FFT is not supported
    sup = {r.name for r in D.supported_algorithms(handle, "fwd", conv, xd, wd, yd)}
    missing = [n for n in ALGORITHM_NAMES[Direction.FORWARD] if n not in sup]
    assert missing, "expected some forward algorithm to be unsupported for a strided convolution"
    spec = D.ConvSpec("fwd", 64, (3, 17, 17), (8, 3, 3, 3), pad=(1, 1), stride=(2, 2))
    with pytest.raises(D.AlgorithmNotSupportedError) as e:
        table(handle, spec, Policy(fwd=missing[0], engine="legacy"))
    msg = str(e.value)
    assert missing[0] in msg and "supported here:" in msg and all(s in msg for s in sup - {"winograd"}), msg
    with pytest.raises(D.AlgorithmNotSupportedError, match="supported here:"):
        table(handle, spec, Policy(fwd="eng99999", engine="graph"))


def test_workspace_limit_excludes_fixed(handle):
    table = _table(handle)
    conv, xd, wd, yd, *_ = _setup(64, CASES[1])
    big = [r for r in D.supported_algorithms(handle, "fwd", conv, xd, wd, yd) if r.workspace_bytes > 0]
    if not big:
        pytest.fail("expected a forward algorithm that needs workspace")
    with pytest.raises(D.AlgorithmNotSupportedError, match="over the limit of 0 B"):
        table(handle, D.ConvSpec("fwd", 64, **LENET_CONV2), Policy(fwd=big[0].name, workspace_limit=0))


def test_chunk_choice_prefers_chunks_for_a_large_weight_gradient(handle):
    # Note [chunks]: conv1's weight gradient costs ~14x more per image in one call of 65536.
    choose = _choose(handle)
    c = choose(handle, D.ConvSpec("bwd-filter", 65536, (1, 28, 28), (6, 1, 5, 5)), Policy())
    assert c.chunk < 65536 and c.chunks == 65536 // c.chunk, c
    forced = choose(handle, D.ConvSpec("bwd-filter", 20000, (1, 28, 28), (6, 1, 5, 5)), Policy(chunk=8192))
    assert [(s, k) for s, k, _ in forced.calls()] == [(0, 8192), (8192, 8192), (16384, 3616)]
    assert forced.rest is not None and forced.rest.candidate is not None


def test_mismatched_arrays_are_refused(handle):
    import cupy
    conv, xd, wd, yd, x, w, dy = _setup(4, CASES[0])
    y = cupy.empty(yd.shape, cupy.float32)
    r = 0   # implicit_gemm: no workspace
    cases = [
        (dict(x=x[:2]), r"x has shape \(2, 1, 28, 28\), the descriptor wants \(4, 1, 28, 28\)"),
        (dict(x=x.astype(cupy.float64)), "x has dtype float64, the descriptor wants float32"),
        (dict(w=cupy.asfortranarray(w)), "w is not C-contiguous"),
        (dict(y=y.get()), "y must be a CuPy array on the GPU, got numpy.ndarray"),
    ]
    for kw, msg in cases:
        args = {"x": x, "w": w, "y": y, **kw}
        with pytest.raises(ValueError, match=msg):
            conv.forward(handle, xd, args["x"], wd, args["w"], yd, args["y"], r)


def cupy_empty(shape):
    import cupy
    return cupy.empty(shape, cupy.float32)


def test_workspace_too_small_is_refused(handle):
    conv, xd, wd, yd, x, w, dy = _setup(64, CASES[1])
    big = [r for r in D.supported_algorithms(handle, "fwd", conv, xd, wd, yd) if r.workspace_bytes > 0][0]
    with pytest.raises(ValueError, match="needs a workspace"):
        conv.forward(handle, xd, x, wd, w, yd, cupy_empty(yd.shape), big, D.Workspace(1))


def test_bad_param_from_cudnn_carries_shapes(handle):
    import cupy
    # A filter whose channels do not match the input: cuDNN's BAD_PARAM, raised, never skipped.
    conv = D.ConvolutionDescriptor()
    xd, wd, yd = D.TensorDescriptor((2, 3, 8, 8)), D.FilterDescriptor((4, 2, 3, 3)), D.TensorDescriptor((2, 4, 6, 6))
    with pytest.raises(D.CudnnError) as e:
        conv.forward(handle, xd, cupy.zeros(xd.shape, cupy.float32), wd, cupy.zeros(wd.shape, cupy.float32),
                     yd, cupy.zeros(yd.shape, cupy.float32), 0)
    assert e.value.is_bad_param and "x=(2, 3, 8, 8)" in str(e.value) and "w=(4, 2, 3, 3)" in str(e.value)
