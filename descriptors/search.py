"""One search for every convolution direction: every engine's candidates in one table, timed
the same way, checked against an exact reference, cached; and the chunk size chosen by timing.

    search = Search(store=None)    # one per model: its tables, choices and the store of choices
    choice = search.choose(handle, ConvSpec("bwd-filter", 65536, (1, 28, 28), (6, 1, 5, 5)), policy)
    choice.chunk, choice.ms, [(start, count, t.candidate.label) for start, count, t in choice.calls()]

Note [search state]: what a search learns (the timed tables, the choices, the verdicts of other
planners kept in ``memo``) and the store of choices across processes belong to one Search object,
which a model owns: two models in one process do not share a store or a cache, and a model's
search state goes with it.

Note [exact candidates]: every candidate runs on the same random operands as an exact
reference (the descriptor API's implicit GEMM / algo_1 in FMA float32, ~1e-6 of float64),
its output poisoned with NaN first, and its norm-wise relative distance from the reference
is kept with its time. Under heuristic or exhaustive a candidate farther than EXACT_RTOL
(3e-5; every exact algorithm and plan measured <= 1.3e-6 at LeNet's shapes) is dropped: numerical
notes do not catch everything (graph plan eng17_k25=0 of conv1's weight gradient carries no
TF32 or Winograd note and is off by 5.3e-4 on an H100, scripts/probes/README.md). With
allow_winograd the bound is WINOGRAD_RTOL, with allow_tf32 TF32_RTOL. A candidate the user
names is kept whatever its distance, which train_step reports.

Note [reproducible choices]: timing is not reproducible, and a different candidate or chunk
size changes float32 rounding. With ``deterministic`` and the heuristic policy, timing
therefore decides nothing: the first engine's first-ranked candidate that runs and is exact
(the descriptor API's, then the graph API's), and chunks by rule (the whole batch up to
DETERMINISTIC_CHUNK images, calls of DETERMINISTIC_CHUNK above), so reruns and resumed runs
are bit-identical. exhaustive always times.

Note [chunks]: per image, cuDNN's kernels for LeNet's shapes cost about the same from 1024 to
16384 images a call, and up to 14x more in one call of 65536 (conv1's weight gradient: 48 against
662 ns per image on an H100). A batch of n therefore runs as calls of ``chunk`` images and
one remainder call, where chunk is n or one of CHUNK_SIZES below n, whichever the timings
say is fastest (``policy.chunk`` fixes it). Each chunk size has its own candidate table, so a
remainder runs its own best candidate.

Note [stored choices]: a search times candidates (0.3 to 1 s for LeNet's step at batch 64,
minutes at 65536). ``Search(store)`` gives choose() a persistent store (lenet/plancache.py
keeps one on disk): a choice found there is checked against what the engines offer now (its
candidate must still be listed for the same spec and policy) and used without timing; a
choice searched for is put there. The store's key holds everything a choice depends on: the
store adds the GPU and library versions, choose() gives the spec (batch size included),
the policy, fusion and capture. A stored choice that no longer fits is searched again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .algorithms import AlgoPolicy, AlgorithmNotSupportedError, Workspace
from .engines import ENGINES, Candidate, ConvSpec, engines_for
from .errors import CudnnError
from .graph import available
from .timing import time_launcher

CHUNK_SIZES = (1024, 2048, 4096, 8192, 16384)
DETERMINISTIC_CHUNK = 16384
EXACT_RTOL = 3e-5
WINOGRAD_RTOL = 3e-3
TF32_RTOL = 1e-2
# The exact reference of each direction, first supported wins (see Note [exact candidates]).
REFERENCE = {"fwd": ("implicit_gemm", "implicit_precomp_gemm", "gemm"), "bwd-data": ("algo_1", "algo_0"),
             "bwd-filter": ("algo_1", "algo_0", "algo_3")}


@dataclass(frozen=True)
class Timed:
    """A candidate with its measured time (ms per call) and distance from the exact reference."""

    candidate: Candidate
    ms: float
    error: float


@dataclass(frozen=True)
class ConvChoice:
    """How a whole batch runs one convolution direction: calls of ``chunk`` images by ``full``,
    and the remainder (if any) by ``rest``. ``ms`` is the estimate for the whole batch."""

    spec: ConvSpec
    chunk: int
    full: Timed
    rest: Timed | None
    ms: float
    policy: str

    def calls(self):
        """(start, count, Timed) per call, in order."""
        n, c = self.spec.n, self.chunk
        for start in range(0, n - n % c, c):
            yield start, c, self.full
        if n % c:
            yield n - n % c, n % c, self.rest

    @property
    def chunks(self) -> int:
        return -(-self.spec.n // self.chunk)


def tolerance(policy: AlgoPolicy) -> float:
    return TF32_RTOL if policy.allow_tf32 else WINOGRAD_RTOL if policy.allow_winograd else EXACT_RTOL


def _policy_key(policy: AlgoPolicy, direction: str) -> tuple:
    return (policy.engine, policy.choice(direction), policy.workspace_limit, policy.deterministic,
            policy.allow_winograd, policy.allow_tf32)


def _op_key(spec: ConvSpec, policy: AlgoPolicy, fused: bool, captured: bool) -> dict:
    return {"spec": dataclasses.asdict(spec), "policy": list(_policy_key(policy, spec.direction)),
            "chunk_policy": policy.chunk, "fused": fused, "captured": captured}


def _encode(c: ConvChoice) -> dict:
    def timed(t: Timed | None):
        return None if t is None else {"candidate": dataclasses.asdict(t.candidate), "ms": t.ms, "error": t.error}
    return {"chunk": c.chunk, "full": timed(c.full), "rest": timed(c.rest), "ms": c.ms, "policy": c.policy}


def _decode(spec: ConvSpec, v: dict) -> ConvChoice:
    def timed(d):
        if d is None:
            return None
        c = dict(d["candidate"])
        c["key"] = tuple(c.get("key") or ())
        return Timed(Candidate(**c), float(d["ms"]), float(d["error"]))
    chunk = int(v["chunk"])
    rest = timed(v["rest"])
    if not 1 <= chunk <= spec.n or (rest is None) != (spec.n % chunk == 0):
        raise ValueError(f"chunk {chunk} does not fit a batch of {spec.n}")
    return ConvChoice(spec, chunk, timed(v["full"]), rest, float(v["ms"]), str(v["policy"]))


def _still_offered(handle, choice: ConvChoice, policy: AlgoPolicy, fused: bool) -> bool:
    """Whether every candidate of a stored choice is still listed by its engine for its spec."""
    for count, t in ((choice.chunk, choice.full), (choice.spec.n % choice.chunk, choice.rest)):
        if t is None:
            continue
        c = t.candidate
        # The policy must allow the engine; the frontend is loaded only for a graph-API choice.
        allowed = {"legacy": policy.engine != "graph", "graph": policy.engine != "legacy"}
        if not allowed.get(c.engine) or (c.engine == "graph" and not available()[0]):
            return False
        if not ENGINES[c.engine].offers(handle, choice.spec.at(count), c, policy, fused):
            return False
    return True


def _operands(spec: ConvSpec) -> dict:
    import cupy

    rng = cupy.random.default_rng(0)
    out = {r: rng.standard_normal(spec.shape(r), dtype=cupy.float32) for r in spec.roles}
    cupy.cuda.get_current_stream().synchronize()
    return out


def reference(handle, spec: ConvSpec, arrays: dict):
    """The exact answer on ``arrays`` (a copy), from the descriptor API in FMA float32."""
    import cupy

    legacy = ENGINES["legacy"]
    exact = AlgoPolicy(engine="legacy")
    cands, _ = legacy.candidates(handle, spec, exact, fused=False)
    by_name = {c.name: c for c in cands}
    name = next((n for n in REFERENCE[spec.direction] if n in by_name), None)
    if name is None:
        raise AlgorithmNotSupportedError(f"no exact reference algorithm for {spec}: cuDNN supports only "
                                         f"{', '.join(by_name) or 'none'}")
    ws = Workspace(by_name[name].workspace_bytes)
    legacy.bind(handle, spec, by_name[name], arrays, ws)()
    out = arrays[spec.output]
    ref = cupy.empty_like(out)
    with handle.stream:   # a copy, not CuPy's copy kernel (Note [first run] in descriptors/modules.py)
        ref.data.copy_from_device_async(out.data, out.nbytes)
    handle.stream.synchronize()
    return ref


# The distance's kernel (Note [first run] in descriptors/modules.py: CuPy's reductions of one array
# go through CUB, a 186 KB module NVRTC took 2-2.5 s over on a first run, one per shape of call).
# Block b of a grid-stride loop writes sums[2 b] = sum of (out - ref)^2 and sums[2 b + 1] = sum of
# ref^2 over its share, in float64; the host adds the blocks' sums in order (deterministic). Thread t
# owns the elements t, t + 256 gridDim.x, ... of its block's share and sd[t], sr[t] until the tree
# reduction, whose every step ends at a barrier; thread 0 writes the block's two sums.
_DISTANCE_THREADS, _DISTANCE_BLOCKS = 256, 264
_DISTANCE_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256)
distance_kernel(const float* __restrict__ out, const float* __restrict__ ref, long long n, double* __restrict__ sums) {
  __shared__ double sd[256], sr[256];
  double d = 0.0, r = 0.0;
  for (long long i = (long long)blockIdx.x * 256 + threadIdx.x; i < n; i += (long long)gridDim.x * 256) {
    const double o = out[i], e = ref[i];
    d += (o - e) * (o - e);
    r += e * e;
  }
  sd[threadIdx.x] = d;
  sr[threadIdx.x] = r;
  __syncthreads();
  for (int s = 128; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      sd[threadIdx.x] += sd[threadIdx.x + s];
      sr[threadIdx.x] += sr[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    sums[2 * blockIdx.x] = sd[0];
    sums[2 * blockIdx.x + 1] = sr[0];
  }
}
"""


def prefetch():
    """Start compiling (or reading from the kernel cache) the distance's kernel on a thread of its own."""
    from . import modules

    return modules.prefetch("descriptors.distance", lambda: _DISTANCE_SOURCE, ("-std=c++17",))


def distance(out, ref) -> float:
    """|out - ref| / |ref| over two float32 device arrays of one size, accumulated in float64, in one
    pass: no temporary the size of the output (a chunk of 65536 images would need 3.6 GB). Runs on
    CuPy's current stream and waits for it."""
    import math

    import cupy
    import numpy as np

    if out.size != ref.size or out.dtype != np.float32 or ref.dtype != np.float32:
        raise ValueError(f"distance takes two float32 arrays of one size, got {out.dtype} {out.shape} "
                         f"and {ref.dtype} {ref.shape}")
    out, ref = cupy.ascontiguousarray(out), cupy.ascontiguousarray(ref)
    n = out.size
    blocks = max(1, min(_DISTANCE_BLOCKS, -(-n // _DISTANCE_THREADS)))
    sums = cupy.empty(2 * blocks, dtype=cupy.float64)
    prefetch().result().get_function("distance_kernel")((blocks,), (_DISTANCE_THREADS,), (out, ref, np.int64(n), sums))
    d, r = sums.get().reshape(blocks, 2).sum(axis=0, dtype=np.float64)   # get(): waits for the stream
    num, den = math.sqrt(d), math.sqrt(r)
    return num / den if den > 0 else num


def _unsupported_message(spec, policy, choice, cands, excluded) -> str:
    listed = ", ".join(sorted({c.name for c in cands})) or "none"
    why = excluded.get(choice)
    if why:
        return f"{spec.direction} {choice} {why}; supported here: {listed}"
    return (f"cuDNN does not support {spec.direction} {choice} for {spec} with pad {spec.pad}, stride "
            f"{spec.stride}, dilation {spec.dilation} (engine {policy.engine}); supported here: {listed}")


def chunk_sizes(n: int, forced: int | None = None, reproducible: bool = False) -> list[int]:
    """The chunk sizes a batch of n may run in (see Note [chunks] and Note [reproducible choices])."""
    if forced is not None:
        return [min(int(forced), n)]
    if reproducible:
        return [min(n, DETERMINISTIC_CHUNK)]
    return [n] + [c for c in CHUNK_SIZES if c < n]


def choose_chunk(n: int, sizes, cost) -> tuple[int, float]:
    """(chunk, estimated ms) minimizing ``cost(chunk)`` for a batch of n; cost may return None
    for a size that cannot run. Shared by convolutions and pooling."""
    best = None
    for c in sizes:
        ms = cost(c)
        if ms is not None and (best is None or ms < best[1]):
            best = (c, ms)
    if best is None:
        raise AlgorithmNotSupportedError(f"no chunk size of {list(sizes)} can run a batch of {n}")
    return best


class Search:
    """One model's search (Note [search state]): timed tables and choices per convolution, ``memo`` for
    what other planners learn (pooling times, our kernels' checks), and ``store``, the choices kept
    across processes (Note [stored choices]; ``get(op: dict) -> dict | None``, ``put(op, value)``,
    ``flush()``), or None."""

    def __init__(self, store=None):
        self.store = store
        self.tables: dict = {}
        self.choices: dict = {}
        self.memo: dict = {}

    def clear(self) -> None:
        self.tables.clear()
        self.choices.clear()
        self.memo.clear()

    def _recall(self, handle, spec, policy, fused, captured) -> ConvChoice | None:
        if self.store is None:
            return None
        v = self.store.get(_op_key(spec, policy, fused, captured))
        if v is None:
            return None
        try:
            choice = _decode(spec, v)
        except (KeyError, TypeError, ValueError):
            return None
        return choice if _still_offered(handle, choice, policy, fused) else None

    def table(self, handle, spec: ConvSpec, policy: AlgoPolicy, *, fused: bool = True,
              captured: bool = True) -> list[Timed]:
        """The timed candidates for ``spec`` under ``policy``, fastest first (cached).

        heuristic: each engine's first candidate that runs and is exact; exhaustive: all of them;
        a fixed name: that algorithm or plan. ``fused`` lets candidates fuse their epilogue;
        ``captured`` times them as a CUDA-graph step runs them (else as eager launches).
        Raises AlgorithmNotSupportedError when nothing fits.
        """
        key = (handle.device_id, spec, _policy_key(policy, spec.direction), fused, captured)
        hit = self.tables.get(key)
        if hit is not None:
            return hit
        choice, fixed = policy.choice(spec.direction), policy.fixed(spec.direction)
        cands, excluded = [], {}
        for engine in engines_for(policy):
            c, ex = engine.candidates(handle, spec, policy, fused)
            cands += c
            excluded.update(ex)
        if fixed:
            named = [c for c in cands if c.name == choice]
            if not named:
                raise AlgorithmNotSupportedError(_unsupported_message(spec, policy, choice, cands, excluded))
            cands = named
        if not cands:
            raise AlgorithmNotSupportedError(
                f"no {spec.direction} candidate fits {spec} under {policy}; excluded: "
                + ("; ".join(f"{k} {v}" for k, v in list(excluded.items())[:6]) or "none listed"))

        arrays = _operands(spec)
        ref = reference(handle, spec, arrays)
        out = arrays[spec.output]
        ws = Workspace(max(c.workspace_bytes for c in cands))
        tol, stream = tolerance(policy), handle.stream
        timed, dropped, done, best = [], {}, set(), math.inf
        reproducible = choice == "heuristic" and policy.deterministic   # see Note [reproducible choices]
        for c in cands:
            if (choice == "heuristic" and c.engine in done) or (reproducible and timed):
                continue
            with stream:
                out.data.memset_async(0xFF, out.nbytes)   # NaN everywhere: an output the candidate does not write cannot pass
            try:
                run = ENGINES[c.engine].bind(handle, spec, c, arrays, ws)
                ms = time_launcher(run, stream, graph=captured, cutoff_ms=3 * best if best < math.inf else None)
            except CudnnError as e:
                if e.is_not_supported or e.is_alloc_failure or e.is_execution_failure:   # Note [algorithm fallback]
                    dropped[c.label] = e.status_name
                    continue
                raise
            err = distance(out, ref)
            if not fixed and not err <= tol:   # NaN fails too
                dropped[c.label] = f"is {err:.1e} from the exact reference (bound {tol:.0e}; see Note [exact candidates])"
                continue
            timed.append(Timed(c, ms, err))
            best = min(best, ms)
            done.add(c.engine)
        del arrays, out, ref, ws
        if not timed:
            raise AlgorithmNotSupportedError(
                f"no {spec.direction} candidate ran for {spec} under {policy}: "
                + "; ".join(f"{k} {v}" for k, v in list(dropped.items())[:6]))
        if not reproducible:
            timed.sort(key=lambda t: t.ms)
        self.tables[key] = timed
        return timed

    def choose(self, handle, spec: ConvSpec, policy: AlgoPolicy, *, fused: bool = True,
               captured: bool = True) -> ConvChoice:
        """How to run ``spec`` (a whole batch): the candidate and chunk size with the least time (cached)."""
        key = (handle.device_id, spec, _policy_key(policy, spec.direction), policy.chunk, fused, captured)
        hit = self.choices.get(key) or self._recall(handle, spec, policy, fused, captured)   # Note [stored choices]
        if hit is not None:
            self.choices[key] = hit
            return hit
        import cupy

        n, first_error = spec.n, []

        def best_at(c):
            return self.table(handle, spec.at(c), policy, fused=fused, captured=captured)[0]

        def cost(c):
            try:
                full = best_at(c)
                rest = best_at(n % c) if n % c else None
            except (AlgorithmNotSupportedError, cupy.cuda.memory.OutOfMemoryError) as e:
                first_error.append(e)
                return None
            return (n // c) * full.ms + (rest.ms if rest else 0.0)

        reproducible = policy.choice(spec.direction) == "heuristic" and policy.deterministic
        try:
            chunk, ms = choose_chunk(n, chunk_sizes(n, policy.chunk, reproducible), cost)
        except AlgorithmNotSupportedError:
            raise first_error[0] from None
        c = policy.choice(spec.direction)
        result = ConvChoice(spec, chunk, best_at(chunk), best_at(n % chunk) if n % chunk else None, ms,
                            c if c in ("heuristic", "exhaustive") else "fixed")
        self.choices[key] = result
        if self.store is not None:
            self.store.put(_op_key(spec, policy, fused, captured), _encode(result))
        return result


__all__ = ["Search", "Timed", "ConvChoice", "choose_chunk", "chunk_sizes", "tolerance",
           "CHUNK_SIZES", "EXACT_RTOL", "WINOGRAD_RTOL", "TF32_RTOL"]
