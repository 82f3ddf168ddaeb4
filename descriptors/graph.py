"""cuDNN's graph API through nvidia-cudnn-frontend (``import cudnn``): one graph per
convolution direction, its execution plans listed with name and workspace, run on CuPy
arrays that are checked against the graph's tensors first.

    g = ConvGraph(handle, Direction.FORWARD, (64, 1, 28, 28), (6, 1, 5, 5), fuse="bias_relu")
    [(p.index, p.name, p.workspace_bytes) for p in g.plans]
    g.run(g.plans[0], g.pack({"x": x, "w": w, "b": b, "y": y}), workspace, handle)

Note [graph API frontend]: nvidia-cudnn-frontend 1.28 is pinned (1.29 and later require
nvidia-cutlass-dsl and apache-tvm-ffi). The frontend brings no libcudnn of its own: it
dlopens the one in the nvidia-cudnn wheel, which is the file descriptors/_lib.py loads;
``frontend()`` refuses to run when the two disagree, since a handle of one library
must never reach the other. The graph is built against our own cuDNN handle (wrapped
in ``cudnn.Handle``), and plans are run with the handle of the caller, as PyTorch runs
its cached plans with the current thread's handle. Each execute costs more host time than a
small batch's kernel (docs/probes.md, execute_overhead.py), so small batches are timed, and run,
inside CUDA graphs.

Note [graph execute]: the frontend's public ``execute_plan_at_index`` re-checks every note
filter against every plan on each call: about six times the host time per execute of the
lowered graph's own ``_execute_plan_at_index`` (docs/probes.md, execute_overhead.py; the call it
ends in, with the same {uid: pointer} pack, workspace pointer, backend plan index and raw
cudnnHandle_t). Plans are run through the latter; the pinned frontend (1.28) has it, and a
CPU test fails if a frontend without it is installed.

Note [graph plan filters]: exact float32 is the default. Plans whose numerical notes
say TENSOR_CORE or DOWN_CONVERT_INPUTS (TF32) are left out unless ``allow_tf32``, the
filter PyTorch applies (``filterEngineConfigs``); WINOGRAD ones unless
``allow_winograd`` (see Note [winograd precision]); NONDETERMINISTIC ones when
``deterministic``; and plans over ``workspace_limit`` bytes.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from . import _lib
from ._base import Owned
from .errors import CudnnError
from .tensor import check_array, data_type

FRONTEND_PACKAGE = "nvidia-cudnn-frontend"
FRONTEND_PIN = ">=1.28,<1.29"

FORWARD, BACKWARD_DATA, BACKWARD_FILTER = "fwd", "bwd-data", "bwd-filter"

# What each direction can fuse: forward with bias and ReLU, the data gradient with the
# ReLU gradient of the activation that fed the convolution.
FUSIONS = {FORWARD: ("", "bias_relu"), BACKWARD_DATA: ("", "drelu"), BACKWARD_FILTER: ("",)}

# The arrays of each graph, inputs first, the output last.
ROLES = {
    (FORWARD, ""): ("x", "w", "y"),
    (FORWARD, "bias_relu"): ("x", "w", "b", "y"),
    (BACKWARD_DATA, ""): ("dy", "w", "dx"),
    (BACKWARD_DATA, "drelu"): ("dy", "w", "act", "dx"),
    (BACKWARD_FILTER, ""): ("x", "dy", "dw"),
}


@functools.lru_cache(maxsize=None)
def frontend_version() -> str | None:
    """The installed nvidia-cudnn-frontend's version, from its package metadata without importing it (None
    where it is not installed); read once a process: a read took 2 ms, and a first run's plans asked ten times
    each (their stored choices' keys)."""
    import importlib.metadata

    try:
        return importlib.metadata.version(FRONTEND_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


class GraphUnavailable(ImportError):
    """The graph API cannot be used here (the frontend is missing, too old, or loaded another cuDNN)."""


@functools.lru_cache(maxsize=1)
def frontend():
    """The frontend's ``cudnn`` module, checked against the cuDNN that descriptors/ loaded."""
    ours = _lib.version()   # load libcudnn through cuda.pathfinder first
    hint = f"pip install '{FRONTEND_PACKAGE}{FRONTEND_PIN}'"
    try:
        import cudnn
    except ImportError as e:
        raise GraphUnavailable(f"cuDNN's graph API needs the Python package {FRONTEND_PACKAGE}, which is not "
                               f"installed ({e}); {hint}") from None
    version = tuple(int(v) for v in re.findall(r"\d+", getattr(cudnn, "__version__", "0"))[:2])
    if version < (1, 28):
        raise GraphUnavailable(f"{FRONTEND_PACKAGE} {cudnn.__version__} is too old for this project; {hint}")
    theirs = int(cudnn.backend_version())
    if theirs != ours:
        raise GraphUnavailable(f"{FRONTEND_PACKAGE} runs cuDNN {_lib.format_version(theirs)} but descriptors/ "
                               f"loaded cuDNN {_lib.format_version(ours)} from {_lib.library_path()}; "
                               f"they must be one library")
    return cudnn


def available() -> tuple[bool, str]:
    """(True, frontend version) when the graph API can be used, else (False, why not)."""
    try:
        return True, frontend().__version__
    except GraphUnavailable as e:
        return False, str(e)


def output_hw(h: int, w: int, r: int, s: int, pad, stride, dilation) -> tuple[int, int]:
    """A convolution's output height and width (cuDNN's formula)."""
    return tuple((i + 2 * p - ((f - 1) * d + 1)) // st + 1                       # type: ignore[return-value]
                 for i, f, p, st, d in zip((h, w), (r, s), pad, stride, dilation))


def _pair(v, what: str) -> tuple[int, int]:
    t = (v, v) if isinstance(v, int) else tuple(v)
    if len(t) != 2 or not all(isinstance(x, int) for x in t):
        raise ValueError(f"{what} must be an int or a pair of ints, got {v!r}")
    return t   # type: ignore[return-value]


def _packed(shape) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


_STATUS = re.compile(r"CUDNN_STATUS_[A-Z0-9_]+")


@functools.lru_cache(maxsize=1)
def _status_codes() -> dict[str, int]:
    codes = {}
    for base in range(0, 6000, 1000):
        for c in range(base, base + 100):
            name = _lib.status_name(c)
            if name.startswith("CUDNN_STATUS_") and name not in codes:
                codes[name] = c
    return codes


def graph_error(e: Exception, function: str, info: dict) -> CudnnError:
    """A frontend exception as a CudnnError: the status it names (NOT_SUPPORTED when it only
    says no engine fits), the frontend step, the shapes, and both messages."""
    text = str(e).strip()
    names = _STATUS.findall(text)
    cudnn = frontend()
    if names and names[-1] in _status_codes():
        name = names[-1]
    elif isinstance(e, cudnn.cudnnGraphNotSupportedError) or "not supported" in text.lower() \
            or "no valid engine" in text.lower():
        name = "CUDNN_STATUS_NOT_SUPPORTED"
    else:
        name = "CUDNN_STATUS_INTERNAL_ERROR"
    last = _lib.last_error_string()
    explanation = text + (f" | cuDNN: {last}" if last and last not in text else "")
    return CudnnError(_status_codes().get(name, 3000 if "NOT_SUPPORTED" in name else 4000), name, function,
                      info, explanation)


def _forget(e: BaseException) -> None:
    """Drop the tracebacks of a frontend exception and of those it chains to.

    Note [frontend failures]: the frontend keeps the exception of a failed create_execution_plans on its
    graph object (a pybind11 object, whose attributes the garbage collector does not traverse), and the
    exception's traceback holds every frame up to the caller's: a model, its planner and everything it
    made stayed alive with the graph (seen on an H100: conv2's data gradient with its ReLU fused, NCHW,
    which no engine supports, leaked each model that listed it)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__


def _forget_kept(g) -> None:
    """_forget every exception the frontend's graph object keeps among its attributes (1.28 keeps the
    backend's decline as ``_backend_declined``; looked for by type, not by name)."""
    for v in list(getattr(g, "__dict__", {}).values()):
        for item in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(item, BaseException):
                _forget(item)


def _frontend_handle(handle):
    """Our Handle as a ``cudnn.Handle`` (which wraps, and never destroys, a foreign cudnnHandle_t)."""
    if handle is None:
        return None
    fe = getattr(handle, "_frontend_handle", None)
    if fe is None or fe.backend_handle != handle.ptr:
        fe = frontend().Handle(handle.ptr, handle.device_id, handle.stream.ptr)
        handle._frontend_handle = fe
    fe.stream = handle.stream.ptr
    return fe


@dataclass(frozen=True)
class GraphPlan:
    """One execution plan of a ConvGraph that cuDNN built."""

    index: int
    name: str
    workspace_bytes: int
    backend_index: int   # its index in the lowered graph's own plan list (see Note [graph execute])


class ConvGraph(Owned):
    """One convolution direction as a cuDNN graph, float32 NCHW, with its built execution plans.

    ``direction``: "fwd" (x, w -> y), "bwd-data" (dy, w -> dx), "bwd-filter" (x, dy -> dw).
    ``fuse``: "bias_relu" (fwd: y = relu(conv + b)), "drelu" (bwd-data: dx = dgrad * (act > 0),
    act being the ReLU output that fed the convolution), or "".
    ``handle`` None validates the graph without planning it: the checks need no GPU.
    ``x_shape`` (N, C, H, W) and ``w_shape`` (K, C, R, S) describe the convolution in every
    direction. Plans that cuDNN lists but that the filters exclude or cuDNN cannot build are in
    ``rejected`` ({plan name: reason}). ``only``: build just the plan of that name (a stored
    choice) or at that index of cuDNN's list, the others left unbuilt; ``plans`` then holds
    it, or nothing and ``rejected`` says why. ``first``: build the listed plans in cuDNN's order until
    one builds, the rest left unbuilt (what the heuristic tries: Note [the heuristic's one plan]).

    Note [one plan]: building every listed plan of a graph (20 to 40 of them) took most of
    planning a batch size (docs/probes.md, first_graph.py), for one plan used when the choice comes from
    the plan cache: each build goes through the frontend's per-index exclusion check, which
    walks every listed plan again (scripts/probes/train_timeline.py --profile plan#1).

    Note [the heuristic's one plan]: a search under ``--algo heuristic`` tries each engine's first candidate
    that runs and is exact, so a first run (no stored choice) had built every listed plan of every graph it
    searched and tried the first. It now builds them in order until one builds (``first``), as a stored choice
    builds its one plan; the listed plans past it are built only by a search that times them (exhaustive), or
    that names one. A graph's first plan that builds can still be refused (not exact, as cuDNN 9.19's first
    deterministic weight-gradient plan for conv1 at 32 images is; a workspace past the free memory; an error when
    it runs): once every candidate offered at that size was tried, an engine left without one that passes (under
    --deterministic's rule, the first that passes: every engine, where none passed) takes a second look with its
    graphs' whole lists and tries the plans not yet tried in cuDNN's order (ConvSearch.picks in
    lenet/engines/cudnn.py), so the heuristic still finds a plan wherever one passes, at the cost of the whole
    lists there only. Where the model already made the whole graph (a listing of every plan name, say), the
    heuristic reads its whole list.
    """

    _kind = "Graph"

    def __init__(self, handle, direction: str, x_shape, w_shape, pad=0, stride=1, dilation=1, *,
                 fuse: str = "", allow_tf32: bool = False, allow_winograd: bool = False,
                 deterministic: bool = False, workspace_limit: int | None = None, dtype: str = "float32",
                 only: str | int | None = None, first: bool = False):
        cudnn = frontend()
        if direction not in FUSIONS:
            raise ValueError(f"unknown direction {direction!r}; use one of {', '.join(FUSIONS)}")
        if fuse not in FUSIONS[direction]:
            raise ValueError(f"{direction} cannot fuse {fuse!r}; it fuses: "
                             f"{', '.join(repr(f) for f in FUSIONS[direction] if f) or 'nothing'}")
        if data_type(dtype) != data_type("float32"):
            raise ValueError(f"the graph engine runs float32 only, got {dtype}")
        x_shape, w_shape = tuple(int(d) for d in x_shape), tuple(int(d) for d in w_shape)
        if len(x_shape) != 4 or len(w_shape) != 4 or min(x_shape + w_shape) < 1:
            raise ValueError(f"x must be (N, C, H, W) and w (K, C, R, S), all >= 1; got {x_shape} and {w_shape}")
        if x_shape[1] != w_shape[1]:
            raise ValueError(f"x has {x_shape[1]} channels, w expects {w_shape[1]}")
        self.pad, self.stride, self.dilation = _pair(pad, "pad"), _pair(stride, "stride"), _pair(dilation, "dilation")
        if min(self.pad) < 0 or min(self.stride) < 1 or min(self.dilation) < 1:
            raise ValueError(f"pad must be >= 0, stride and dilation >= 1; got {self.pad}, {self.stride}, "
                             f"{self.dilation}")
        p, q = output_hw(*x_shape[2:], *w_shape[2:], self.pad, self.stride, self.dilation)
        if p < 1 or q < 1:
            raise ValueError(f"a {w_shape[2:]} filter with dilation {self.dilation} does not fit the "
                             f"{x_shape[2:]} input padded by {self.pad}")
        n, c, h, w = x_shape
        k = w_shape[0]
        self.direction, self.fuse = direction, fuse
        self.x_shape, self.w_shape, self.y_shape = x_shape, w_shape, (n, k, p, q)
        self.shapes = {"x": x_shape, "w": w_shape, "y": self.y_shape, "b": (1, k, 1, 1), "dy": self.y_shape,
                       "dx": x_shape, "act": x_shape, "dw": w_shape}
        self.roles = ROLES[(direction, fuse)]
        self.filters = {"allow_tf32": allow_tf32, "allow_winograd": allow_winograd,
                        "deterministic": deterministic, "workspace_limit": workspace_limit}
        self.info = {"direction": direction, "fuse": fuse or "none", "x": x_shape, "w": w_shape, "y": self.y_shape,
                     "pad": self.pad, "stride": self.stride, "dilation": self.dilation}
        self._handle = handle   # plans are finalized against it: keep it alive with them
        g, self._uids = self._build_graph(cudnn, handle)
        self._box = {"graph": g}   # close() drops the frontend graph (and its plans) at once
        self.plans: list[GraphPlan] = []
        self.rejected: dict[str, str] = {}
        self._own(id(self), self._box.clear)
        if handle is not None:   # without a handle the graph is validated, not planned (no GPU needed)
            self._make_plans(cudnn, only, first)

    @property
    def _g(self):
        self._check_open()
        return self._box["graph"]

    # ------------------------------------------------------------------ building

    def _build_graph(self, cudnn, handle):
        f32 = cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=f32, intermediate_data_type=f32, compute_data_type=f32,
                          handle=_frontend_handle(handle))
        conv = dict(padding=list(self.pad), stride=list(self.stride), dilation=list(self.dilation))

        def tensor(role):
            s = self.shapes[role]
            return g.tensor(name=role, dim=list(s), stride=_packed(s), data_type=f32)

        def output(t, role):
            s = self.shapes[role]
            return t.set_output(True).set_dim(list(s)).set_stride(_packed(s)).set_data_type(f32)

        t = {}
        try:
            if self.direction == FORWARD:
                t["x"], t["w"] = tensor("x"), tensor("w")
                y = g.conv_fprop(image=t["x"], weight=t["w"], **conv)
                if self.fuse == "bias_relu":
                    t["b"] = tensor("b")
                    y.set_dim(list(self.y_shape)).set_stride(_packed(self.y_shape))
                    y = g.relu(input=g.bias(input=y, bias=t["b"]))
                t["y"] = output(y, "y")
            elif self.direction == BACKWARD_DATA:
                t["dy"], t["w"] = tensor("dy"), tensor("w")
                dx = g.conv_dgrad(loss=t["dy"], filter=t["w"], **conv)
                if self.fuse == "drelu":
                    t["act"] = tensor("act")
                    dx.set_dim(list(self.x_shape)).set_stride(_packed(self.x_shape))
                    dx = g.relu_backward(loss=dx, input=t["act"])
                t["dx"] = output(dx, "dx")
            else:
                t["x"], t["dy"] = tensor("x"), tensor("dy")
                t["dw"] = output(g.conv_wgrad(image=t["x"], loss=t["dy"], **conv), "dw")
            g.validate()
        except Exception as e:  # the frontend raises RuntimeError / its own errors; say what and where
            _forget(e)   # Note [frontend failures]
            raise graph_error(e, "cudnn_frontend validate", self.info) from None
        return g, {role: t[role].uid for role in self.roles}

    def _make_plans(self, cudnn, only: str | int | None = None, first: bool = False) -> None:
        try:
            self._plans(cudnn, only, first)
        finally:
            _forget_kept(self._g)   # Note [frontend failures]

    def _plans(self, cudnn, only: str | int | None = None, first: bool = False) -> None:
        g, notes = self._g, cudnn.numerical_note
        try:
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        except Exception as e:
            _forget(e)   # Note [frontend failures]
            err = graph_error(e, "cudnn_frontend create_execution_plans", self.info)
            if err.is_not_supported:   # no engine for this graph: no plans, not a failure
                self.rejected["(every plan)"] = err.explanation.splitlines()[0][:300]
                return
            raise err from None
        drop = []
        if not self.filters["allow_tf32"]:
            drop += [notes.TENSOR_CORE, notes.DOWN_CONVERT_INPUTS]
        if not self.filters["allow_winograd"]:
            drop += [notes.WINOGRAD, notes.WINOGRAD_TILE_4x4, notes.WINOGRAD_TILE_6x6, notes.WINOGRAD_TILE_13x13]
        if self.filters["deterministic"]:
            drop.append(notes.NONDETERMINISTIC)
        if drop:
            g.deselect_numeric_notes(drop)
        if self.filters["workspace_limit"] is not None:
            g.deselect_workspace_greater_than(int(self.filters["workspace_limit"]))
        for i in range(g.get_execution_plan_count()):
            if only is not None and (i != only if isinstance(only, int) else self._name_at(i) != only):
                continue   # Note [one plan]
            try:
                g.build_plan_at_index(i)
                self.plans.append(GraphPlan(i, g.get_plan_name_at_index(i), int(g.get_workspace_size_plan_at_index(i)),
                                            g.plans[i].cpp_index))
            except Exception as e:  # filtered out, or cuDNN could not build it: recorded, not raised
                _forget(e)   # Note [frontend failures]
                text = str(e).strip()
                self.rejected[self._name_at(i)] = text.splitlines()[0][:200] if text else type(e).__name__
            if only is not None or (first and self.plans):   # Notes [one plan], [the heuristic's one plan]
                return
        if only is not None:
            self.rejected[str(only)] = "not listed by cuDNN for this graph"

    def _name_at(self, i: int) -> str:
        try:
            return self._g.get_plan_name_at_index(i)
        except Exception:  # noqa: BLE001 - a name for a message or a comparison only
            return f"plan {i}"

    # ------------------------------------------------------------------ running

    def plan_named(self, name: str) -> GraphPlan:
        for p in self.plans:
            if p.name == name:
                return p
        raise KeyError(name)

    def pack(self, arrays: dict, device_id: int | None = None) -> dict[int, int]:
        """{uid: device pointer} for ``arrays`` (role -> CuPy array), each checked against its tensor."""
        missing = [r for r in self.roles if r not in arrays]
        if missing:
            raise ValueError(f"{self.direction} graph needs arrays {', '.join(self.roles)}; missing {', '.join(missing)}")
        f32 = data_type("float32")
        return {self._uids[r]: check_array(arrays[r], r, self.shapes[r], f32, device_id) for r in self.roles}

    def run(self, plan: GraphPlan, pack: dict[int, int], workspace, handle) -> None:
        """Execute ``plan`` on a pack from ``pack()`` (the arrays checked once, run many times) with
        ``workspace`` (a Workspace, or None) on ``handle``'s stream."""
        self._check_open()
        size = workspace.size if workspace is not None else 0
        if plan.workspace_bytes > size:
            raise ValueError(f"graph plan {plan.name} needs a workspace of {plan.workspace_bytes} bytes, "
                             f"the one given has {size}")
        try:   # see Note [graph execute]
            self._g._lowered_graph._execute_plan_at_index(pack, workspace.ptr if workspace is not None else 0,
                                                          plan.backend_index, handle.ptr)
        except Exception as e:
            _forget(e)   # Note [frontend failures]
            raise graph_error(e, f"cudnn_frontend execute (plan {plan.name})", self.info) from None

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.plans)} plans"
        return (f"ConvGraph({self.direction}{'+' + self.fuse if self.fuse else ''}, x={self.x_shape}, "
                f"w={self.w_shape}, pad={self.pad}, stride={self.stride}, dilation={self.dilation}, {state})")


__all__ = ["ConvGraph", "GraphPlan", "GraphUnavailable", "frontend", "available", "output_hw", "graph_error",
           "FUSIONS", "ROLES", "FRONTEND_PACKAGE", "FRONTEND_PIN"]
