"""The training recipe's pieces against PyTorch's own (see Note [tolerance] in conftest.py):
augmentation in the gather kernel, label smoothing in the softmax-CE kernel, Nesterov momentum
and the weights' moving average in the SGD kernel; evaluation as one CUDA graph; and the plan
cache used by a second program run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_close

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def images(n, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.random((n, 28, 28)) ** 3 * 255).astype(np.uint8)   # mostly dark, like the datasets
    x[:, :3], x[:, :, -3:] = 0, 0
    return x, rng.integers(0, 10, n).astype(np.uint8)


@pytest.mark.parametrize("shift,flip,cut", [(0, False, 0), (2, False, 0), (0, True, 0), (3, True, 0), (0, False, 8),
                                          (2, True, 12), (0, False, 28)])
def test_the_gather_kernel_augments_as_the_host_reference(shift, flip, cut):
    from lenet import data
    from lenet.kernels import Augment
    from lenet.model import LeNet

    x, y = images(300)
    mean, std = data.pixel_stats(x)
    m = LeNet(max_batch=128)
    ds = data.GpuDataset(x, y, mean, std, m.stream)
    for start, n, epoch in ((0, 128, 3), (128, 128, 4), (256, 44, 3)):   # the prepared launch's numbers move
        order = data.epoch_order(5, epoch, len(x))
        lr = 0.5 / (1 + start)
        m.load_from(ds, ds.order(5, epoch), start, n, lr=lr,   # sent on the model's stream (ds's)
                    augment=Augment(shift, flip, seed=5, cutout=cut),
                    epoch=epoch)
        m.stream.synchronize()
        assert m.lr_dev.get()[0] == np.float32(lr)   # the rate, written by the gather's first thread
        dy, dx, mir = data.augment_params(5, epoch, np.arange(start, start + n), shift, flip)
        ref = data.augment_images(x[order[start:start + n]], dy, dx, mir)
        if cut:
            ref = data.cut_images(ref, *data.cutout_params(5, epoch, np.arange(start, start + n), cut), cut)
        want = (ref.astype(np.float32) / np.float32(255) - np.float32(mean)) / np.float32(std)
        got = m.buf["x"][:n].get().reshape(n, 28, 28)
        assert np.array_equal(got, want), f"batch at {start}: {np.abs(got - want).max()}"
        assert np.array_equal(m.buf["labels"][:n].get(), y[order[start:start + n]])
    if shift or flip:
        moved = data.augment_params(5, 3, np.arange(300), shift, flip)
        assert any(np.any(a) for a in moved), "no image was moved or mirrored"
    if cut:   # the comparison reached the cut: its squares cleared bright pixels
        order = data.epoch_order(5, 3, len(x))
        plain = data.augment_images(x[order[:128]], *data.augment_params(5, 3, np.arange(128), shift, flip))
        cleared = data.cut_images(plain, *data.cutout_params(5, 3, np.arange(128), cut), cut)
        assert (plain != cleared).any(), "no cutout cleared a bright pixel"


def test_the_gather_kernel_mirrors_every_image_for_test_time_augmentation():
    from lenet import data
    from lenet.kernels import MIRROR
    from lenet.model import LeNet

    x, y = images(200)
    mean, std = data.pixel_stats(x)
    m = LeNet(max_batch=128)
    ds = data.GpuDataset(x, y, mean, std, m.stream)
    order = ds.order(1, 0)
    m.load_from(ds, order, 72, 128, augment=MIRROR, epoch=9)
    m.stream.synchronize()
    want = (x[order.get()[72:200], :, ::-1].astype(np.float32) / np.float32(255) - np.float32(mean)) / np.float32(std)
    assert np.array_equal(m.buf["x"][:128].get().reshape(128, 28, 28), want)


def _torch_model(torch, state):
    from torch_lenet import from_state
    return from_state(state)


def test_label_smoothing_matches_pytorch(torch_ref):
    import torch

    from lenet.model import LeNet
    from lenet.params import init_host
    from torch_lenet import well_conditioned_batch

    eps = 0.1
    m = LeNet(max_batch=64, label_smoothing=eps)
    m.load_state_dict(init_host(7))
    state = m.state_dict()
    x, y = well_conditioned_batch(state, 64, 3)
    t = _torch_model(torch, state)
    loss = torch.nn.functional.cross_entropy(t(torch.as_tensor(x, device="cuda")),
                                             torch.as_tensor(y, device="cuda").long(), label_smoothing=eps)
    loss.backward()
    m.load_batch(x, y)
    m.forward(64)
    m.backward(64)
    assert abs(m.loss() - loss.item()) <= 1e-5 * abs(loss.item()), (m.loss(), loss.item())
    grads = m.grad_dict()
    for k, p in t.named_parameters():
        assert_close(grads[k], p.grad.detach().cpu().numpy(), f"label-smoothed grad {k}")


@pytest.mark.parametrize("nesterov,ema", [(True, None), (False, 0.9), (True, 0.99)])
def test_nesterov_and_the_moving_average_match_pytorch(nesterov, ema, torch_ref):
    import torch
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from lenet.model import LeNet
    from lenet.params import init_host
    from torch_lenet import well_conditioned_batch

    m = LeNet(max_batch=32, momentum=0.9, weight_decay=5e-4, nesterov=nesterov, ema_decay=ema)
    m.load_state_dict(init_host(11))
    state = m.state_dict()
    x, y = well_conditioned_batch(state, 32, 5)
    t = _torch_model(torch, state)
    opt = torch.optim.SGD(t.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=nesterov)
    avg = None
    if ema is not None:
        avg = AveragedModel(t, multi_avg_fn=get_ema_multi_avg_fn(ema))
        avg.update_parameters(t)
    tx, ty = torch.as_tensor(x, device="cuda"), torch.as_tensor(y, device="cuda").long()
    m.load_batch(x, y)
    for _ in range(4):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(t(tx), ty).backward()
        opt.step()
        if avg is not None:
            avg.update_parameters(t)
        m.step(32, 0.05)
    after = m.state_dict()
    for k, v in t.state_dict().items():
        assert_close(after[k], v.detach().cpu().numpy(), f"params {k} after 4 steps (nesterov={nesterov})")
    if ema is not None:
        ours = m.eval_state_dict()
        for k, v in avg.module.state_dict().items():
            assert_close(ours[k], v.detach().cpu().numpy(), f"moving average {k}")


@pytest.mark.parametrize("ema", [None, 0.9])
def test_evaluation_as_one_cuda_graph_equals_eager_and_pytorch(ema, torch_ref):
    import torch

    from lenet import data
    from lenet.model import LeNet

    x, y = images(2500, seed=4)
    mean, std = data.pixel_stats(x)
    res = {}
    for graph in (False, True):
        m = LeNet(max_batch=1000, seed=3, momentum=0.9, ema_decay=ema, cuda_graph=graph)
        ds = data.GpuDataset(x, y, mean, std, m.stream)
        m.load_from(ds, ds.identity, 0, 64, lr=0.05)
        for _ in range(3):
            m.step(64)
        res[graph] = (m.evaluate(ds, 1000), m.evaluate(ds, 1000), m.eval_state_dict(), m.state_dict())
    (a, a2, w, live), (b, b2, _, live_g) = res[False], res[True]
    assert a == a2 and b == b2, "evaluation changed something"
    assert abs(a[0] - b[0]) <= 1e-6 * a[0] and a[1] == b[1], (a, b)
    for k in live:   # the live weights are back in place after evaluating on the average
        assert np.array_equal(live[k], live_g[k]) or np.allclose(live[k], live_g[k], rtol=1e-6)
    t = _torch_model(torch, w)
    with torch.no_grad():
        xt = torch.as_tensor(x, device="cuda").float().div(255).sub(mean).div(std).unsqueeze(1)
        lg = t(xt)
        yt = torch.as_tensor(y, device="cuda").long()
        ref_loss = torch.nn.functional.cross_entropy(lg, yt).item()
        ref_acc = (lg.argmax(1) == yt).float().mean().item()
    assert abs(b[0] - ref_loss) <= 1e-4 * ref_loss and abs(b[1] - ref_acc) <= 1 / 2500, (b, ref_loss, ref_acc)


@pytest.mark.parametrize("graph", [False, True])
def test_test_time_augmentation_scores_the_mean_of_both_views_as_pytorch(graph, torch_ref):
    import torch

    from lenet import data
    from lenet.model import LeNet

    x, y = images(2300, seed=6)
    mean, std = data.pixel_stats(x)
    m = LeNet(max_batch=1000, seed=2, momentum=0.9, cuda_graph=graph)
    ds = data.GpuDataset(x, y, mean, std, m.stream)
    m.load_from(ds, ds.identity, 0, 64, lr=0.05)
    for _ in range(3):
        m.step(64)
    plain, tta, again = m.evaluate(ds, 1000), m.evaluate(ds, 1000, tta=True), m.evaluate(ds, 1000)
    assert plain == again, "test-time augmentation changed the plain evaluation"
    t = _torch_model(torch, m.state_dict())
    with torch.no_grad():
        xt = torch.as_tensor(x, device="cuda").float().div(255).sub(mean).div(std).unsqueeze(1)
        yt = torch.as_tensor(y, device="cuda").long()
        ref = {}
        for name, lg in (("plain", t(xt)), ("tta", (t(xt) + t(xt.flip(-1))) / 2)):
            ref[name] = (torch.nn.functional.cross_entropy(lg, yt).item(), (lg.argmax(1) == yt).float().mean().item())
    # Forward only, so tighter than Note [tolerance]: measured 1.3e-7 (H100). The two views' scores
    # differ by more (measured: 9e-5 in the loss, 11 of 2300 answers), so a wrong view shows.
    ours = {"plain": plain, "tta": tta}
    for name in ours:
        got, want = ours[name], ref[name]
        assert abs(got[0] - want[0]) <= 1e-5 * want[0] and abs(got[1] - want[1]) <= 1 / 2300, (name, ours, ref)
    assert abs(ref["tta"][0] - ref["plain"][0]) > 4e-5 * ref["plain"][0] and \
        abs(ref["tta"][1] - ref["plain"][1]) >= 4 / 2300, ("the views score alike: the test cannot tell", ref)


def _run(module, *args, env=None, timeout=300):
    e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    return subprocess.run([sys.executable, "-m", module, *args], env=e, capture_output=True, text=True,
                          timeout=timeout)


def test_the_plan_cache_is_used_by_a_second_run_and_ignored_when_a_key_changes(tmp_path):
    cache = tmp_path / "plans.json"
    env = {"LENET_PLAN_CACHE": str(cache)}
    first = _run("lenet.train_step", "--synthetic", "--json", "--algo", "exhaustive", env=env)
    assert first.returncode == 0, first.stderr
    doc = json.loads(cache.read_text())
    assert doc["format"] == 2 and len(doc["entries"]) >= 5, doc
    second = _run("lenet.train_step", "--synthetic", "--json", "--algo", "exhaustive", env=env)
    assert second.returncode == 0, second.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert [r.get("algo") for r in a["operations"]] == [r.get("algo") for r in b["operations"]]
    # At least one stored choice per stage (the stage's engine; under cuDNN's engine, its convolutions' too).
    assert b["plan_cache"]["hits"] >= 2 and b["plan_cache"]["misses"] == 0, b["plan_cache"]
    assert b["plan_cache"]["searched"] == 0, b["plan_cache"]
    # Another key (the cuDNN version recorded for every entry): nothing matches, the run searches.
    doc["entries"] = {k.replace('"cudnn":"', '"cudnn":"0.0.0-'): v for k, v in doc["entries"].items()}
    cache.write_text(json.dumps(doc))
    third = _run("lenet.train_step", "--synthetic", "--json", "--algo", "exhaustive", env=env)
    c = json.loads(third.stdout)
    assert c["plan_cache"]["hits"] == 0 and c["plan_cache"]["searched"] >= 5, c["plan_cache"]
    # --no-plan-cache: no reading, no writing.
    before = cache.read_bytes()
    fourth = _run("lenet.train_step", "--synthetic", "--json", "--no-plan-cache", env=env)
    assert json.loads(fourth.stdout)["plan_cache"] is None and cache.read_bytes() == before
    # A corrupt file: one warning line, a search, no crash.
    cache.write_text("{not json")
    fifth = _run("lenet.train_step", "--synthetic", env=env)
    assert fifth.returncode == 0, fifth.stderr
    warn = [x for x in fifth.stderr.splitlines() if "plan cache" in x]
    assert len(warn) == 1 and "not a readable cache" in warn[0], fifth.stderr
    assert json.loads(cache.read_text())["format"] == 2


def test_predict_on_the_gpu_and_on_the_cpu_gives_the_same_predictions(tmp_path):
    """lenet predict --device cpu (NumPy) beside --device gpu (our engines) on an exported run's weights:
    the same class for every image (a model trained on the GPU machine can be used anywhere)."""
    from lenet import checkpoint as ckpt
    from lenet import data
    from lenet import params as P

    root = data.find_dataset(None)
    if root is None:
        pytest.fail("Fashion-MNIST not found (the GPU check brings it: $LENET_DATA)")
    state = {k: v * 4 for k, v in P.init_host(5).items()}
    ckpt.save(tmp_path / "c.npz", P.pack(state), np.zeros(P.TOTAL, np.float32),
              {"epoch": 1, "iteration": 1, "config": {"mean": 0.286, "std": 0.353, "dataset": str(root)},
               "history": []})
    images = next(p for p in root.iterdir() if p.name.startswith("t10k-images"))
    got = {}
    for device in ("gpu", "cpu"):
        out = _run("lenet.predict", "--device", device, "--checkpoint", str(tmp_path / "c.npz"), "--show", "2000",
                   str(images), timeout=300)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith(f"device: {device.upper()}"), lines[0]
        got[device] = [x.split(": ")[1].split(" (p=")[0] for x in lines[1:2001]]
    same = sum(a == b for a, b in zip(got["gpu"], got["cpu"]))
    assert same == 2000, f"{2000 - same} of 2000 predictions differ between the GPU and the CPU"
