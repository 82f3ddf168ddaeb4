"""Our step from PyTorch: the network's forward and backward as PyTorch custom operators
(``torch.ops.lenet.forward``, ``torch.ops.lenet.backward``) and ``LeNet``, an nn.Module on them. The
only module of the product that imports torch (pip install '.[cu13,torch]').

    model = lenet.torch.LeNet(engine="auto").cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss = torch.nn.functional.cross_entropy(model(x), y)   # any loss written in torch
    loss.backward()
    opt.step()

Note [torch operators]: ``lenet::forward(x, params, engine)`` returns the logits and
``lenet::backward(dlogits, x, params, engine, input_grad)`` the eight parameter gradients, and with
``input_grad`` the images' gradient as a ninth (asked for where x requires a gradient: a saliency map,
adversarial training, input optimization; its model's conv1 then runs on cuDNN's stage, which computes
conv1's input gradient, where no kernel of ours does). Under an engine that cannot (``engine="ours"``:
no cuDNN), images that require a gradient are refused at the forward, in one line, before anything
changes; and a model made anew for a backward replaces the module's only once every operation of its
step is planned, so a backward that fails leaves the module as it was, able to train. Both are
torch.library custom operators with a fake (shapes only) implementation, so torch.compile(fullgraph=True) traces them, and the forward's
autograd formula is the backward operator. ``engine`` is the id of an ``_Engine``: one of our models
(lenet.model.LeNet) per module, device and batch-size bound, planned once per batch size as our
own step is (the search, the plan cache), under the module's engine, algorithm and fusion flags.

- Crossing: our plans are bound to the model's own buffers (what makes a step replayable), so the
  images and parameters are copied into them on the GPU, and the logits and gradients out of them
  into fresh tensors: one device-to-device memcpyAsync per tensor between its data_ptr() and our
  buffer (``_copy``), no host transfer and no array object made per call.
- Streams: our work waits for torch's current stream through an event, and torch's later work
  waits for ours the same way; the host never waits. Inside a torch CUDA graph capture it is
  captured with the rest (a batch size must be planned, by one call, before a capture).
- No operator per stage: the seam's stage 2 backward returns its input's gradient already masked
  by the input being > 0 (the previous stage's ReLU folded in: Note [relu at the pooled level] in
  lenet/engines/cudnn.py), and stage 1 computes none, so a stage as an operator would give a wrong input
  gradient for any input that is not a ReLU's output; the network is the unit whose gradients are
  exact.
- What the backward needs (the pooled outputs, our argmax bytes, fc1's outputs) stays in the
  model's buffers after the forward. The backward checks that the buffers still hold the forward
  of these images and parameters (the tensors' pointers and version counters, which a later
  forward or an in-place update changes); when they do not (two forwards before their backwards),
  it runs that forward again first.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

from . import params as P

IMAGE = (1, 28, 28)

# id -> engine: the operators take the id (an int crosses torch.compile). Held by its module alone: an
# engine, its model and the model's GPU memory go with the module; an id is never given twice.
_engines: "weakref.WeakValueDictionary[int, _Engine]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)


class _StreamPointer:
    """A torch stream's pointer under the CUDA stream protocol (what CuPy's Stream.from_external reads)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return 0, self.ptr


def _copy(stream, dst: int, src: int, nbytes: int) -> None:
    """One device-to-device copy of nbytes between two pointers (a torch tensor's data_ptr(), a CuPy
    array's data.ptr) on ``stream``: no array object made per call, and capturable in a graph."""
    import cupy

    cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)


def check_images(x: torch.Tensor, where: str = "lenet.torch.LeNet") -> None:
    """One-line ValueErrors for inputs our operators do not take."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{where} takes a torch.Tensor of images, got {type(x).__name__}")
    if x.dim() != 4 or tuple(x.shape[1:]) != IMAGE or x.shape[0] < 1:
        raise ValueError(f"{where} takes images of shape (N, 1, 28, 28) with N >= 1, got {tuple(x.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"{where} takes float32 images, got {str(x.dtype).replace('torch.', '')} "
                         f"(float16, bfloat16 and float64 are not supported: use x.float())")
    if not x.is_contiguous():
        raise ValueError(f"{where} takes contiguous images: these have strides {x.stride()} (use x.contiguous())")
    if x.device.type != "cuda":
        raise ValueError(f"{where} runs on CUDA tensors: the images are on {x.device} (move them with .cuda())")


def _check_params(params, device) -> None:
    if len(params) != len(P.NAMES):
        raise ValueError(f"lenet::forward takes the {len(P.NAMES)} parameters {', '.join(P.NAMES)}; got {len(params)}")
    for name, p in zip(P.NAMES, params):
        if tuple(p.shape) != tuple(P.SHAPES[name]) or p.dtype != torch.float32 or p.device != device \
                or not p.is_contiguous():
            raise ValueError(f"parameter {name} must be a contiguous float32 tensor of shape {tuple(P.SHAPES[name])} "
                             f"on {device}, got {str(p.dtype).replace('torch.', '')} {tuple(p.shape)} on {p.device}")


def _identity(x: torch.Tensor, params) -> tuple:
    """What the backward compares to know the buffers still hold this forward (Note [torch operators])."""
    return tuple((t.data_ptr(), t._version) for t in (x, *params)) + (x.shape[0],)


class _Engine:
    """One of our models for a module's flags, grown to the largest batch it has seen, on one device."""

    def __init__(self, engine: str, algo: str, fused: bool, plan_cache):
        from .engines import FLAGS, Policy

        if engine not in FLAGS:   # the registry's flags: auto, ours, legacy, graph
            raise ValueError(f"engine must be one of {', '.join(FLAGS)}, got {engine!r}")
        # A one-line ValueError for a name it does not know, or an engine its other arguments rule out.
        self.policy = Policy.parse(algo, engine=engine, fused=bool(fused))
        self.plan_cache = plan_cache
        self.model = None
        self.device = None
        self._streams, self._events = {}, None   # torch's streams as CuPy sees them; our two events
        self.held = None   # the identity of the forward whose activations the buffers hold
        self.no_input_grad = self.refuses_input_grad()   # why the images' gradient cannot be had, or None
        self.id = next(_ids)
        _engines[self.id] = self

    def refuses_input_grad(self) -> str | None:
        """Why no engine this module's policy lets compete computes the images' gradient (conv1's unmasked
        input gradient), or None: the registry's rules, asked without a GPU."""
        import dataclasses

        from .engines import registry
        from .model import STAGES
        from .ops import Stage

        stage = Stage(dataclasses.replace(STAGES[0], dx=True, dx_mask=False), None, 1, 1)
        engines, why = registry.serving(stage, self.policy)
        if engines:
            return None
        self.input_grad_flags = [f for f in registry.FLAGS
                                 if registry.serving(stage, self.policy.replace(engine=f))[0]]
        return "; ".join(f"{k}: {v}" for k, v in why.items())

    def check_input_grad(self) -> None:
        """A one-line ValueError where images that require a gradient cannot get it under this policy."""
        why = self.no_input_grad
        if why is not None:
            raise ValueError(f"lenet.torch.LeNet(engine={self.policy.engine!r}) cannot compute the images' gradient "
                             f"({why}): pass images that do not require one (x.detach()), or use engine="
                             + " or ".join(map(repr, self.input_grad_flags)))

    def _model(self, n: int, device: torch.device, input_grad: bool = False):
        """Our model on ``device`` for at least n images (made again: larger, for a larger batch; with the
        images' gradient, once it is asked for, and from then on). A model made anew replaces the old one
        only once its step for n is planned: where that fails the module keeps the model it had."""
        import cupy

        if self.model is not None and (device != self.device):
            raise ValueError(f"this module's engine runs on {self.device}; got tensors on {device} "
                             f"(one module per device)")
        old = self.model
        want = input_grad or (old is not None and old.input_grad)
        if old is None or n > old.max_batch or want != old.input_grad:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"batch size {n} (or the images' gradient) is new to this module inside a CUDA "
                                   f"graph capture: run one forward and backward of it before capturing (they plan it)")
            from .model import LeNet as Model

            if want:
                self.check_input_grad()
            cap = 64 if old is None else 2 * old.max_batch if n > old.max_batch else old.max_batch
            with cupy.cuda.Device(device.index):
                made = Model(max_batch=max(n, cap), policy=self.policy, cuda_graph=False,
                             plan_cache=self.plan_cache, input_grad=want)
                try:
                    made.plan(n)
                except BaseException:
                    made.close()
                    raise
            self.model, self.device, self.held = made, device, None
        return self.model

    def _step(self, model, n: int):
        if not model.planned(n) and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"batch size {n} is new to this module inside a CUDA graph capture: run one "
                               f"forward and backward of that size before capturing (they plan it)")
        return model.plan(n)

    def _enter(self, model):
        """Our stream waits for torch's current one (an event: the host does not wait)."""
        import cupy

        ptr = torch.cuda.current_stream().cuda_stream
        if self._streams.get(ptr) is None:
            self._streams[ptr] = cupy.cuda.Stream.from_external(_StreamPointer(ptr))
        if self._events is None:
            self._events = tuple(cupy.cuda.Event(block=False, disable_timing=True) for _ in range(2))
        torch_stream = self._streams[ptr]
        self._events[0].record(torch_stream)
        model.stream.wait_event(self._events[0])
        return torch_stream

    def _leave(self, model, torch_stream) -> None:
        self._events[1].record(model.stream)
        torch_stream.wait_event(self._events[1])

    @staticmethod
    def _load(model, x: torch.Tensor, params) -> None:
        """The images and parameters into the model's buffers (their shapes checked by the operator)."""
        _copy(model.stream, model.buf["x"].data.ptr, x.data_ptr(), x.numel() * 4)
        for name, p in zip(P.NAMES, params):
            _copy(model.stream, model.p[name].data.ptr, p.data_ptr(), p.numel() * 4)

    def forward(self, x: torch.Tensor, params) -> torch.Tensor:
        n = x.shape[0]
        with torch.cuda.device(x.device):
            model = self._model(n, x.device)
            step = self._step(model, n)
            logits = torch.empty((n, 10), dtype=torch.float32, device=x.device)
            s = self._enter(model)
            self._load(model, x, params)
            with model.stream:
                step.forward()
            _copy(model.stream, logits.data_ptr(), model.buf["logits"].data.ptr, logits.numel() * 4)
            self._leave(model, s)
            self.held = _identity(x, params)
        return logits

    def backward(self, dlogits: torch.Tensor, x: torch.Tensor, params, input_grad: bool = False) -> list[torch.Tensor]:
        n = x.shape[0]
        if tuple(dlogits.shape) != (n, 10):
            raise ValueError(f"lenet::backward: dlogits must have shape ({n}, 10), got {tuple(dlogits.shape)}")
        dlogits = dlogits.contiguous().float()
        with torch.cuda.device(x.device):
            model = self._model(n, x.device, input_grad)
            step = self._step(model, n)
            grads = [torch.empty(P.SHAPES[name], dtype=torch.float32, device=x.device) for name in P.NAMES]
            if input_grad:
                grads.append(torch.empty_like(x))
            s = self._enter(model)
            if self.held != _identity(x, params):   # another forward since: this one again (Note [torch operators])
                self._load(model, x, params)
                with model.stream:
                    step.forward()
                self.held = _identity(x, params)
            _copy(model.stream, model.buf["dlogits"].data.ptr, dlogits.data_ptr(), dlogits.numel() * 4)
            with model.stream:
                step.backward_given()
            for name, g in zip(P.NAMES, grads):
                _copy(model.stream, g.data_ptr(), model.g[name].data.ptr, g.numel() * 4)
            if input_grad:
                _copy(model.stream, grads[-1].data_ptr(), model.buf["dx"].data.ptr, grads[-1].numel() * 4)
            self._leave(model, s)
        return grads


def _engine(engine_id: int) -> _Engine:
    e = _engines.get(int(engine_id))
    if e is None:
        raise ValueError(f"no lenet.torch engine {engine_id}: make one with lenet.torch.LeNet(...)")
    return e


@torch.library.custom_op("lenet::forward", mutates_args=())
def forward_op(x: torch.Tensor, params: list[torch.Tensor], engine: int) -> torch.Tensor:
    """The logits (N, 10) of images x (N, 1, 28, 28) under the eight parameters (lenet.params.NAMES)."""
    check_images(x, "lenet::forward")
    _check_params(params, x.device)
    return _engine(engine).forward(x, params)


@forward_op.register_fake
def _(x, params, engine):
    return x.new_empty((x.shape[0], 10))


@torch.library.custom_op("lenet::backward", mutates_args=())
def backward_op(dlogits: torch.Tensor, x: torch.Tensor, params: list[torch.Tensor], engine: int,
                input_grad: bool = False) -> list[torch.Tensor]:
    """The eight parameter gradients from the logits' gradient (N, 10), for the forward of x and params,
    and with ``input_grad`` the images' gradient (N, 1, 28, 28) as a ninth."""
    check_images(x, "lenet::backward")
    _check_params(params, x.device)
    return _engine(engine).backward(dlogits, x, params, input_grad)


@backward_op.register_fake
def _(dlogits, x, params, engine, input_grad=False):
    return [torch.empty_like(p) for p in params] + ([torch.empty_like(x)] if input_grad else [])


def _setup_context(ctx, inputs, output):
    x, params, engine = inputs
    ctx.save_for_backward(x, *params)
    ctx.engine = engine


def _backward(ctx, dlogits):
    x, *params = ctx.saved_tensors
    want = bool(ctx.needs_input_grad[0])   # the images' gradient, only where asked for (Note [torch operators])
    grads = list(torch.ops.lenet.backward(dlogits, x, params, ctx.engine, want))
    return (grads[8] if want else None), grads[:8], None


forward_op.register_autograd(_backward, setup_context=_setup_context)


class LeNet(nn.Module):
    """LeNet-5 whose forward and backward run on our engines (Note [torch operators]); its
    parameters are nn.Parameters named and shaped as PyTorch's LeNet (conv1.weight ... fc2.bias), so
    state_dict, optimizers, schedulers and torch.save work as for any module, and our checkpoints
    and exports load with ``load_file``. ``forward(x)`` returns the logits.

    engine: auto (every engine competes, by measurement), legacy or graph (cuDNN only), ours;
    algo: heuristic, exhaustive, or a name train_step prints; fused: let operations fuse;
    plan_cache: keep choices on disk (True: the programs' file), as lenet.train does;
    seed: our initialization (lenet.params), the same as the programs' for that seed."""

    def __init__(self, engine: str = "auto", algo: str = "heuristic", fused: bool = True, plan_cache=True,
                 seed: int = 0):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(256, 120)
        self.fc2 = nn.Linear(120, 10)
        self.load_state_dict({k: torch.from_numpy(v) for k, v in P.init_host(seed).items()})
        self._engine = _Engine(engine, algo, fused, plan_cache)
        self.engine_name = engine

    def extra_repr(self) -> str:
        return f"engine={self.engine_name!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._engine.no_input_grad is not None and isinstance(x, torch.Tensor) and x.requires_grad \
                and torch.is_grad_enabled():
            self._engine.check_input_grad()   # one line, before anything changes (Note [torch operators])
        if not torch.compiler.is_compiling():
            check_images(x)
        params = [self.get_parameter(name) for name in P.NAMES]
        return torch.ops.lenet.forward(x, params, self._engine.id)

    def load_file(self, path) -> "LeNet":
        """Load our checkpoint (.npz from lenet.train: its moving average where it keeps one, as
        evaluation uses) or export (.safetensors or .npz from lenet.export) into the parameters."""
        from pathlib import Path

        import numpy as np

        from . import checkpoint

        path = Path(path)
        if path.suffix == ".safetensors":
            from safetensors.numpy import load_file

            state = load_file(str(path))
        else:
            try:
                state = checkpoint.state_dict(path)
            except checkpoint.CheckpointError as e:
                if "an export, perhaps" not in str(e):
                    raise
                with np.load(path, allow_pickle=False) as f:
                    state = {k: f[k] for k in f.files if k != "meta"}
        state = P.unpack(P.pack(state))   # checks names and shapes: one line naming what is wrong
        with torch.no_grad():
            for name, v in state.items():
                self.get_parameter(name).copy_(torch.from_numpy(np.ascontiguousarray(v)))
        return self
