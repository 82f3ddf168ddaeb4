"""The descriptor API's convolution algorithms (names, ids, what cuDNN supports for a shape,
workspace sizes), the policy that filters them and the graph API's plans, and the workspace
every convolution shares. Candidates are listed in descriptors/candidates.py; choosing among them
is the caller's (lenet's planner).

Policies, per direction:
  heuristic   each engine's first-ranked candidate that runs (cuDNN's own ranking)
  exhaustive  every candidate timed on the GPU
  NAME        one fixed algorithm as cuDNN names it (``implicit_gemm``, ``fft``, ``algo_1``...)
              or one graph-API plan as train_step prints it (``eng18_k11=0``)
A workspace limit, a deterministic-only switch, Winograd and TF32 opt-ins filter the
candidates.

Note [winograd precision]: measured with cuDNN 9.19 (scripts/algo_errors.py; docs/numerics.md),
every float32 algorithm agrees with a float64 reference to ~1e-6 (norm-wise relative),
as PyTorch's own float32 convolutions do, except the Winograd family: winograd_nonfused
is off by 4e-4..1.2e-3. heuristic and exhaustive therefore pass over winograd and
winograd_nonfused unless ``allow_winograd`` is set; naming one fixes it regardless.

Note [algorithm fallback]: a candidate is dropped only when cuDNN reports it
NOT_SUPPORTED (any 3000-range status) or as failing to allocate; a BAD_PARAM is a bug
in the caller and is raised, never skipped. While searching, a candidate whose kernel cuDNN
cannot launch for the shape is dropped too (EXECUTION_FAILED, 5000-range): seen on an H100
for TF32 graph plan eng71 of conv1's forward at 65536 images (EXECUTION_FAILED_CUDA_DRIVER).
"""

from __future__ import annotations

import enum
import re
from ctypes import byref, c_int, c_size_t
from dataclasses import dataclass

from . import _lib
from ._lib import AlgoPerf, ConvolutionBwdDataAlgo, ConvolutionBwdFilterAlgo, ConvolutionFwdAlgo, MathType
from .convolution import math_type_name
from .errors import CudnnError


class Direction(str, enum.Enum):
    FORWARD = "fwd"
    BACKWARD_DATA = "bwd-data"
    BACKWARD_FILTER = "bwd-filter"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class _Calls:
    """The cuDNN functions of one direction. All three share one argument order:
    (descA, descB, conv, descOut), where A, B, Out are
      fwd:        x,  w,  y
      bwd-data:   w,  dy, dx
      bwd-filter: x,  dy, dw
    """
    algos: type[enum.IntEnum]
    max_count: str
    get: str
    workspace_size: str
    operands: tuple[str, str, str]


CALLS: dict[Direction, _Calls] = {
    Direction.FORWARD: _Calls(
        ConvolutionFwdAlgo, "cudnnGetConvolutionForwardAlgorithmMaxCount",
        "cudnnGetConvolutionForwardAlgorithm_v7", "cudnnGetConvolutionForwardWorkspaceSize", ("x", "w", "y")),
    Direction.BACKWARD_DATA: _Calls(
        ConvolutionBwdDataAlgo, "cudnnGetConvolutionBackwardDataAlgorithmMaxCount",
        "cudnnGetConvolutionBackwardDataAlgorithm_v7", "cudnnGetConvolutionBackwardDataWorkspaceSize",
        ("w", "dy", "dx")),
    Direction.BACKWARD_FILTER: _Calls(
        ConvolutionBwdFilterAlgo, "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount",
        "cudnnGetConvolutionBackwardFilterAlgorithm_v7", "cudnnGetConvolutionBackwardFilterWorkspaceSize",
        ("x", "dy", "dw")),
}

# Algorithm names as cuDNN names them, lower case: {"implicit_gemm": 0, ...} per direction.
ALGORITHM_NAMES: dict[Direction, dict[str, int]] = {
    d: {m.name.lower(): int(m) for m in c.algos} for d, c in CALLS.items()
}

POLICIES = ("heuristic", "exhaustive")

_PREFIXES = {Direction.FORWARD: "cudnn_convolution_fwd_algo_",
             Direction.BACKWARD_DATA: "cudnn_convolution_bwd_data_algo_",
             Direction.BACKWARD_FILTER: "cudnn_convolution_bwd_filter_algo_"}


class UnknownAlgorithmError(ValueError):
    """An algorithm name cuDNN does not have for that direction."""


class AlgorithmNotSupportedError(ValueError):
    """A named algorithm that cuDNN does not support for this shape (or the filters exclude)."""


def algorithm_name(direction: Direction, algo: int) -> str:
    return CALLS[Direction(direction)].algos(int(algo)).name.lower()


def algorithm_id(direction: Direction, name: str) -> int:
    """The enum value of ``name`` in ``direction``; case-insensitive, the CUDNN_... prefix optional."""
    d = Direction(direction)
    key = str(name).strip().lower()
    if key.startswith(_PREFIXES[d]):
        key = key[len(_PREFIXES[d]):]
    elif key.isdigit() and f"algo_{key}" in ALGORITHM_NAMES[d]:
        key = f"algo_{key}"  # "1" for algo_1
    try:
        return ALGORITHM_NAMES[d][key]
    except KeyError:
        raise UnknownAlgorithmError(
            f"unknown {d} algorithm {name!r}; cuDNN's {d} algorithms are: "
            f"{', '.join(ALGORITHM_NAMES[d])}") from None


# Graph-API plan names as cuDNN reports them: eng0, eng18_k11=0, eng70_k2=12_k18=1.
_GRAPH_PLAN = re.compile(r"eng\d+(?:_k\d+=-?\d+)*")


def is_graph_plan_name(name: str) -> bool:
    return bool(_GRAPH_PLAN.fullmatch(str(name).strip().lower()))


def check_choice(direction: Direction, value: str) -> str:
    """``value`` as a choice of ``direction``: a policy, a graph-API plan name, or a descriptor-API
    algorithm of that direction (normalized); UnknownAlgorithmError otherwise."""
    v = str(value).strip().lower()
    if v in POLICIES or is_graph_plan_name(v):
        return v
    try:
        return algorithm_name(direction, algorithm_id(direction, v))
    except UnknownAlgorithmError as e:
        raise UnknownAlgorithmError(f"{e}, or a graph-API plan name as train_step prints it (e.g. eng0)") from None


def parse_choices(spec: str, pins=None) -> dict[str, str]:
    """The per-direction choices an algorithm spec names: ``heuristic`` | ``exhaustive`` | ``NAME`` |
    ``fwd=NAME,bwd-data=NAME,bwd-filter=NAME`` (AlgoPolicy's fields -> names; a direction left out uses
    the heuristic).

    A single descriptor-API NAME applies to every direction that has an algorithm of that name (``fft``
    to all three, ``implicit_gemm`` to the forward one); a single graph-API plan name to all three.
    ``pins(name)``, when given, answers for names outside cuDNN (a caller's own candidates): the
    directions such a name fixes, or none where it is not one; this function keeps no such names itself.
    """
    spec = str(spec).strip()
    if not spec:
        raise ValueError("empty algorithm spec; use heuristic, exhaustive, an algorithm name, "
                         "or fwd=NAME,bwd-data=NAME,bwd-filter=NAME")
    theirs = tuple(pins(spec.lower())) if pins is not None else ()
    if theirs:   # one of another engine's candidates: the directions it names
        return {_FIELD[Direction(d)]: spec.lower() for d in theirs}
    if is_graph_plan_name(spec) or spec.lower() in POLICIES:
        return {f: spec.lower() for f in _FIELD.values()}
    kw: dict[str, str] = {}
    if "=" in spec:
        for part in spec.split(","):
            if "=" not in part:
                raise ValueError(f"algorithm spec part {part!r} is not DIRECTION=NAME "
                                 f"(directions: fwd, bwd-data, bwd-filter)")
            k, v = (s.strip().lower() for s in part.split("=", 1))
            try:
                d = Direction(k.replace("_", "-"))
            except ValueError:
                raise ValueError(f"unknown direction {k!r} in algorithm spec; use fwd, bwd-data, "
                                 f"bwd-filter") from None
            if _FIELD[d] in kw:
                raise ValueError(f"direction {d} is given twice in algorithm spec {spec!r}")
            kw[_FIELD[d]] = v
        return kw
    for d in Direction:
        try:
            kw[_FIELD[d]] = algorithm_name(d, algorithm_id(d, spec))
        except UnknownAlgorithmError:
            pass
    if not kw:
        names = sorted(set().union(*ALGORITHM_NAMES.values()))
        raise UnknownAlgorithmError(
            f"unknown algorithm {spec!r}; use heuristic, exhaustive, one of {', '.join(names)}, a graph-API plan "
            f"name (e.g. eng0){', a candidate name of another engine as train_step prints it' if pins else ''}, "
            f"or fwd=NAME,bwd-data=NAME,bwd-filter=NAME")
    return kw


@dataclass(frozen=True)
class AlgoPolicy:
    """How to choose each convolution direction among cuDNN's candidates, and what filters them.

    Each direction holds "heuristic", "exhaustive", a descriptor-API algorithm name or a graph-API
    plan name. ``workspace_limit`` in bytes (None: no limit); ``deterministic``: only what cuDNN marks
    deterministic; ``allow_winograd`` and ``allow_tf32``: let the less exact candidates compete. Which
    API may offer candidates, and everything else about running a network, is the caller's.
    """

    fwd: str = "heuristic"
    bwd_data: str = "heuristic"
    bwd_filter: str = "heuristic"
    workspace_limit: int | None = None
    deterministic: bool = False
    allow_winograd: bool = False
    allow_tf32: bool = False

    def __post_init__(self):
        for d in Direction:
            object.__setattr__(self, _FIELD[d], check_choice(d, getattr(self, _FIELD[d])))
        check_filters(self.workspace_limit)

    def choice(self, direction: Direction) -> str:
        return getattr(self, _FIELD[Direction(direction)])

    def fixed(self, direction: Direction) -> bool:
        return self.choice(direction) not in POLICIES

    @classmethod
    def parse(cls, spec: str, workspace_limit: int | None = None, deterministic: bool = False,
              allow_winograd: bool = False, *, allow_tf32: bool = False) -> "AlgoPolicy":
        """An AlgoPolicy from an algorithm spec (``parse_choices``) and the filters."""
        return cls(**parse_choices(spec), workspace_limit=workspace_limit, deterministic=deterministic,
                   allow_winograd=allow_winograd, allow_tf32=allow_tf32)

    def __str__(self) -> str:
        return describe_policy(self)


def check_filters(workspace_limit) -> None:
    if workspace_limit is not None and (not isinstance(workspace_limit, int) or workspace_limit < 0):
        raise ValueError(f"workspace limit must be a number of bytes >= 0, got {workspace_limit!r}")


def describe_policy(p, extra: str = "") -> str:
    """A policy's choices and filters in one line (``extra`` after the choices)."""
    s = ",".join(f"{d}={p.choice(d)}" for d in Direction)
    if len({p.choice(d) for d in Direction}) == 1:
        s = p.fwd
    s += extra
    if p.workspace_limit is not None:
        s += f" (workspace <= {p.workspace_limit} B)"
    if p.deterministic:
        s += " (deterministic)"
    if p.allow_winograd:
        s += " (winograd allowed)"
    if p.allow_tf32:
        s += " (tf32 allowed)"
    return s


_FIELD = {Direction.FORWARD: "fwd", Direction.BACKWARD_DATA: "bwd_data", Direction.BACKWARD_FILTER: "bwd_filter"}


@dataclass(frozen=True)
class AlgoResult:
    """One descriptor-API algorithm cuDNN supports for a convolution, as it reports it."""

    direction: Direction
    algo: int
    name: str
    status: str
    workspace_bytes: int
    deterministic: bool
    math_type: str


def free_memory() -> tuple[int, int]:
    """(free, total) bytes of the current GPU as this process may allocate them (a Workspace, an array):
    CuPy's cached blocks count as free, since this process reuses them (a model made and dropped leaves its
    blocks in the pool)."""
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    return free + cupy.get_default_memory_pool().free_bytes(), total


class Workspace:
    """One device buffer shared by every convolution call, grown to the largest need.

    Grow it before a step (never inside one): ``reserve`` allocates only when the new size
    exceeds the current one, and then counts a new ``generation``: a CUDA graph captured
    with the old buffer must be captured again (lenet/runner.py does).
    """

    def __init__(self, nbytes: int = 0):
        self._buf = None
        self.size = 0
        self.generation = 0
        self.reserve(nbytes)

    def reserve(self, nbytes: int) -> None:
        nbytes = int(nbytes)
        if nbytes <= self.size:
            return
        import cupy

        self._buf = None  # let the old one go first
        self._buf = cupy.empty(nbytes, dtype=cupy.uint8)
        self.size = nbytes
        self.generation += 1

    @property
    def ptr(self) -> int:
        return self._buf.data.ptr if self._buf is not None else 0

    def __repr__(self) -> str:
        return f"Workspace({self.size} bytes, generation {self.generation})"


def _max_count(handle, calls: _Calls) -> int:
    n = c_int()
    _lib.call(calls.max_count, handle.ptr, byref(n))
    return n.value


def workspace_size(handle, direction: Direction, conv, a_desc, b_desc, out_desc, algo: int) -> int:
    """Bytes of workspace ``algo`` needs; CudnnError (NOT_SUPPORTED) where it cannot run."""
    calls = CALLS[Direction(direction)]
    sz = c_size_t()
    _lib.call(calls.workspace_size, handle.ptr, a_desc.ptr, b_desc.ptr, conv.ptr, out_desc.ptr, int(algo),
              byref(sz), algo=algorithm_name(direction, algo),
              **{calls.operands[0]: a_desc.shape, calls.operands[1]: b_desc.shape,
                 calls.operands[2]: out_desc.shape})
    return int(sz.value)


def _result(direction, perf: AlgoPerf, workspace: int) -> AlgoResult:
    return AlgoResult(direction=direction, algo=int(perf.algo), name=algorithm_name(direction, perf.algo),
                      status=_lib.status_name(perf.status), workspace_bytes=int(workspace),
                      deterministic=perf.determinism == 1, math_type=math_type_name(perf.mathType))


def _math_ok(conv, perf: AlgoPerf) -> bool:
    # With FMA math asked for, a tensor-op result would change the arithmetic: drop it.
    return not (conv.math_type == MathType.FMA_MATH and perf.mathType in (1, 2))


def supported_algorithms(handle, direction: Direction, conv, a_desc, b_desc, out_desc) -> list[AlgoResult]:
    """Every algorithm cuDNN reports as supported for these shapes (heuristic order), with its
    workspace size. No filters applied."""
    direction = Direction(direction)
    calls = CALLS[direction]
    n = _max_count(handle, calls)
    perfs = (AlgoPerf * n)()
    got = c_int()
    _lib.call(calls.get, handle.ptr, a_desc.ptr, b_desc.ptr, conv.ptr, out_desc.ptr, n, byref(got), perfs,
              **{calls.operands[0]: a_desc.shape, calls.operands[1]: b_desc.shape,
                 calls.operands[2]: out_desc.shape}, pad=conv.pad, stride=conv.stride)
    out, seen = [], set()
    for p in perfs[: got.value]:
        if p.status != 0 or p.algo in seen or not _math_ok(conv, p):
            continue
        seen.add(p.algo)
        try:
            ws = workspace_size(handle, direction, conv, a_desc, b_desc, out_desc, p.algo)
        except CudnnError as e:
            if e.is_not_supported:  # see Note [algorithm fallback]
                continue
            raise
        out.append(_result(direction, p, ws))
    return out


def _filter_reason(r: AlgoResult, policy: AlgoPolicy, fixed: bool = False) -> str | None:
    if not fixed and not policy.allow_winograd and r.name.startswith("winograd"):
        return "is a Winograd algorithm (less precise; see Note [winograd precision])"
    if policy.workspace_limit is not None and r.workspace_bytes > policy.workspace_limit:
        return f"needs {r.workspace_bytes} B of workspace, over the limit of {policy.workspace_limit} B"
    if policy.deterministic and not r.deterministic:
        return "is not deterministic"
    return None


__all__ = ["Direction", "AlgoPolicy", "AlgoResult", "Workspace", "free_memory", "supported_algorithms",
           "workspace_size", "algorithm_id", "algorithm_name", "is_graph_plan_name", "check_choice",
           "parse_choices", "describe_policy", "ALGORITHM_NAMES", "CALLS", "POLICIES", "UnknownAlgorithmError",
           "AlgorithmNotSupportedError"]
