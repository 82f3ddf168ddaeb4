"""Convolution algorithm choice for the three directions, by one policy, with a
cache and the shared workspace.

Policies, per direction:
  heuristic   cudnnGetConvolution*Algorithm_v7: cuDNN's ranked guess, no timing
  exhaustive  cudnnFindConvolution*AlgorithmEx: every candidate timed on real buffers
  NAME        one fixed algorithm, as cuDNN names it (``implicit_gemm``, ``fft``, ``algo_1``...)
A workspace limit and a deterministic-only switch filter the candidates of all three.

Note [winograd precision]: measured on an H100 with cuDNN 9.19 (scripts/algo_errors.py),
every float32 algorithm agrees with a float64 reference to ~1e-6 (norm-wise relative),
as PyTorch's own float32 convolutions do, except the Winograd family: winograd_nonfused
is off by 4e-4..1.2e-3. heuristic and exhaustive therefore pass over winograd and
winograd_nonfused unless ``allow_winograd`` is set; naming one fixes it regardless.

Note [algorithm fallback]: a candidate is dropped only when cuDNN reports it
NOT_SUPPORTED (any 3000-range status) or as failing to allocate; a BAD_PARAM is a bug
in the caller and is raised, never skipped.
"""

from __future__ import annotations

import enum
from ctypes import byref, c_int, c_size_t
from dataclasses import dataclass

from . import _lib
from ._lib import AlgoPerf, ConvolutionBwdDataAlgo, ConvolutionBwdFilterAlgo, ConvolutionFwdAlgo, MathType
from .convolution import math_type_name
from .errors import CudnnError
from .tensor import dtype_name


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
    find: str
    workspace_size: str
    run: str
    operands: tuple[str, str, str]


CALLS: dict[Direction, _Calls] = {
    Direction.FORWARD: _Calls(
        ConvolutionFwdAlgo, "cudnnGetConvolutionForwardAlgorithmMaxCount",
        "cudnnGetConvolutionForwardAlgorithm_v7", "cudnnFindConvolutionForwardAlgorithmEx",
        "cudnnGetConvolutionForwardWorkspaceSize", "cudnnConvolutionForward", ("x", "w", "y")),
    Direction.BACKWARD_DATA: _Calls(
        ConvolutionBwdDataAlgo, "cudnnGetConvolutionBackwardDataAlgorithmMaxCount",
        "cudnnGetConvolutionBackwardDataAlgorithm_v7", "cudnnFindConvolutionBackwardDataAlgorithmEx",
        "cudnnGetConvolutionBackwardDataWorkspaceSize", "cudnnConvolutionBackwardData", ("w", "dy", "dx")),
    Direction.BACKWARD_FILTER: _Calls(
        ConvolutionBwdFilterAlgo, "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount",
        "cudnnGetConvolutionBackwardFilterAlgorithm_v7", "cudnnFindConvolutionBackwardFilterAlgorithmEx",
        "cudnnGetConvolutionBackwardFilterWorkspaceSize", "cudnnConvolutionBackwardFilter", ("x", "dy", "dw")),
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


def _check_choice(direction: Direction, value: str) -> str:
    v = str(value).strip().lower()
    if v in POLICIES:
        return v
    return algorithm_name(direction, algorithm_id(direction, v))


@dataclass(frozen=True)
class AlgoPolicy:
    """How to choose each direction's algorithm, and what filters the candidates.

    Each direction holds "heuristic", "exhaustive" or an algorithm name.
    ``workspace_limit`` in bytes (None: no limit); ``deterministic``: only
    algorithms cuDNN marks deterministic.
    """

    fwd: str = "heuristic"
    bwd_data: str = "heuristic"
    bwd_filter: str = "heuristic"
    workspace_limit: int | None = None
    deterministic: bool = False
    allow_winograd: bool = False

    def __post_init__(self):
        for d in Direction:
            object.__setattr__(self, _FIELD[d], _check_choice(d, getattr(self, _FIELD[d])))
        if self.workspace_limit is not None and (not isinstance(self.workspace_limit, int)
                                                 or self.workspace_limit < 0):
            raise ValueError(f"workspace limit must be a number of bytes >= 0, got {self.workspace_limit!r}")

    def choice(self, direction: Direction) -> str:
        return getattr(self, _FIELD[Direction(direction)])

    @classmethod
    def parse(cls, spec: str, workspace_limit: int | None = None, deterministic: bool = False,
              allow_winograd: bool = False) -> "AlgoPolicy":
        """Parse ``heuristic`` | ``exhaustive`` | ``NAME`` | ``fwd=NAME,bwd-data=NAME,bwd-filter=NAME``.

        A single NAME applies to every direction that has an algorithm of that name
        (``fft`` to all three, ``implicit_gemm`` to the forward one); the others use the
        heuristic. In the per-direction form, a direction left out uses the heuristic.
        """
        spec = str(spec).strip()
        if not spec:
            raise ValueError("empty algorithm spec; use heuristic, exhaustive, an algorithm name, "
                             "or fwd=NAME,bwd-data=NAME,bwd-filter=NAME")
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
        elif spec.lower() in POLICIES:
            kw = {f: spec.lower() for f in _FIELD.values()}
        else:
            for d in Direction:
                try:
                    kw[_FIELD[d]] = algorithm_name(d, algorithm_id(d, spec))
                except UnknownAlgorithmError:
                    pass
            if not kw:
                names = sorted(set().union(*ALGORITHM_NAMES.values()))
                raise UnknownAlgorithmError(
                    f"unknown algorithm {spec!r}; use heuristic, exhaustive, one of "
                    f"{', '.join(names)}, or fwd=NAME,bwd-data=NAME,bwd-filter=NAME")
        return cls(**kw, workspace_limit=workspace_limit, deterministic=deterministic,
                   allow_winograd=allow_winograd)

    def __str__(self) -> str:
        s = ",".join(f"{d}={self.choice(d)}" for d in Direction)
        if len({self.choice(d) for d in Direction}) == 1:
            s = self.fwd
        if self.workspace_limit is not None:
            s += f" (workspace <= {self.workspace_limit} B)"
        if self.deterministic:
            s += " (deterministic)"
        if self.allow_winograd:
            s += " (winograd allowed)"
        return s


_FIELD = {Direction.FORWARD: "fwd", Direction.BACKWARD_DATA: "bwd_data", Direction.BACKWARD_FILTER: "bwd_filter"}


@dataclass(frozen=True)
class AlgoResult:
    """The algorithm chosen for one direction of one convolution."""

    direction: Direction
    algo: int
    name: str
    status: str
    time_ms: float | None          # measured (exhaustive); None for heuristic and fixed
    workspace_bytes: int
    deterministic: bool
    math_type: str
    policy: str

    def as_dict(self) -> dict:
        return {"direction": str(self.direction), "algo": self.name, "id": self.algo, "status": self.status,
                "time_ms": self.time_ms, "workspace_bytes": self.workspace_bytes,
                "deterministic": self.deterministic, "math_type": self.math_type, "policy": self.policy}


@dataclass(frozen=True)
class AlgoKey:
    """Cache key: everything that decides the choice, and no pointers."""

    direction: Direction
    device: int
    dtype: str
    a_shape: tuple
    b_shape: tuple
    out_shape: tuple
    conv: tuple
    policy: str
    workspace_limit: int | None
    deterministic: bool
    allow_winograd: bool


_cache: dict[AlgoKey, AlgoResult] = {}


def clear_cache() -> None:
    _cache.clear()


def cache_size() -> int:
    return len(_cache)


class Workspace:
    """One device buffer shared by every convolution call, grown to the largest need.

    Grow it before a step (never inside one): ``reserve`` allocates only when the
    new size exceeds the current one.
    """

    def __init__(self, nbytes: int = 0):
        self._buf = None
        self.size = 0
        self.reserve(nbytes)

    def reserve(self, nbytes: int) -> None:
        nbytes = int(nbytes)
        if nbytes <= self.size:
            return
        import cupy

        self._buf = None  # let the old one go first
        self._buf = cupy.empty(nbytes, dtype=cupy.uint8)
        self.size = nbytes

    @property
    def ptr(self) -> int:
        return self._buf.data.ptr if self._buf is not None else 0

    def __repr__(self) -> str:
        return f"Workspace({self.size} bytes)"


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


def _result(direction, perf: AlgoPerf, workspace: int, timed: bool, policy: str) -> AlgoResult:
    return AlgoResult(direction=direction, algo=int(perf.algo), name=algorithm_name(direction, perf.algo),
                      status=_lib.status_name(perf.status), time_ms=float(perf.time) if timed else None,
                      workspace_bytes=int(workspace), deterministic=perf.determinism == 1,
                      math_type=math_type_name(perf.mathType), policy=policy)


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
        out.append(_result(direction, p, ws, False, "heuristic"))
    return out


def _filter_reason(r: AlgoResult, policy: AlgoPolicy, fixed: bool = False) -> str | None:
    if not fixed and not policy.allow_winograd and r.name.startswith("winograd"):
        return "is a Winograd algorithm (less precise; see Note [winograd precision])"
    if policy.workspace_limit is not None and r.workspace_bytes > policy.workspace_limit:
        return f"needs {r.workspace_bytes} B of workspace, over the limit of {policy.workspace_limit} B"
    if policy.deterministic and not r.deterministic:
        return "is not deterministic"
    return None


def _temporaries(a_desc, b_desc, out_desc):
    import cupy

    def rand(shape, dt):
        return cupy.random.standard_normal(shape, dtype="float32").astype(dtype_name(dt))
    return rand(a_desc.shape, a_desc.dtype), rand(b_desc.shape, b_desc.dtype), \
        cupy.empty(out_desc.shape, dtype=dtype_name(out_desc.dtype))


def _find(handle, direction: Direction, conv, a_desc, b_desc, out_desc, candidates: list[AlgoResult],
          policy: AlgoPolicy, buffers) -> list[AlgoResult]:
    """cudnnFind*AlgorithmEx on real buffers: candidates timed, fastest first."""
    import cupy

    calls = CALLS[direction]
    if buffers is None:
        buffers = _temporaries(a_desc, b_desc, out_desc)
    a, b, out = buffers
    pa = a_desc.check(a, calls.operands[0], handle.device_id)
    pb = b_desc.check(b, calls.operands[1], handle.device_id)
    po = out_desc.check(out, calls.operands[2], handle.device_id)
    need = max([c.workspace_bytes for c in candidates] + [0])
    if policy.workspace_limit is not None:
        need = min(need, policy.workspace_limit)
    ws = None
    while ws is None:
        try:
            ws = cupy.empty(max(need, 1), dtype=cupy.uint8)
        except cupy.cuda.memory.OutOfMemoryError:  # see Note [algorithm fallback]
            if need == 0:
                raise
            need //= 2
    n = _max_count(handle, calls)
    perfs = (AlgoPerf * n)()
    got = c_int()
    _lib.call(calls.find, handle.ptr, a_desc.ptr, pa, b_desc.ptr, pb, conv.ptr, out_desc.ptr, po, n,
              byref(got), perfs, ws.data.ptr, need,
              **{calls.operands[0]: a_desc.shape, calls.operands[1]: b_desc.shape,
                 calls.operands[2]: out_desc.shape}, workspace=need)
    handle.stream.synchronize()
    del ws
    results = []
    for p in perfs[: got.value]:
        if p.status != 0 or not _math_ok(conv, p):
            continue
        results.append(_result(direction, p, int(p.memory), True, "exhaustive"))
    return results


def search(handle, direction: Direction, conv, a_desc, b_desc, out_desc, policy: AlgoPolicy,
           buffers=None) -> AlgoResult:
    """Choose ``direction``'s algorithm for one convolution under ``policy`` (cached).

    The descriptors are (A, B, Out) in the order of _Calls: fwd (x, w, y),
    bwd-data (w, dy, dx), bwd-filter (x, dy, dw). ``buffers`` are real (A, B, Out)
    arrays for exhaustive search; without them, random temporaries are used.
    """
    direction = Direction(direction)
    choice = policy.choice(direction)
    key = AlgoKey(direction, handle.device_id, dtype_name(a_desc.dtype), a_desc.shape, b_desc.shape,
                  out_desc.shape, conv.params(), choice, policy.workspace_limit, policy.deterministic,
                  policy.allow_winograd)
    hit = _cache.get(key)
    if hit is not None:
        return hit

    supported = supported_algorithms(handle, direction, conv, a_desc, b_desc, out_desc)
    ok = [r for r in supported if _filter_reason(r, policy) is None]
    if choice == "heuristic":
        picked = ok[:1]
    elif choice == "exhaustive":
        timed = _find(handle, direction, conv, a_desc, b_desc, out_desc, ok, policy, buffers)
        picked = [r for r in timed if _filter_reason(r, policy) is None][:1]
    else:
        want = algorithm_id(direction, choice)
        usable = [r for r in supported if _filter_reason(r, policy, fixed=True) is None]
        picked = [r for r in usable if r.algo == want]
        if not picked:
            why = next((_filter_reason(r, policy, fixed=True) for r in supported if r.algo == want), None)
            listed = ", ".join(r.name for r in usable) or "none"
            what = (f"{choice} {why}" if why else
                    f"cuDNN does not support {direction} algorithm {choice} for "
                    f"{a_desc.shape} x {b_desc.shape} -> {out_desc.shape} with pad {conv.pad}, "
                    f"stride {conv.stride}, dilation {conv.dilation}")
            raise AlgorithmNotSupportedError(f"{what}; supported here: {listed}")
        picked = [AlgoResult(**{**picked[0].__dict__, "policy": "fixed"})]
    if not picked:
        raise AlgorithmNotSupportedError(
            f"no {direction} algorithm fits {a_desc.shape} x {b_desc.shape} -> {out_desc.shape} under "
            f"{policy}; supported without the filters: {', '.join(r.name for r in supported) or 'none'}")
    result = picked[0]
    if choice == "exhaustive":
        # Find reports the memory it used; the workspace the call needs is authoritative.
        ws = workspace_size(handle, direction, conv, a_desc, b_desc, out_desc, result.algo)
        result = AlgoResult(**{**result.__dict__, "workspace_bytes": ws})
    _cache[key] = result
    return result


__all__ = ["Direction", "AlgoPolicy", "AlgoResult", "AlgoKey", "Workspace", "search", "supported_algorithms",
           "workspace_size", "algorithm_id", "algorithm_name", "ALGORITHM_NAMES", "CALLS", "clear_cache",
           "UnknownAlgorithmError", "AlgorithmNotSupportedError"]
