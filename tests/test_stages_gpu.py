"""Our fused stage kernels (lenet/kernels/stage*.cu) against PyTorch in float64, every launch shape
at several batch sizes; the check the search runs on them; the whole step on --engine ours and auto
against PyTorch; bit-identical reruns with --deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_close
from lenet.engines import Policy
from lenet.engines.reference import ARG_OFF

pytestmark = pytest.mark.gpu

STAGE_RTOL = 1e-5   # float32 against float64 at the same decisions: sums of at most ~1e5 products


def _specs():
    from lenet.ops import StageSpec
    return [StageSpec("conv1", (1, 28, 28), (6, 1, 5, 5)), StageSpec("conv2", (6, 12, 12), (16, 6, 5, 5), dx=True)]


def _float64_stage(torch, spec, x, w, b):
    """(conv64, pooled64, argmax bytes, near-tie mask) of relu(maxpool(conv(x) + b)) in float64."""
    F = torch.nn.functional
    c = F.conv2d(x.double(), w.double(), b.double())
    pooled, idx = F.max_pool2d(c, 2, return_indices=True)
    wdt = c.shape[-1]
    arg = (((idx // wdt) % 2) * 2 + (idx % wdt) % 2).to(torch.uint8)
    win = c.unfold(2, 2, 2).unfold(3, 2, 2).reshape(*pooled.shape, 4)
    top2 = win.topk(2, dim=-1).values
    tie = (top2[..., 0] - top2[..., 1]) <= 1e-5 * c.abs().max()
    return c, pooled.clamp_min(0), arg, tie


def _float64_backward(torch, spec, x, w, b, dy, p64, arg64):
    """(dw, db, dx or None, argmax bytes) of the stage's backward in float64 at float64's decisions: the
    gradient masked by float64's ReLU, routed to its argmax. The kernels are given it unmasked: they mask
    it by the argmax bytes' ReLU bits (float64's)."""
    n, dev = x.shape[0], x.device
    dym = dy * (p64 > 0)
    xr = x.double().requires_grad_(spec.dx)
    wr, br = w.double().requires_grad_(), b.double().requires_grad_()
    out = torch.nn.functional.conv2d(xr, wr, br)
    dc = torch.zeros_like(out)
    h2, w2 = spec.y[1], spec.y[2]
    q = arg64.long()
    rows = torch.arange(h2, device=dev).view(1, 1, h2, 1) * 2 + q // 2
    cols = torch.arange(w2, device=dev).view(1, 1, 1, w2) * 2 + q % 2
    flat = (rows * out.shape[-1] + cols).reshape(n, spec.w[0], -1)
    dc.view(n, spec.w[0], -1).scatter_(2, flat, dym.double().reshape(n, spec.w[0], -1))
    grads = torch.autograd.grad(out, [t for t in (xr, wr, br) if t.requires_grad], dc)
    gx = grads[0] * (x > 0) if spec.dx else None
    bits = arg64 | ((p64 <= 0).to(torch.uint8) * ARG_OFF)
    return grads[-2], grads[-1], gx, bits


@pytest.mark.parametrize("n", [1, 7, 64, 1001, 8192])
def test_kernels_against_float64(torch_ref, n):
    import cupy
    import torch

    from lenet.kernels import stages as ours
    dev = "cuda"
    stream = cupy.cuda.get_current_stream()
    gen = torch.Generator(device=dev).manual_seed(n)
    for spec in _specs():
        ks = ours.kernels()[(spec.x, spec.w, spec.dx)]
        x = torch.randn((n, *spec.x), device=dev, generator=gen)
        if spec.dx:
            x = x.clamp_min(0)
        w = torch.randn(spec.w, device=dev, generator=gen) * 0.2
        b = torch.randn(spec.w[0], device=dev, generator=gen) * 0.1
        dy = torch.randn((n, *spec.y), device=dev, generator=gen)
        c64, p64, arg64, tie = _float64_stage(torch, spec, x, w, b)
        cx, cw, cb = (cupy.asarray(t.contiguous()) for t in (x, w, b))
        for cand in ks.forward_candidates():
            y = cupy.full((n, *spec.y), cupy.nan, cupy.float32)
            arg = cupy.full((n, *spec.y), 255, cupy.uint8)
            ours.stage_forward(ks, cand, n, stream, cx, cw, cb, y, arg)()
            assert_close(cupy.asnumpy(y), p64.cpu().numpy(), f"{spec.name} n={n} {cand.name} pooled", STAGE_RTOL)
            live = (p64 > 0).cpu().numpy()
            a = cupy.asnumpy(arg)
            differ = ((a & 3) != arg64.cpu().numpy()) & live
            away = differ & ~tie.cpu().numpy()
            assert not away.any(), f"{spec.name} n={n} {cand.name}: {int(away.sum())} argmaxes differ away from ties"
            off = cupy.asnumpy(~(y > 0))   # Note [the ReLU bit]: set exactly where the own pooled output is not > 0
            assert np.array_equal((a & ARG_OFF) != 0, off) and not (a & ~np.uint8(3 | ARG_OFF)).any(), \
                f"{spec.name} n={n} {cand.name}: the argmax bytes' ReLU bits disagree with the pooled output"
        gw, gb, gx, bits = _float64_backward(torch, spec, x, w, b, dy, p64, arg64)
        cdy, carg = cupy.asarray(dy.contiguous()), cupy.asarray(bits.contiguous())
        for cand in ks.backward_candidates():
            part = cupy.empty((cand.grid(n), ks.width), cupy.float32)
            dw, db = cupy.full(spec.w, cupy.nan, cupy.float32), cupy.full(spec.w[0], cupy.nan, cupy.float32)
            dx = cupy.full((n, *spec.x), cupy.nan, cupy.float32) if spec.dx else None
            ours.stage_backward(ks, cand, n, stream, part, cx, cw, carg, cdy, dw, db, dx)()
            what = f"{spec.name} n={n} {cand.name}"
            assert_close(cupy.asnumpy(dw), gw.cpu().numpy(), f"{what} dw", STAGE_RTOL)
            assert_close(cupy.asnumpy(db), gb.cpu().numpy(), f"{what} db", STAGE_RTOL)
            if spec.dx:
                assert_close(cupy.asnumpy(dx), gx.cpu().numpy(), f"{what} dx", STAGE_RTOL)
            again = dw.copy()
            ours.stage_backward(ks, cand, n, stream, part, cx, cw, carg, cdy, dw, db, dx)()
            assert cupy.array_equal(again, dw), f"{what}: a rerun is not bit-identical"


def test_one_block_sums_many_images(torch_ref):
    """Every backward summing 256 images in one block (the plan-time check's second run, Note [checking a
    stage]) within STAGE_RTOL of float64: a sum carried across images in a rounding that is not to nearest
    grows with the images a block sums (Note [an image's own sums] in stage2_backward_roles.cu: 5.9e-5 at
    65536 images on 396 blocks), which a block an image never shows."""
    import cupy
    import torch

    from lenet.kernels import stages as ours
    n, dev = 256, "cuda"
    stream = cupy.cuda.get_current_stream()
    gen = torch.Generator(device=dev).manual_seed(5)
    for spec in _specs():
        ks = ours.kernels()[(spec.x, spec.w, spec.dx)]
        x = torch.randn((n, *spec.x), device=dev, generator=gen)
        x = x.clamp_min(0) if spec.dx else x
        w = torch.randn(spec.w, device=dev, generator=gen) * 0.2
        b = torch.randn(spec.w[0], device=dev, generator=gen) * 0.1
        dy = torch.randn((n, *spec.y), device=dev, generator=gen)
        _, p64, arg64, _ = _float64_stage(torch, spec, x, w, b)
        gw, gb, gx, bits = _float64_backward(torch, spec, x, w, b, dy, p64, arg64)
        cx, cw, cdy, carg = (cupy.asarray(t.contiguous()) for t in (x, w, dy, bits))
        for cand in ks.backward_candidates():
            one = cand.one_block()
            assert cand.grid(n, one) == 1
            part = cupy.empty((1, ks.width), cupy.float32)
            dw, db = cupy.full(spec.w, cupy.nan, cupy.float32), cupy.full(spec.w[0], cupy.nan, cupy.float32)
            dx = cupy.full((n, *spec.x), cupy.nan, cupy.float32) if spec.dx else None
            ours.stage_backward(ks, cand, n, stream, part, cx, cw, carg, cdy, dw, db, dx, share=one)()
            what = f"{spec.name} {cand.name} in one block of {n} images"
            assert_close(cupy.asnumpy(dw), gw.cpu().numpy(), f"{what} dw", STAGE_RTOL)
            assert_close(cupy.asnumpy(db), gb.cpu().numpy(), f"{what} db", STAGE_RTOL)
            if spec.dx:
                assert_close(cupy.asnumpy(dx), gx.cpu().numpy(), f"{what} dx", STAGE_RTOL)


def test_the_check_passes_ours_and_catches_a_wrong_decision():
    """Note [checking a stage]: every launch shape passes against cuDNN's exact result on the check's
    operands, half of them quantized pictures on a constant background (Note [real-data operands]); a
    wrong argmax away from a near-tie, the first maximum not taken at an exact four-way tie, a ReLU bit
    that disagrees with the pooled output (Note [the ReLU bit]), a wrong dw,
    and a data gradient that leaks through an exact zero all fail."""
    import cupy

    from conftest import make_planner
    from descriptors import Handle
    from lenet.engines import BY_NAME
    from lenet.engines import reference as check
    from lenet.kernels import stages as ours
    h = Handle()
    planner, engine = make_planner(h), BY_NAME["ours"]
    for spec in _specs():
        ks = ours.kernels()[(spec.x, spec.w, spec.dx)]
        fwd, bwd = engine.stage_candidates(spec, Policy.parse("exhaustive"))
        for cand in fwd + bwd:
            c = engine.check_stage(planner, spec, cand)
            assert c.why is None and c.error < 1e-5, (spec.name, cand, c)
        ref = engine._reference(planner, spec)
        assert ref.flat.sum() > 100, f"{spec.name}: the pictures gave {int(ref.flat.sum())} exact ties"
        m = ref.x.shape[0]
        y, arg = cupy.empty(ref.y.shape, cupy.float32), cupy.empty_like(ref.arg)
        ours.stage_forward(ks, fwd[0], m, h.stream, ref.x, ref.w, ref.b, y, arg)()
        h.stream.synchronize()   # read below on CuPy's stream, which does not wait for the handle's
        for where in (ref.decided & ~ref.flat, ref.flat):
            bad = arg.copy()
            i = int(np.flatnonzero(where.ravel())[0])
            bad.ravel()[i] = (int(bad.ravel()[i]) + 1) % 4
            assert check.check_forward(ref, y, bad)[2] is not None, "a wrong argmax passed the check"
        bad = arg.copy()
        bad.ravel()[int(np.flatnonzero(ref.live.ravel())[0])] ^= ARG_OFF
        assert "ReLU bits" in check.check_forward(ref, y, bad)[2], "a wrong ReLU bit passed the check"
        assert check.check_backward(ref, ref.dw * 1.001, ref.db, ref.dx)[1] is not None, "a wrong dw passed"
        if spec.dx:
            assert ref.x_zero.any()
            leak = ref.dx.copy()
            leak[ref.x_zero] = 1e-30   # below any distance bound: only the mask check sees it
            assert "exactly 0" in check.check_backward(ref, ref.dw, ref.db, leak)[1]


STEP = [(n, e, g) for n in (1, 7, 64, 256) for e in ("ours", "auto") for g in (False, True)]


@pytest.mark.parametrize("n,engine,graph", STEP, ids=[f"{n}-{e}-{'graph' if g else 'eager'}" for n, e, g in STEP])
def test_step_parity(torch_ref, n, engine, graph):
    from lenet.model import LeNet
    from test_model_gpu import check_one_step, check_one_step_graph
    for policy in ("heuristic", "exhaustive"):
        model = LeNet(max_batch=n, seed=n, cuda_graph=graph, policy=Policy.parse(policy, engine=engine))
        rows = [r for r in model.describe(n) if r["layer"] in ("conv1", "conv2")]
        if engine == "ours":
            assert {r["engine"] for r in rows} == {"ours"}, rows
        (check_one_step_graph if graph else check_one_step)(torch_ref, model, n, what=f"{engine} {policy} n={n}")


def test_large_batch_ours(torch_ref):
    from lenet.model import LeNet
    from test_model_gpu import check_one_step_graph
    model = LeNet(max_batch=20000, seed=11, cuda_graph=True, policy=Policy(engine="ours"))
    check_one_step_graph(torch_ref, model, 20000, what="ours n=20000")


def test_deterministic_ours_is_bit_identical():
    from lenet.model import LeNet
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((300, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 300).astype(np.int32)
    runs = []
    for graph in (True, True, False):
        m = LeNet(max_batch=300, seed=3, momentum=0.9, cuda_graph=graph, policy=Policy(deterministic=True))
        assert {r["engine"] for r in m.describe(300) if r["layer"] in ("conv1", "conv2")} == {"ours"}
        m.load_batch(x, y)
        for _ in range(4):
            m.step(300, 0.05)
        runs.append(m.flat_state()[0])
    assert np.array_equal(runs[0], runs[1]) and np.array_equal(runs[0], runs[2]), "reruns differ"


def test_stored_stage_choice_is_reused(tmp_path):
    from lenet.model import LeNet
    path = tmp_path / "plans.json"
    a = LeNet(max_batch=64, seed=0, plan_cache=path, policy=Policy.parse("exhaustive"))
    rows_a = a.describe(64)
    b = LeNet(max_batch=64, seed=0, plan_cache=path, policy=Policy.parse("exhaustive"))
    rows_b = b.describe(64)
    pick = (lambda rows: [(r["layer"], r["engine"], r["algo"]) for r in rows if r["layer"] in ("conv1", "conv2")])
    assert pick(rows_a) == pick(rows_b)
    assert b.plan_cache.summary()["searched"] == 0, b.plan_cache.summary()


@pytest.mark.parametrize("engine", ["ours", "auto"])
def test_five_graph_replays_follow_pytorch(torch_ref, engine):
    # Every kernel of the step must be inside the captured graph: a launch on another stream would run
    # once, at capture, and the replays would train without it.
    from lenet.model import LeNet
    from test_model_gpu import torch_step
    from torch_lenet import well_conditioned_batch
    model = LeNet(max_batch=64, seed=9, cuda_graph=True, policy=Policy(engine=engine))
    state = model.state_dict()
    x, y = well_conditioned_batch(state, 64, 5)
    ref, ref_after = torch_step(torch_ref, state, x, y, lr=0.05, steps=5)
    model.load_batch(x, y)
    losses = []
    for _ in range(5):
        model.step(64, 0.05)
        losses.append(model.loss())
    np.testing.assert_allclose(losses, [r[1] for r in ref], rtol=1e-4)
    after = model.state_dict()
    for k in ref_after:
        assert_close(after[k], ref_after[k], f"{engine} graph {k} after 5 steps")


def test_a_model_larger_than_the_gpu_is_refused_in_one_line():
    import gc

    import cupy

    from lenet.model import LeNet
    gc.collect()   # earlier tests' models (a model and its runner form a cycle) go first: they are not this test's
    used = cupy.get_default_memory_pool().used_bytes()
    with pytest.raises(ValueError, match=r"needs about .* GB of GPU memory; the GPU has .* GB free"):
        LeNet(max_batch=10_000_000)
    assert cupy.get_default_memory_pool().used_bytes() == used, "the refused model allocated"


@pytest.mark.parametrize("n", [64, 2100, 8192])
def test_a_gpu_that_holds_one_block_an_sm_runs_the_same_step(n, monkeypatch):
    """Note [launch shapes from the device] in lenet/kernels/launch.py: every launch of ours given enough extra
    dynamic shared memory that one block fills an SM (the occupancy API then says 1 for every stage kernel).
    With the grids unchanged (more blocks than now fit: several waves), four steps of --engine ours under
    --deterministic (no timing decides anything: the tail form's tuned cuBLASLt products would) are
    bit-identical to the unsqueezed run: no kernel waits for another block's progress, so a smaller GPU
    cannot deadlock. With the grids the occupancy API now allows (one block an SM), they run too, their sums in
    another order: within 1e-5."""
    import contextlib

    from lenet.kernels import launch, sm_count, stages
    from lenet.model import LeNet
    rng = np.random.default_rng(n)
    x, y = rng.standard_normal((n, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, n).astype(np.int32)
    grids = []
    real = stages.Launch

    def recording(fn, grid, *a, **k):   # the stage kernels' grids (their reductions' too)
        grids.append(grid[0])
        return real(fn, grid, *a, **k)
    monkeypatch.setattr(stages, "Launch", recording)

    def train(squeeze):
        grids.clear()
        with squeeze or contextlib.nullcontext():
            m = LeNet(max_batch=n, seed=3, momentum=0.9, cuda_graph=True,
                      policy=Policy(engine="ours", deterministic=True))
            if squeeze is not None and squeeze.follow:
                for ks in stages.kernels().values():
                    for mod in ks.forward + ks.backward:
                        if mod.runs_on(stages.kernel_arch()):
                            fn = stages.function(mod)
                            assert launch.resident(fn, mod.threads * max(mod.images or (1,)),
                                                   mod.smem_bytes(max(mod.images or (0,)))) == 1, mod.name
            m.load_batch(x, y)
            losses = []
            for _ in range(4):
                m.step(n, 0.05)
                losses.append(m.loss())
            names = sorted({(r["layer"], r["op"], r["algo"]) for r in m.describe(n) if r["layer"] in ("conv1", "conv2")})
            out = m.flat_state()[0], losses, names, max(grids)
            m.close()
            return out
    plain, waves, one = train(None), train(launch.squeezed(follow=False)), train(launch.squeezed(follow=True))
    assert plain[2] == waves[2] == one[2], "the squeeze changed which kernels run"
    assert waves[3] == plain[3] and one[3] <= sm_count(), (plain[3], waves[3], one[3])
    if n >= 2 * sm_count():
        assert plain[3] > sm_count(), "no grid of more than one block an SM: the test squeezes nothing"
    assert np.array_equal(plain[0], waves[0]) and plain[1] == waves[1], "the same grids in more waves changed a bit"
    assert_close(one[0], plain[0], f"n={n} one block an SM", 1e-5)
    np.testing.assert_allclose(one[1], plain[1], rtol=1e-5)


@pytest.mark.parametrize("script", ["conv1_backward_v1.py", "conv2_backward_v1_v2.py", "conv2_backward_v6.py"])
def test_the_versions_in_dev_still_pass_their_check(script):
    """dev/'s versions (docs/kernels.md, "What ships") compile with the package's machinery and pass the
    check against cuDNN's exact result (dev/common.py): the workbench does not rot while the package moves.
    A version this GPU's kernels cannot run says so (exit 2); any other exit fails, its output shown."""
    import subprocess
    import sys
    from pathlib import Path

    from lenet.kernels import arch
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "dev" / script), "--check-only"], capture_output=True, text=True,
                         timeout=600, cwd=root)
    out = run.stdout + run.stderr
    if script == "conv2_backward_v6.py" and arch() < 80:
        assert run.returncode == 2 and "need compute capability 8.0" in out, out[-3000:]
        return
    assert run.returncode == 0 and "All results match." in out and "FAIL" not in out, out[-3000:]
    assert out.count("OK  ") >= 3 * 2 * 5 * 2, out[-3000:]   # operand sets x batches x shapes x (grid, one block)
