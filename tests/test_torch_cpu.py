"""lenet.torch without a GPU: it imports and builds, its parameters are PyTorch's LeNet's (names,
shapes, our initialization), its one-line errors, and torch stays an optional extra that no other
module of the product imports."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lt():
    import lenet.torch as lt

    return lt


def test_the_module_builds_with_pytorchs_names_shapes_and_our_initialization(lt):
    from torch_lenet import TorchLeNet

    from lenet import params as P

    model = lt.LeNet(seed=3)
    ref = TorchLeNet().state_dict()
    got = model.state_dict()
    assert list(got) == list(ref) == list(P.NAMES)
    assert all(got[k].shape == ref[k].shape and got[k].dtype == torch.float32 for k in got)
    init = P.init_host(3)
    assert all(np.array_equal(got[k].numpy(), init[k]) for k in got)
    assert [n for n, _ in model.named_parameters()] == list(P.NAMES)
    assert "lenet::forward" in str(torch.ops.lenet.forward.default._schema)


@pytest.mark.parametrize("x,what", [
    (lambda: torch.zeros(2, 1, 28, 28), "runs on CUDA tensors: the images are on cpu"),
    (lambda: torch.zeros(2, 1, 28, 28, dtype=torch.float64), "takes float32 images, got float64"),
    (lambda: torch.zeros(2, 1, 28, 28, dtype=torch.bfloat16), "takes float32 images, got bfloat16"),
    (lambda: torch.zeros(2, 28, 28), "shape (N, 1, 28, 28) with N >= 1, got (2, 28, 28)"),
    (lambda: torch.zeros(0, 1, 28, 28), "got (0, 1, 28, 28)"),
    (lambda: torch.zeros(28, 28, 2, 1).permute(2, 3, 0, 1), "takes contiguous images"),
    (lambda: np.zeros((2, 1, 28, 28), np.float32), "takes a torch.Tensor of images, got ndarray"),
], ids=["cpu", "float64", "bfloat16", "shape", "empty", "strided", "numpy"])
def test_inputs_it_does_not_take_are_one_line_each(lt, x, what):
    with pytest.raises(ValueError) as e:
        lt.LeNet()(x())
    assert what in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kw,what", [
    ({"engine": "cudnn"}, "engine must be one of auto, ours, legacy, graph, got 'cudnn'"),
    ({"engine": "ours", "fused": False}, "--engine ours runs our fused stage kernels only"),
    ({"algo": "fastest"}, "fastest"),
])
def test_flags_it_does_not_take_are_one_line_each(lt, kw, what):
    with pytest.raises(ValueError) as e:
        lt.LeNet(**kw)
    assert what in str(e.value) and "\n" not in str(e.value)


def test_our_files_load_into_the_module(lt, tmp_path):
    from lenet import checkpoint, export
    from lenet import params as P

    state = P.init_host(7)
    export.save(state, tmp_path / "w.npz")
    flat = P.pack(state)
    checkpoint.save(tmp_path / "ckpt.npz", flat, np.zeros_like(flat), {"epoch": 1})
    for f in ("w.npz", "ckpt.npz"):
        got = lt.LeNet(seed=0).load_file(tmp_path / f).state_dict()
        assert all(np.array_equal(got[k].numpy(), state[k]) for k in P.NAMES), f
    with pytest.raises(ValueError):
        lt.LeNet().load_file(tmp_path / "missing.npz")


def test_torch_is_an_optional_extra_imported_by_lenet_torch_alone():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["torch"])
    assert not any(d.startswith("torch") for d in project["dependencies"] + project["optional-dependencies"]["cu13"])
    importers = set()
    for f in [*(ROOT / "lenet").rglob("*.py"), *(ROOT / "descriptors").rglob("*.py")]:
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(n.split(".")[0] == "torch" for n in names):
                importers.add(f.relative_to(ROOT).as_posix())
    assert importers == {"lenet/torch.py"}


def test_every_engine_builds_in_a_fresh_process():
    """Every engine flag the registry offers builds a module in a fresh process."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "import lenet.torch as lt\nfrom lenet.engines import FLAGS\nfor e in FLAGS: lt.LeNet(engine=e)\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_torch_save_and_pytorchs_lenet_interoperate(lt, tmp_path):
    from torch_lenet import TorchLeNet

    ours = lt.LeNet(seed=5)
    torch.save(ours.state_dict(), tmp_path / "ours.pt")
    theirs = TorchLeNet()
    theirs.load_state_dict(torch.load(tmp_path / "ours.pt"))
    back = lt.LeNet(seed=0)
    back.load_state_dict(theirs.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), ours.state_dict().values()))
    opt = torch.optim.SGD(back.parameters(), lr=0.1, momentum=0.9)   # any optimizer and scheduler take them
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)
    opt.step()   # no gradients yet: a step that changes nothing, before the scheduler's, in PyTorch's order
    sched.step()
    assert opt.param_groups[0]["lr"] < 0.1


def test_an_engine_and_its_model_go_with_their_module(lt):
    import gc

    model = lt.LeNet()
    engine_id = model._engine.id
    assert lt._engines[engine_id] is model._engine and lt.LeNet()._engine.id != engine_id
    del model
    gc.collect()
    assert engine_id not in lt._engines
    with pytest.raises(ValueError, match=f"no lenet.torch engine {engine_id}"):
        lt._engine(engine_id)


def test_images_requiring_a_gradient_under_ours_are_refused_at_the_forward_in_one_line(lt):
    """engine="ours" runs no cuDNN and no kernel of ours computes conv1's unmasked input gradient: the
    forward refuses images that require a gradient, before any model is made or anything changes; where a
    gradient is not being recorded, or the engine can compute it, nothing is refused for it."""
    model = lt.LeNet(engine="ours")
    x = torch.zeros(2, 1, 28, 28, requires_grad=True)
    with pytest.raises(ValueError) as e:
        model(x)
    assert "cannot compute the images' gradient" in str(e.value) and "x.detach()" in str(e.value)
    assert str(e.value).endswith("or use engine='auto' or 'legacy' or 'graph'"), str(e.value)   # the registry's answer
    assert "\n" not in str(e.value) and model._engine.model is None and model._engine.held is None
    with torch.no_grad(), pytest.raises(ValueError, match="runs on CUDA tensors"):
        model(x)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        model(x.detach())
    for engine in ("auto", "legacy", "graph"):
        assert lt.LeNet(engine=engine)._engine.no_input_grad is None
        with pytest.raises(ValueError, match="runs on CUDA tensors"):
            lt.LeNet(engine=engine)(x)


class _Unplannable:
    """A model whose step cannot be planned (what the planner raises where no engine serves an operation)."""

    made: list = []

    def __init__(self, max_batch, policy, cuda_graph, plan_cache, input_grad):
        self.max_batch, self.input_grad, self.closed = max_batch, input_grad, False
        _Unplannable.made.append(self)

    def plan(self, n):
        from descriptors.algorithms import AlgorithmNotSupportedError

        raise AlgorithmNotSupportedError("no engine runs stage conv1 under this policy")

    def close(self):
        self.closed = True


def test_a_model_whose_plan_fails_never_replaces_the_modules(lt, monkeypatch):
    """A backward that asks for a model the planner cannot plan (the images' gradient, a larger batch) leaves
    the module's model as it was, holding the forward it held; the failed one is closed."""
    import contextlib

    import cupy

    from lenet import model as model_module

    monkeypatch.setattr(model_module, "LeNet", _Unplannable)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(cupy.cuda, "Device", lambda index=None: contextlib.nullcontext())
    engine = lt.LeNet(engine="auto")._engine
    before = type("Planned", (), {"max_batch": 64, "input_grad": False})()
    device = torch.device("cuda", 0)
    engine.model, engine.device, engine.held = before, device, ("the forward it holds",)
    from descriptors.algorithms import AlgorithmNotSupportedError

    for n, want in ((8, True), (128, False)):
        _Unplannable.made = []
        with pytest.raises(AlgorithmNotSupportedError):
            engine._model(n, device, want)
        assert engine.model is before and engine.held == ("the forward it holds",)
        assert len(_Unplannable.made) == 1 and _Unplannable.made[0].closed
