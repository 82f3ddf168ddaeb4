"""A convolution problem, and cuDNN's two APIs as sources of candidates for it, behind one interface.

    spec = ConvSpec("fwd", 64, (1, 28, 28), (6, 1, 5, 5), epilogue="bias_relu")
    convs = LegacyConvs(name)                 # or GraphConvs(name): each holds the cuDNN objects it made,
                                              # its candidates' ``engine`` the caller's name for it
    candidates, excluded = convs.candidates(handle, spec, policy, fused=True)
    run = convs.bind(handle, spec, candidates[0], arrays, workspace)   # a zero-argument launcher
    run()
    convs.close()

Sources never choose: the caller times and checks their candidates (lenet/plan.py does, against
descriptors/exact.py's reference). ``legacy`` is the descriptor API (descriptors/convolution.py),
``graph`` the graph API (descriptors/graph.py). A source's cuDNN objects (descriptors, graphs with
their plans) are its own, made on first use and closed by ``close()``: whoever owns the source
owns them, and two owners share nothing.

Epilogues: "bias_relu" (forward: y = relu(conv(x, w) + b)) and "drelu" (data gradient:
dx = dgrad(dy, w) * (act > 0), act being the ReLU output that fed the convolution). A
candidate either runs its epilogue inside the convolution's own call (``fused``) or after it,
as cuDNN's add-tensor and activation calls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .activation import ActivationDescriptor
from .algorithms import AlgoPolicy, AlgoResult, Direction, _filter_reason, supported_algorithms
from .convolution import ConvolutionDescriptor
from .graph import FUSIONS, ROLES, ConvGraph, output_hw
from .tensor import FilterDescriptor, TensorDescriptor, add_tensor

# Roles whose first dimension is the batch: chunks slice these.
BATCH_ROLES = frozenset({"x", "y", "dy", "dx", "act"})


def _ints(v, n: int, what: str) -> tuple[int, ...]:
    t = (v,) * n if isinstance(v, int) else tuple(v)
    if len(t) != n or not all(isinstance(i, int) for i in t):
        raise ValueError(f"{what} must be {n} integers, got {v!r}")
    return t


@dataclass(frozen=True)
class ConvSpec:
    """One convolution direction at one batch size, with its epilogue: pointer-free, a cache key.

    ``x`` is the input's (C, H, W) and ``w`` the filter's (K, C, R, S) in every direction.
    """

    direction: str
    n: int
    x: tuple
    w: tuple
    pad: tuple = (0, 0)
    stride: tuple = (1, 1)
    dilation: tuple = (1, 1)
    epilogue: str = ""
    dtype: str = "float32"

    def __post_init__(self):
        d = Direction(self.direction).value
        object.__setattr__(self, "direction", d)
        for name, n in (("x", 3), ("w", 4), ("pad", 2), ("stride", 2), ("dilation", 2)):
            object.__setattr__(self, name, _ints(getattr(self, name), n, name))
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"batch size must be an integer >= 1, got {self.n!r}")
        if self.epilogue not in FUSIONS[d]:
            raise ValueError(f"{d} has no epilogue {self.epilogue!r}; it takes: "
                             f"{', '.join(repr(f) for f in FUSIONS[d] if f) or 'none'}")
        if self.x[0] != self.w[1]:
            raise ValueError(f"x has {self.x[0]} channels, w expects {self.w[1]}")
        if min(self.x + self.w) < 1 or min(self.pad) < 0 or min(self.stride + self.dilation) < 1:
            raise ValueError(f"bad convolution: x {self.x}, w {self.w}, pad {self.pad}, stride {self.stride}, "
                             f"dilation {self.dilation}")
        if min(self.out_hw) < 1:
            raise ValueError(f"a {self.w[2:]} filter with dilation {self.dilation} does not fit the "
                             f"{self.x[1:]} input padded by {self.pad}")

    @property
    def out_hw(self) -> tuple[int, int]:
        return output_hw(*self.x[1:], *self.w[2:], self.pad, self.stride, self.dilation)

    @property
    def x_shape(self) -> tuple:
        return (self.n, *self.x)

    @property
    def y_shape(self) -> tuple:
        return (self.n, self.w[0], *self.out_hw)

    @property
    def roles(self) -> tuple[str, ...]:
        """The arrays of this problem, inputs first, the output last."""
        return ROLES[(self.direction, self.epilogue)]

    @property
    def output(self) -> str:
        return self.roles[-1]

    def shape(self, role: str) -> tuple:
        return {"x": self.x_shape, "w": self.w, "y": self.y_shape, "b": (1, self.w[0], 1, 1), "dy": self.y_shape,
                "dx": self.x_shape, "act": self.x_shape, "dw": self.w}[role]

    def at(self, n: int) -> "ConvSpec":
        return dataclasses.replace(self, n=int(n))

    def __str__(self) -> str:
        ep = f"+{self.epilogue}" if self.epilogue else ""
        return f"{self.direction}{ep} x{self.x_shape} w{self.w}"


@dataclass(frozen=True)
class Candidate:
    """One way to run a ConvSpec: an engine's algorithm or plan, with or without its epilogue fused."""

    engine: str                 # the name its source was given by its caller (an engine's; "" unnamed)
    name: str                   # the algorithm or plan, as cuDNN names it
    fused: bool                 # the epilogue inside the convolution's call
    workspace_bytes: int
    deterministic: bool | None  # None: not known (graph plans outside deterministic mode)
    math: str                   # "fp32", or "tf32" where TF32 tensor cores may be used
    key: tuple = ()             # the engine's own handle on it

    @property
    def label(self) -> str:
        return f"{self.engine}:{self.name}{' (fused)' if self.fused else ''}"


class _Epilogue:
    """cuDNN's add-tensor and activation calls that finish an unfused candidate."""

    def __init__(self, spec: ConvSpec):
        self.bd = TensorDescriptor(spec.shape("b"))
        self.yd = TensorDescriptor(spec.y_shape)
        self.xd = TensorDescriptor(spec.x_shape)
        self.relu = ActivationDescriptor("relu")

    def bias_relu(self, h, b, y) -> None:
        add_tensor(h, self.bd, b, self.yd, y)
        self.relu.forward(h, self.yd, y, self.yd, y)

    def close(self) -> None:
        for o in (self.bd, self.yd, self.xd, self.relu):
            o.close()

    def drelu(self, h, act, dx) -> None:
        # dx *= (act > 0): ReLU's backward given its output act (see Note [relu at the pooled level]
        # in lenet/engines/cudnn.py for why act may be a pooled tensor).
        self.relu.backward(h, self.xd, act, self.xd, dx, self.xd, act, self.xd, dx)


class _Cache:
    """cuDNN objects by key, closed together by ``clear``."""

    def __init__(self):
        self._d: dict = {}

    def get(self, key, make):
        obj = self._d.get(key)
        if obj is None:
            obj = self._d[key] = make()
        return obj

    def peek(self, key):
        return self._d.get(key)

    def clear(self) -> None:
        for obj in self._d.values():
            for o in (obj if isinstance(obj, tuple) else (obj,)):
                close = getattr(o, "close", None)
                if close is not None:
                    close()
        self._d.clear()


def _epilogue(cache: _Cache, spec: ConvSpec) -> _Epilogue:
    key = ("epilogue", dataclasses.replace(spec, direction="fwd", epilogue=""))
    return cache.get(key, lambda: _Epilogue(spec))


class _LegacyConv:
    """The descriptor API's objects for one ConvSpec and one math mode."""

    def __init__(self, spec: ConvSpec, tf32: bool):
        self.conv = ConvolutionDescriptor(pad=spec.pad, stride=spec.stride, dilation=spec.dilation,
                                          math_type="default" if tf32 else "fma")
        self.xd, self.wd, self.yd = TensorDescriptor(spec.x_shape), FilterDescriptor(spec.w), \
            TensorDescriptor(spec.y_shape)
        self.direction = Direction(spec.direction)
        self._supported: list[AlgoResult] | None = None

    def operands(self):
        return {Direction.FORWARD: (self.xd, self.wd, self.yd), Direction.BACKWARD_DATA: (self.wd, self.yd, self.xd),
                Direction.BACKWARD_FILTER: (self.xd, self.yd, self.wd)}[self.direction]

    def supported(self, handle) -> list[AlgoResult]:
        if self._supported is None:
            self._supported = supported_algorithms(handle, self.direction, self.conv, *self.operands())
        return self._supported

    def algo(self, handle, name: str) -> AlgoResult:
        return next(r for r in self.supported(handle) if r.name == name)

    def close(self) -> None:
        for o in (self.conv, self.xd, self.wd, self.yd):
            o.close()


class LegacyConvs:
    """cuDNN's descriptor API: its algorithms, each with the epilogue fused
    (cudnnConvolutionBiasActivationForward, forward only) or after it. ``name``: what its candidates'
    ``engine`` says (the caller's name for this source; unnamed by default)."""

    def __init__(self, name: str = ""):
        self.name = name
        self._convs = _Cache()

    def _conv(self, handle, spec: ConvSpec, tf32: bool) -> _LegacyConv:
        # Per device: what cuDNN supports (``supported``) is asked of the handle's GPU.
        return self._convs.get((handle.device_id, spec, tf32), lambda: _LegacyConv(spec, tf32))

    def candidates(self, handle, spec: ConvSpec, policy: AlgoPolicy, fused: bool = True, first: bool = False):
        """(candidates in cuDNN's heuristic order, {name: why excluded}). ``first`` changes nothing here: the
        descriptor API lists its algorithms in one query, and a candidate costs nothing until it runs."""
        lc = self._conv(handle, spec, policy.allow_tf32)
        fixed = policy.fixed(spec.direction)
        out, excluded = [], {}
        forms = (True, False) if (spec.epilogue == "bias_relu" and fused) else (False,)
        for r in lc.supported(handle):
            why = _filter_reason(r, policy, fixed)
            if why:
                excluded[r.name] = why
                continue
            math = "tf32" if r.math_type.startswith("tensor_op") else "fp32"
            out += [Candidate(self.name, r.name, f, r.workspace_bytes, r.deterministic, math, (policy.allow_tf32,))
                    for f in forms]
        return out, excluded

    def offers(self, handle, spec: ConvSpec, cand: Candidate, policy: AlgoPolicy, fused: bool = True) -> bool:
        """Whether ``cand`` is among candidates(handle, spec, policy, fused)."""
        return cand in self.candidates(handle, spec, policy, fused)[0]

    def bind(self, handle, spec: ConvSpec, cand: Candidate, arrays: dict, workspace):
        """A zero-argument launcher of ``cand`` on ``arrays`` (role -> CuPy array)."""
        lc = self._conv(handle, spec, cand.key[0])
        algo, conv, h = lc.algo(handle, cand.name), lc.conv, handle
        xd, wd, yd = lc.xd, lc.wd, lc.yd
        ep = _epilogue(self._convs, spec) if spec.epilogue else None
        a = arrays
        if spec.direction == "fwd":
            if cand.fused:
                return lambda: conv.bias_activation_forward(h, xd, a["x"], wd, a["w"], ep.bd, a["b"], ep.relu, yd,
                                                            a["y"], algo, workspace)

            def fwd():
                conv.forward(h, xd, a["x"], wd, a["w"], yd, a["y"], algo, workspace)
                if ep is not None:
                    ep.bias_relu(h, a["b"], a["y"])
            return fwd
        if spec.direction == "bwd-data":
            def dgrad():
                conv.backward_data(h, wd, a["w"], yd, a["dy"], xd, a["dx"], algo, workspace)
                if ep is not None:
                    ep.drelu(h, a["act"], a["dx"])
            return dgrad
        return lambda: conv.backward_filter(h, xd, a["x"], yd, a["dy"], wd, a["dw"], algo, workspace)

    def close(self) -> None:
        self._convs.clear()


class GraphConvs:
    """cuDNN's graph API: the execution plans of one graph per direction, the epilogue in the
    graph (fused) or after it. ``name``: what its candidates' ``engine`` says (the caller's name for this
    source; unnamed by default)."""

    def __init__(self, name: str = ""):
        self.name = name
        self._graphs = _Cache()

    @staticmethod
    def filters(policy: AlgoPolicy) -> tuple:
        return (policy.allow_tf32, policy.allow_winograd, policy.deterministic, policy.workspace_limit)

    def graph(self, handle, spec: ConvSpec, fuse: str, filters: tuple, only: str | None = None,
              first: bool = False) -> ConvGraph:
        """The graph of (spec, fuse) under filters with every listed plan built, or, with no such graph made
        yet: with ``only``, one with just that plan built (Note [one plan] in descriptors/graph.py); with
        ``first``, one with its first plan that builds (Note [the heuristic's one plan]), kept under that
        plan's name too, so that binding it builds no second graph."""
        tf32, winograd, deterministic, limit = filters
        key = (handle.device_id, spec, fuse, filters)
        whole = self._graphs.peek(key)
        if whole is not None:
            return whole

        def make():
            return ConvGraph(handle, spec.direction, spec.x_shape, spec.w, spec.pad, spec.stride, spec.dilation,
                             fuse=fuse, allow_tf32=tf32, allow_winograd=winograd, deterministic=deterministic,
                             workspace_limit=limit, only=only, first=first and only is None)
        if only is None and first:
            g = self._graphs.get((*key, "(first)"), make)
            for p in g.plans:
                self._graphs.get((*key, p.name), lambda: g)
            return g
        return self._graphs.get(key if only is None else (*key, only), make)

    def _candidate(self, plan, fused: bool, policy: AlgoPolicy) -> Candidate:
        return Candidate(self.name, plan.name, fused, plan.workspace_bytes, True if policy.deterministic else None,
                         "tf32" if policy.allow_tf32 else "fp32", self.filters(policy))

    def candidates(self, handle, spec: ConvSpec, policy: AlgoPolicy, fused: bool = True, first: bool = False):
        """(candidates, fused plans first, each graph's in cuDNN's heuristic order; {name: why excluded}).
        ``first``: each graph's first plan that builds only (Note [the heuristic's one plan] in
        descriptors/graph.py)."""
        filters = self.filters(policy)
        out, excluded = [], {}
        for fuse in ((spec.epilogue, "") if (spec.epilogue and fused) else ("",)):
            g = self.graph(handle, spec, fuse, filters, first=first)
            out += [self._candidate(p, bool(fuse), policy) for p in g.plans]
            excluded.update({name: why for name, why in g.rejected.items() if name not in excluded})
        return out, excluded

    def offers(self, handle, spec: ConvSpec, cand: Candidate, policy: AlgoPolicy, fused: bool = True) -> bool:
        """Whether ``cand`` is among candidates(handle, spec, policy, fused), building its plan
        alone (a stored choice: Note [one plan])."""
        if cand.fused and not (spec.epilogue and fused):
            return False
        g = self.graph(handle, spec, spec.epilogue if cand.fused else "", self.filters(policy), only=cand.name)
        return any(self._candidate(p, cand.fused, policy) == cand for p in g.plans if p.name == cand.name)

    def bind(self, handle, spec: ConvSpec, cand: Candidate, arrays: dict, workspace):
        g = self.graph(handle, spec, spec.epilogue if cand.fused else "", cand.key, only=cand.name)
        plan = g.plan_named(cand.name)
        pack = g.pack({r: arrays[r] for r in g.roles}, handle.device_id)   # checked once, here
        ep = _epilogue(self._graphs, spec) if (spec.epilogue and not cand.fused) else None
        if ep is None:
            return lambda: g.run(plan, pack, workspace, handle)
        a = arrays
        finish = (lambda: ep.bias_relu(handle, a["b"], a["y"])) if spec.epilogue == "bias_relu" else \
            (lambda: ep.drelu(handle, a["act"], a["dx"]))

        def run():
            g.run(plan, pack, workspace, handle)
            finish()
        return run

    def close(self) -> None:
        self._graphs.clear()


__all__ = ["ConvSpec", "Candidate", "LegacyConvs", "GraphConvs", "BATCH_ROLES"]
