"""A stage by parts on cuDNN: conv + bias + ReLU, each direction (forward with bias and ReLU, weight
gradient, data gradient) chosen among the candidates of every engine that offers convolutions (the
descriptor API's algorithms, the graph API's plans: lenet/engines/legacy.py, graph.py), in chunks; the
bias gradient as two cuBLAS gemv; then cuDNN's max pooling (the descriptor API: the graph API's Python
frontend 1.28 has none) on the unpooled output, which this engine keeps per stage. It runs beside
the engines that offer convolutions (under their --engine flags), and competes under auto; under such
a flag a stage is cuDNN's only.

Note [chunks]: per image, cuDNN's kernels for LeNet's shapes cost about the same from 1024 to 16384
images a call, and many times more in one call of 65536 (docs/engines.md, "Chunks"). A batch of n
therefore runs as calls of ``chunk`` images and one remainder call, where chunk is n or one of
CHUNK_SIZES below n, whichever the timings say is fastest (``--chunk`` fixes it). The planner's loop
for a direction chooses among ways, each a chunk size with a candidate for its full calls and one for
its remainder (ConvSearch), so a remainder runs its own best candidate.
With --deterministic and the heuristic, chunks by rule: the whole batch up to DETERMINISTIC_CHUNK
images, calls of DETERMINISTIC_CHUNK above (Note [reproducible choices] in lenet/plan.py).

Note [relu at the pooled level]: ReLU commutes with max pooling (both are monotone), so
p = maxpool(relu(c)) = relu(maxpool(c)) and the ReLU mask of a stage can be applied to the
pooled gradient, before the pool's backward routes it: maxpool_backward(dp * (p > 0))
equals relu_backward(maxpool_backward(dp)) exactly (the routed position holds p itself;
where p == 0 both give 0). The pooled tensor is 4x smaller, and the mask becomes the
epilogue of whatever computes dp: conv2's data gradient (``act`` = p1, fused into the graph
where cuDNN builds it) and fc1's input gradient (act = p2).

Note [chunked weight gradient]: the graph API's weight gradient has no beta, so each chunk
writes its own partial (chunks x K*C*R*S floats, allocated at plan time) and one gemv adds them in
a fixed order: deterministic, and equal to one call's result up to float32 summation order. Each
partial starts on a 256-byte boundary: graph plans refuse a pointer that is not aligned
(docs/engines.md, "Aligned partials").

Note [conv bias gradient]: cudnnConvolutionBackwardBias launches one block per channel, the largest
items of the step where it ran; two gemv take a fraction of it (docs/engines.md, "The conv bias gradient").

Note [pooling batch limit]: cuDNN's max-pooling forward kernel puts the batch in the grid's z
dimension, which CUDA caps at 65535: at N = 65536 cudnnPoolingForward answers NOT_SUPPORTED
(docs/engines.md, "Pooling's batch limit"). Chunk sizes above POOL_LIMIT are therefore not candidates; below it the chunk
size is timed like a convolution's. A single size is not timed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from descriptors import PoolingDescriptor, TensorDescriptor
from descriptors.algorithms import AlgorithmNotSupportedError, Workspace, free_memory
from descriptors.candidates import BATCH_ROLES, Candidate
from descriptors.errors import CudnnError
from descriptors.exact import reference, tolerance

from .. import params as P
from ..kernels import distance, prefetch
from .base import Check, Decision, Engine, Named, PlannedOp, Trial, forward_only_error

CHUNK_SIZES = (1024, 2048, 4096, 8192, 16384)
DETERMINISTIC_CHUNK = 16384
POOL_LIMIT = 32768


def chunk_sizes(n: int, forced: int | None = None, reproducible: bool = False) -> list[int]:
    """The chunk sizes a batch of n may run in (Note [chunks])."""
    if forced is not None:
        return [min(int(forced), n)]
    if reproducible:
        return [min(n, DETERMINISTIC_CHUNK)]
    return [n] + [c for c in CHUNK_SIZES if c < n]


@dataclass(frozen=True)
class Chunk:
    """A chunk size as a candidate of the planner's loop."""

    size: int
    engine = None

    @property
    def name(self) -> str:
        return f"chunks of {self.size}"


@dataclass(frozen=True)
class ConvChoice:
    """How a whole batch runs one convolution direction: calls of ``chunk`` images by ``full``, and the
    remainder (if any) by ``rest`` (lenet.engines.base.Trial each: candidate, ms per call, check).
    ``ms`` is the estimate for the whole batch."""

    spec: object
    chunk: int
    full: Trial
    rest: Trial | None
    ms: float
    policy: str

    def calls(self):
        """(start, count, Trial) per call, in order."""
        n, c = self.spec.n, self.chunk
        for start in range(0, n - n % c, c):
            yield start, c, self.full
        if n % c:
            yield n - n % c, n % c, self.rest

    @property
    def chunks(self) -> int:
        return -(-self.spec.n // self.chunk)


def _operands(spec) -> dict:
    import cupy

    rng = cupy.random.default_rng(0)
    out = {r: rng.standard_normal(spec.shape(r), dtype=cupy.float32) for r in spec.roles}
    cupy.cuda.get_current_stream().synchronize()
    return out


def _unsupported_message(spec, policy, choice, cands, excluded) -> str:
    listed = ", ".join(sorted({c.name for _, c in cands})) or "none"
    why = excluded.get(choice)
    if why:
        return f"{spec.direction} {choice} {why}; supported here: {listed}"
    return (f"cuDNN does not support {spec.direction} {choice} for {spec} with pad {spec.pad}, stride "
            f"{spec.stride}, dilation {spec.dilation} (engine {policy.engine}); supported here: {listed}")


def within_free_memory(cands: list, free: int, excluded: dict) -> list:
    """The (engine, candidate) pairs whose workspace fits in 80% of the GPU's ``free`` bytes; the others named
    in ``excluded`` with what they need: on an 8 or 16 GB card a search never asks for a workspace the GPU
    cannot give (Note [algorithm fallback] catches an allocation that fails all the same)."""
    room = int(0.8 * free)
    kept = []
    for e, c in cands:
        if c.workspace_bytes > room:
            excluded[c.name] = f"needs {c.workspace_bytes:,} B of workspace, more than the GPU has free ({free:,} B)"
        else:
            kept.append((e, c))
    return kept


class Cudnn(Engine):
    name = "cudnn"
    runs_beside = ("conv",)   # under the flags of the engines that offer its convolutions
    kinds = ("stage",)
    cudnn_stage = True   # its stages call cuDNN (registry.cudnn_stages)

    def refuses(self, op, policy) -> str | None:
        theirs = [name for name, owner in policy.owners().items() if owner is not None]
        if theirs:
            return f"--algo names {theirs[0]}, not a cuDNN algorithm"
        return None

    def version(self) -> str:
        import descriptors

        return descriptors.version_string()

    @staticmethod
    def scratch_per_image(op, policy) -> int:
        """Bytes per image of max_batch this engine allocates for a stage: the unpooled output and its gradient."""
        return 2 * 4 * math.prod(op.spec.conv_chw)

    def warm(self, batches=None, pack: bool = False, policy=None) -> None:
        prefetch(("distance",))   # the check of every convolution candidate (Note [exact candidates])

    def candidates(self, op, n: int, planner) -> list:
        # its parts are cuDNN's exact reference or checked against it as they are chosen (ConvSearch)
        return [Named(self.name, "cuDNN by parts")]

    def bind(self, op, n: int, candidate, planner) -> "CudnnPlan":
        import cupy

        spec = op.spec
        k, h, w = spec.conv_chw

        def make():
            N = op.max_batch * op.models
            return {"c": cupy.zeros((N, k, h, w), cupy.float32),      # (N, K, H, W) relu(conv + bias)
                    "dc": cupy.zeros((N, k, h, w), cupy.float32),     # (N, K, H, W) its gradient
                    "bias": cupy.zeros(k * h * w, cupy.float32)}      # (K*H*W,) bias-gradient scratch
        state = planner.state(self.name)
        if ("stage", op.name) not in state:
            with planner.ctx.stream:   # zeroed on the model's stream, which waits for no other
                state[("stage", op.name)] = make()
        own, whole = state[("stage", op.name)], op.tensors.rows(op.models * n)
        plans = []
        for m in range(op.models):   # Note [a pack on cuDNN]
            t = whole.model(m, n, P.TOTAL) if op.models > 1 else whole
            c, dc = own["c"][m * n:(m + 1) * n], own["dc"][m * n:(m + 1) * n]
            act = t.x if (t.dx is not None and spec.dx_mask) else None   # the images' gradient takes no mask
            conv = PlannedConv(self, planner, spec.name, spec.conv, n, x=t.x, w=t.w, b=t.b, y=c, dy=dc, dw=t.dw,
                               db=t.db, dx=t.dx, act=act, bias_scratch=own["bias"], forward_only=op.forward_only)
            pool = PlannedPool(self, planner, spec.name.replace("conv", "pool"), n, x=c, y=t.y, dx=dc, dy=t.dy)
            plans.append(CudnnPlan(self.name, conv, pool))
        return plans[0] if op.models == 1 else CudnnPackPlan(self.name, plans)

    # ---------------------------------------------------------------- convolutions

    def table(self, planner, spec, policy=None) -> Decision:
        """What the loop of ``conv_choice`` tries of ``spec`` at its own size under the model's policy (or
        ``policy``): the candidates that passed, fastest first, and those refused (ConvSearch)."""
        return ConvSearch(self, planner, spec, policy).at_size()

    def conv_choice(self, planner, spec, policy=None) -> ConvChoice:
        """How to run ``spec`` (a whole batch): the chunk size and candidates with the least time (Note
        [chunks]), one loop of the planner (ConvSearch)."""
        return ConvSearch(self, planner, spec, policy).choose()

    @staticmethod
    def _encode(d) -> dict:
        def timed(t):
            return None if t is None else {"candidate": dataclasses.asdict(t.candidate), "ms": t.ms,
                                           "error": t.check.error}
        full, rest = d.best.plan
        return {"chunk": d.best.candidate.size, "full": timed(full), "rest": timed(rest), "ms": d.best.ms}

    @staticmethod
    def _decode(planner, spec, v: dict, engines):
        """A stored chunk choice, if every candidate in it is still offered by an engine that serves."""
        by_name = {e.name: e for e in engines}

        def timed(d, count):
            if d is None:
                return None
            c = dict(d["candidate"])
            c["key"] = tuple(c.get("key") or ())
            cand = Candidate(**c)
            e = by_name.get(cand.engine)
            if e is None or not e.offers(spec.at(count), cand, planner):
                raise ValueError(f"{cand.label} is not offered now")
            return Trial(cand, float(d["ms"]), Check(float(d["error"])))
        chunk = int(v["chunk"])
        if not 1 <= chunk <= spec.n or (v["rest"] is None) != (spec.n % chunk == 0):
            raise ValueError(f"chunk {chunk} does not fit a batch of {spec.n}")
        pair = (timed(v["full"], chunk), timed(v["rest"], spec.n % chunk))
        return Trial(Chunk(chunk), float(v["ms"]), Check(), pair)

    # ---------------------------------------------------------------- pooling

    def pooling(self, planner) -> PoolingDescriptor:
        """cuDNN's 2x2/2 max pooling for this model; deterministic mode takes its deterministic form."""
        mode = "max_deterministic" if planner.policy.deterministic else "max"
        state = planner.state(self.name)
        if ("pool", mode) not in state:
            state[("pool", mode)] = PoolingDescriptor(mode, window=2, stride=2)
        return state[("pool", mode)]

    def close(self, state: dict) -> None:
        for k, v in list(state.items()):
            if isinstance(k, tuple) and k[0] == "pool":
                v.close()
        state.clear()


@dataclass(frozen=True)
class Way:
    """A candidate of a convolution direction's loop: calls of ``size`` images by cuDNN candidate ``full``
    (descriptors.candidates.Candidate), the remainder by ``rest`` (None: no remainder)."""

    size: int
    full: Candidate
    rest: Candidate | None
    engine = None   # the loop's rule is applied at each call size (ConvSearch.picks), not per engine

    @property
    def name(self) -> str:
        return f"chunks of {self.size} by {self.full.label}" + (f", the rest by {self.rest.label}" if self.rest else "")


class SizeTrials:
    """What the loops of one convolution direction learn at one call size under one policy, kept for the
    model's life (two batch sizes whose calls meet share it, as two chunk sizes with one remainder do):
    the candidates in cuDNN's heuristic order once offered, each one's trial once tried (a Trial, or why
    it was refused, by label) and the best time so far (the cutoff of slower ones); while trying, the
    operands and their exact reference."""

    def __init__(self):
        self.cands: list | None = None
        self.whole = False   # the second look taken (or not the heuristic's): cands stays (ConvSearch.picks)
        self.tried: dict[str, Trial | str] = {}
        self.best = math.inf
        self.kept: tuple | None = None
        self.decision: Decision | None = None


class ConvSearch:
    """The planner's one loop for one convolution direction over a whole batch (Note [chunks]): its
    candidates are the ways to run it (Way: a chunk size, the candidate of its full calls, that of its
    remainder), each way's time the whole batch's from its parts' times per call. Each part is tried once
    at its size (SizeTrials): timed on random operands as the step runs it and checked against the exact
    reference (Note [exact candidates] in descriptors/exact.py). Which parts a size tries is the policy's
    rule there: heuristic, each engine's first candidate that runs and is exact; with --deterministic, the
    first (Note [reproducible choices] in lenet/plan.py); exhaustive, all; a fixed name, that one (kept
    whatever its distance). The loop offers only ways of parts the rule tries, so it times what one
    search per size did; the choice is stored, the parts' trials are not."""

    def __init__(self, engine: Cudnn, planner, spec, policy=None):
        self.engine, self.planner, self.spec = engine, planner, spec
        self.policy = policy = policy or planner.policy
        self.engines = planner.part_engines("conv", spec, policy)
        self.by_name = {e.name: e for e in self.engines}
        choice = policy.choice(spec.direction)
        self.fixed, self.tol = policy.fixed(spec.direction), tolerance(policy)
        self.reproducible = choice == "heuristic" and policy.deterministic   # Note [reproducible choices]
        self.rule = "first" if self.reproducible else "first-per-engine" if choice == "heuristic" else "all"
        self.kind = choice if choice in ("heuristic", "exhaustive") else "fixed"
        self.broken: dict[int, str] = {}   # call sizes that cannot be tried here, and why
        self.errors: list = []             # their errors: the first is raised where no way passes
        self._sized: dict[int, SizeTrials] = {}
        self.ws: Workspace | None = None   # while trying

    def sized(self, s: int) -> SizeTrials:
        """The model's SizeTrials for this direction at s images a call under this policy."""
        if s not in self._sized:
            key = self.planner.key(f"conv {self.spec.direction}", {"spec": dataclasses.asdict(self.spec.at(s))},
                                   self.engines, self.policy)
            self._sized[s] = self.planner.state(self.engine.name).setdefault(
                ("conv", json.dumps(key, sort_keys=True, default=str)), SizeTrials())
        return self._sized[s]

    def offered(self, s: int, whole: frozenset | None = None) -> list:
        """(engine, candidate) pairs for ``spec`` at s images a call, in cuDNN's heuristic order. Under the
        heuristic each graph offers its first plan that builds (Note [the heuristic's one plan] in
        descriptors/graph.py); ``whole``: only the engines of these names, each graph's whole list."""
        spec, policy, choice = self.spec.at(s), self.policy, self.policy.choice(self.spec.direction)
        cands, excluded = [], {}
        for e in self.engines if whole is None else [e for e in self.engines if e.name in whole]:
            first = self.rule != "all" and whole is None
            c, ex = e.conv_candidates(spec, self.planner, policy, first=first)
            cands += [(e, x) for x in c]
            excluded.update(ex)
        if self.fixed:
            named = [(e, c) for e, c in cands if c.name == choice]
            if not named:
                raise AlgorithmNotSupportedError(_unsupported_message(spec, policy, choice, cands, excluded))
            cands = named
        cands = within_free_memory(cands, free_memory()[0], excluded)
        if not cands:
            raise AlgorithmNotSupportedError(
                f"no {spec.direction} candidate fits {spec} under {policy}; excluded: "
                + ("; ".join(f"{k} {v}" for k, v in list(excluded.items())[:6]) or "none listed"))
        return cands

    def _broke(self, s: int, err: Exception) -> None:
        self.broken.setdefault(s, str(err).splitlines()[0])
        self.errors.append(err)

    def picks(self, s: int):
        """The candidates the rule tries at s images a call, in order, each yielded before it is tried (the
        rule reads its trial after); a size where none passes is broken, with why. Under the heuristic each
        graph offers its first plan, and a second look follows where the rule found nothing once every
        candidate offered was tried: the engines without a passing candidate (under the rule "first", every
        engine) offer their graphs' whole lists in place of their first look's, the other engines' entries
        kept as they were, and the candidates not seen yet are yielded in order (Note [the heuristic's one
        plan] in descriptors/graph.py)."""
        rec = self.sized(s)
        if s not in self.broken and rec.cands is None:
            try:
                rec.cands = self.offered(s)
                rec.whole = self.rule == "all"
            except AlgorithmNotSupportedError as e:
                self._broke(s, e)
        if s in self.broken:
            return
        passed, seen = set(), set()
        while True:
            for _, c in rec.cands:
                if (self.rule == "first" and passed) or (self.rule == "first-per-engine" and c.engine in passed):
                    continue
                if c.label in seen:
                    continue   # the first look's
                if not isinstance(rec.tried.get(c.label), str):
                    yield c
                if s in self.broken:
                    return
                if isinstance(rec.tried.get(c.label), Trial):
                    passed.add(c.engine)
            lacking = frozenset(e.name for e in self.engines if e.name not in passed and
                                (self.rule == "first-per-engine" or not passed))
            if rec.whole or not lacking or not all(c.label in rec.tried for e, c in rec.cands if e.name in lacking):
                break   # no second look left, none needed, or not yet (a candidate offered is not tried yet)
            try:
                more = self.offered(s, whole=lacking)
            except AlgorithmNotSupportedError:
                more = []   # nothing more fits: the first look's refusals say why
            seen, rec.whole, looked = {c.label for _, c in rec.cands}, True, []
            for e in self.engines:   # an engine whose whole list offers nothing keeps its first look
                whole = [c for x, c in more if x is e] if e.name in lacking else []
                looked += [(e, c) for c in whole or [c for x, c in rec.cands if x is e]]
            rec.cands = looked
        if not passed and all(c.label in rec.tried for _, c in rec.cands):
            self._broke(s, AlgorithmNotSupportedError(
                f"no candidate for {self.spec.direction} {self.spec.at(s)} under {self.policy} passed: "
                + "; ".join(f"{k} {v}" for k, v in list(rec.tried.items())[:6])))

    def ways(self, sizes: list):
        """Every way the loop tries: per chunk size, each picked candidate of its full calls with each of
        its remainder's; the operands of a chunk's sizes are let go once its ways are tried."""
        for c in sizes:
            r = self.spec.n % c
            for a in self.picks(c):
                for b in (self.picks(r) if r else (None,)):
                    yield Way(c, a, b)
                    if not isinstance(self.sized(c).tried.get(a.label), Trial):
                        break
            self.release(c, r)

    def release(self, *sizes) -> None:
        """Let the operands of ``sizes`` go (their trials are kept)."""
        for s in sizes:
            if s:
                self.sized(s).kept = None

    def measure(self, s: int, c) -> Trial | str:
        """Candidate c at s images a call: timed and checked once (its trial kept, SizeTrials)."""
        rec = self.sized(s)
        if c.label not in rec.tried:
            import cupy

            try:
                rec.tried[c.label] = t = self._try(self.spec.at(s), c, rec)
            except (AlgorithmNotSupportedError, cupy.cuda.memory.OutOfMemoryError) as e:   # the size is not tried further
                self._broke(s, e)
                return self.broken[s]
            if isinstance(t, Trial):
                rec.best = min(rec.best, t.ms)
        return rec.tried[c.label]

    def _try(self, spec, c, rec: SizeTrials) -> Trial | str:
        planner = self.planner
        if rec.kept is None:
            arrays = _operands(spec)
            rec.kept = (arrays, reference(planner.ctx.handle, spec, arrays))
        arrays, ref = rec.kept
        ws = self.ws = self.ws or Workspace()   # one for the search's sizes, grown to the largest
        ws.reserve(max(x.workspace_bytes for _, x in rec.cands))
        out = arrays[spec.output]
        with planner.ctx.stream:
            out.data.memset_async(0xFF, out.nbytes)   # NaN everywhere: an output not written cannot pass
        try:
            run = self.by_name[c.engine].bind_conv(spec, c, arrays, ws, planner)
            ms = planner.time(run, cutoff_ms=3 * rec.best if rec.best < math.inf else None)
        except CudnnError as e:
            if e.is_not_supported or e.is_alloc_failure or e.is_execution_failure:   # Note [algorithm fallback]
                return e.status_name
            raise
        with planner.ctx.stream:
            err = distance(out, ref)
        if not self.fixed and not err <= self.tol:   # NaN fails too
            return f"is {err:.1e} from the exact reference (bound {self.tol:.0e}; see Note [exact candidates])"
        return Trial(c, ms, Check(err))

    def trial(self, way: Way, best: float) -> Trial | str:
        n, c = self.spec.n, way.size
        full = self.measure(c, way.full)
        if isinstance(full, str):
            return f"{way.full.label} {full}"
        rest = self.measure(n % c, way.rest) if way.rest is not None else None
        if isinstance(rest, str):
            return f"{way.rest.label} at {n % c} {rest}"
        return Trial(way, (n // c) * full.ms + (rest.ms if rest else 0.0), Check(), (full, rest))

    def choose(self) -> ConvChoice:
        spec, policy, planner = self.spec, self.policy, self.planner
        sizes = chunk_sizes(spec.n, policy.chunk, self.reproducible)
        key = planner.key(f"conv {spec.direction} chunks", {"spec": dataclasses.asdict(spec)}, self.engines, policy)
        try:
            d = planner.choose(key, lambda: self.ways(sizes), self.trial,
                               recall=lambda v: Cudnn._decode(planner, spec, v, self.engines),
                               encode=Cudnn._encode, what=f"{spec.direction} {spec} in chunks")
        except AlgorithmNotSupportedError:
            if self.errors:
                raise self.errors[0] from None
            raise
        finally:
            self.release(*sizes, *(spec.n % c for c in sizes))
            self.ws = None
        full, rest = d.best.plan
        return ConvChoice(spec, d.best.candidate.size, full, rest, d.best.ms, self.kind)

    def at_size(self) -> Decision:
        """Every candidate the rule tries at the spec's own size, tried (``Cudnn.table``)."""
        s, rec = self.spec.n, self.sized(self.spec.n)
        if rec.decision is None:
            try:
                for c in self.picks(s):
                    self.measure(s, c)
            finally:
                self.release(s)
                self.ws = None
            if self.errors:
                raise self.errors[0]
            passed = [t for t in rec.tried.values() if isinstance(t, Trial)]
            rec.decision = Decision(sorted(passed, key=lambda t: t.ms),
                                    {k: v for k, v in rec.tried.items() if isinstance(v, str)})
        return rec.decision


def supported_names(planner, specs, n: int, engine: str | None = None) -> dict[str, list[str]]:
    """Per direction, the algorithm (or plan) names convolution engine ``engine`` (default: the registry's
    first) offers for every stage (lenet.ops.StageSpec) that runs that direction at batch n: what a fixed
    ``--algo`` may name."""
    from descriptors.algorithms import AlgoPolicy

    e = next(e for e in planner.part_engines("conv", None, planner.policy.replace(engine="auto"))
             if engine is None or e.name == engine)
    policy = AlgoPolicy(allow_winograd=e.names_winograd)
    out = {}
    for d, epilogue, chosen in (("fwd", "bias_relu", specs), ("bwd-data", "drelu", [s for s in specs if s.dx]),
                                ("bwd-filter", "", specs)):
        sets = [{c.name for c in e.source(planner).candidates(planner.ctx.handle, s.conv(d, n, epilogue), policy,
                                                              planner.policy.fused)[0]} for s in chosen]
        out[d] = sorted(set.intersection(*sets))
    return out


class CudnnPlan(PlannedOp):
    masks_dy = False   # the pooling backward reads dy as given: the head masks it (Note [relu at the pooled level])

    def __init__(self, engine: str, conv, pool):
        self.engine, self.conv, self.pool = engine, conv, pool
        self.workspace_bytes = conv.workspace_bytes

    def forward(self) -> None:
        self.conv.forward()
        self.pool.forward()

    def backward(self) -> None:
        if self.conv.wgrad is None:
            raise forward_only_error(self.conv.name, self.conv.n)
        self.pool.backward()
        self.conv.backward()

    def describe(self, ms: float | None = None) -> list[dict]:
        return self.conv.describe() + self.pool.describe()


class CudnnPackPlan(PlannedOp):
    """Note [a pack on cuDNN]: a pack of K models (Note [packs] in lenet/ops.py) runs on cuDNN as K stages, one
    per model, each its lone run's calls (the same candidates and chunks, chosen once for all K): a model of
    the pack sums exactly what its lone run on cuDNN sums. A grouped convolution (model k as group k) would
    need the models' images side by side in one image, (n, K C, H, W), where our kernels and the head take
    each model's images one after another, (K n, C, H, W)."""

    masks_dy = False

    def __init__(self, engine: str, plans: list):
        self.engine, self.plans = engine, plans
        self.workspace_bytes = max(p.workspace_bytes for p in plans)

    def forward(self) -> None:
        for p in self.plans:
            p.forward()

    def backward(self) -> None:
        for p in self.plans:
            p.backward()

    def describe(self, ms: float | None = None) -> list[dict]:
        return [{**row, "models": len(self.plans)} for row in self.plans[0].describe()]


class BoundConv:
    """A ConvChoice bound to full-batch arrays: one launcher per chunk, and, for a weight gradient in
    several chunks, per-chunk partials summed into ``dw`` by one cuBLAS gemv (Note [chunked weight
    gradient])."""

    def __init__(self, engine: Cudnn, planner, choice: ConvChoice, arrays: dict):
        import cupy

        self.choice, spec = choice, choice.spec
        self.partials, self._reduce = None, None
        engines = {e.name: e for e in planner.part_engines("conv", spec, planner.policy)}
        if spec.direction == "bwd-filter" and choice.chunks > 1:
            size = math.prod(spec.w)
            with planner.ctx.stream:
                rows = cupy.zeros((choice.chunks, -(-size // 64) * 64), dtype=cupy.float32)   # (chunks, padded K*C*R*S)
            self.partials = rows[:, :size]
            dw, blas, ones = arrays["dw"].reshape(-1), planner.ctx.blas, planner.ctx.ones
            self._reduce = lambda: blas.column_sums(self.partials, ones, dw)
        self.calls = []
        for i, (start, count, trial) in enumerate(choice.calls()):
            a = {r: (arr[start:start + count] if r in BATCH_ROLES else arr) for r, arr in arrays.items()}
            if self.partials is not None:
                a["dw"] = self.partials[i].reshape(spec.w)
            cand = trial.candidate
            self.calls.append(engines[cand.engine].bind_conv(spec.at(count), cand, a, planner.ctx.workspace, planner))

    def __call__(self) -> None:
        for call in self.calls:
            call()
        if self._reduce is not None:
            self._reduce()

    @property
    def workspace_bytes(self) -> int:
        c = self.choice
        return max(c.full.candidate.workspace_bytes, c.rest.candidate.workspace_bytes if c.rest else 0)

    def describe(self, layer: str) -> dict:
        c, t = self.choice, self.choice.full.candidate
        row = {"layer": layer, "op": c.spec.direction + (f"+{c.spec.epilogue}" if c.spec.epilogue else ""),
               "engine": t.engine, "algo": t.name, "fused": t.fused, "chunk": c.chunk, "chunks": c.chunks,
               "time_ms": c.ms, "workspace_bytes": self.workspace_bytes, "error": c.full.check.error,
               "deterministic": t.deterministic, "math": t.math, "policy": c.policy}
        if c.rest is not None and c.rest.candidate != t:
            row["rest"] = c.rest.candidate.label
        return row


class PlannedConv:
    """conv + bias + ReLU of one stage at batch n, bound to its tensors: the forward, the weight and bias
    gradient, and (when ``dx`` is given) the data gradient masked by ``act > 0``. ``x``, ``y``, ``dy``,
    ``dx``, ``act`` are the batch's rows; ``conv(direction, n, epilogue)`` makes the ConvSpec of each
    direction; ``bias_scratch`` holds C*H*W floats of y for the bias gradient. ``forward_only``: no gradient
    convolution is searched or bound (Note [forward-only plans] in lenet/ops.py)."""

    def __init__(self, engine: Cudnn, planner, name: str, conv, n: int, *, x, w, b, y, dy, dw, db, dx=None, act=None,
                 bias_scratch, forward_only: bool = False):
        self.name, self.n = name, n

        def bound(direction, epilogue, arrays):
            return BoundConv(engine, planner, engine.conv_choice(planner, conv(direction, n, epilogue)), arrays)
        self.forward = bound("fwd", "bias_relu", {"x": x, "w": w, "b": b.reshape(1, -1, 1, 1), "y": y})
        self.wgrad = self.dgrad = self._bias = None
        if forward_only:
            return
        self.wgrad = bound("bwd-filter", "", {"x": x, "dy": dy, "dw": dw})
        if dx is not None:
            arrays = {"dy": dy, "w": w, "dx": dx}
            if act is not None:
                arrays["act"] = act
            self.dgrad = bound("bwd-data", "drelu" if act is not None else "", arrays)
        self._bias = _bias_gradient(planner.ctx.blas, planner.ctx.ones, dy, db, bias_scratch)

    def backward(self) -> None:
        if self.wgrad is None:
            raise forward_only_error(self.name, self.n)
        self.wgrad()
        self._bias()
        if self.dgrad is not None:
            self.dgrad()

    @property
    def workspace_bytes(self) -> int:
        return max(c.workspace_bytes for c in (self.forward, self.wgrad, self.dgrad) if c is not None)

    def describe(self) -> list[dict]:
        rows = [c.describe(self.name) for c in (self.forward, self.wgrad, self.dgrad) if c is not None]
        if self._bias is not None:
            rows.append({"layer": self.name, "op": "bias-grad", "engine": "cublas", "algo": "2 x gemv",
                         "chunk": self.n, "chunks": 1})
        return rows


def _bias_gradient(blas, ones, dy, db, scratch):
    """db[c] = sum of dy[:, c, :, :], as two cuBLAS gemv: over the batch, then over H*W (Note [conv bias
    gradient])."""
    n, c, hh, ww = dy.shape
    tmp = scratch[: c * hh * ww]
    flat = dy.reshape(n, c * hh * ww)

    def run():
        blas.column_sums(flat, ones, tmp)                    # (C*H*W,) sum over N
        blas.row_sums(tmp.reshape(c, hh * ww), ones, db)     # (C,) sum over H*W
    return run


class PlannedPool:
    """y = maxpool2x2(x) at batch n over the batch's rows of x (N, C, H, W) and y, and its backward dx
    from dy, in chunks chosen by timing (Note [pooling batch limit])."""

    workspace_bytes = 0

    def __init__(self, engine: Cudnn, planner, name: str, n: int, *, x, y, dx, dy):
        self.name, self.n = name, n
        h, pool, pol = planner.ctx.handle, engine.pooling(planner), planner.policy
        self.engine = engine.name
        self.mode = pool.read()["mode"]
        chw = tuple(x.shape[1:])
        sizes = chunk_sizes(n, pol.chunk, pol.deterministic and pol.choice("fwd") == "heuristic")
        if min(sizes) > POOL_LIMIT:       # a forced chunk above the limit: the largest that runs
            sizes = [POOL_LIMIT]
        self.chunk, self.ms = self._choose(engine, planner, pool, chw, n, sizes)
        descs = {}
        self._fwd, self._bwd = [], []
        for start in range(0, n, self.chunk):
            k = min(self.chunk, n - start)
            if k not in descs:
                descs[k] = (TensorDescriptor((k, *chw)), TensorDescriptor((k, chw[0], chw[1] // 2, chw[2] // 2)))
            xd, yd = descs[k]
            s = slice(start, start + k)
            xs, ys, dxs, dys = x[s], y[s], dx[s], dy[s]
            self._fwd.append(lambda xd=xd, yd=yd, xs=xs, ys=ys: pool.forward(h, xd, xs, yd, ys))
            self._bwd.append(lambda xd=xd, yd=yd, xs=xs, ys=ys, dxs=dxs, dys=dys:
                             pool.backward(h, yd, ys, yd, dys, xd, xs, xd, dxs))
        self._descs = descs   # the descriptors live as long as the plan

    def _choose(self, engine: Cudnn, planner, pool, chw: tuple, n: int, sizes: list) -> tuple[int, float | None]:
        """(chunk, estimated ms for the whole batch, None when not timed)."""
        if len(sizes) == 1:
            return sizes[0], None

        def trial(chunk, best):
            c = chunk.size
            full = self._time_at(engine, planner, pool, chw, c)
            rest = self._time_at(engine, planner, pool, chw, n % c) if n % c else 0.0
            return "over the pooling's batch limit" if full is None or rest is None else \
                Trial(chunk, (n // c) * full + rest, Check())

        def recall(v):
            return Trial(Chunk(int(v["chunk"])), v.get("ms"), Check()) if v.get("chunk") in sizes else None
        key = planner.key("pool", {"chw": list(chw), "n": n, "sizes": list(sizes), "mode": self.mode}, (engine,))
        d = planner.choose(key, [Chunk(c) for c in sizes], trial, recall=recall,
                           encode=lambda d: {"chunk": d.best.candidate.size, "ms": d.best.ms},
                           what=f"{self.name} in chunks")
        return d.best.candidate.size, d.best.ms

    @staticmethod
    def _time_at(engine: Cudnn, planner, pool, chw: tuple, c: int) -> float | None:
        """ms of forward + backward on c random images (kept in the engine's state); None above POOL_LIMIT."""
        if c > POOL_LIMIT:
            return None
        mode = pool.read()["mode"]
        state = planner.state(engine.name)
        ctx = planner.ctx
        key = ("pool time", ctx.device_id, chw, c, mode, ctx.captured)
        if key not in state:
            import cupy

            ch, hh, ww = chw
            xd, yd = TensorDescriptor((c, ch, hh, ww)), TensorDescriptor((c, ch, hh // 2, ww // 2))
            rng = cupy.random.default_rng(0)
            x, dy = rng.standard_normal(xd.shape, dtype=cupy.float32), rng.standard_normal(yd.shape, dtype=cupy.float32)
            y, dx = cupy.zeros(yd.shape, cupy.float32), cupy.zeros(xd.shape, cupy.float32)
            cupy.cuda.get_current_stream().synchronize()

            def run():
                pool.forward(ctx.handle, xd, x, yd, y)
                pool.backward(ctx.handle, yd, y, yd, dy, xd, x, xd, dx)
            state[key] = planner.time(run)
            for d in (xd, yd):
                d.close()
        return state[key]

    def forward(self) -> None:
        for f in self._fwd:
            f()

    def backward(self) -> None:
        for f in self._bwd:
            f()

    def describe(self) -> list[dict]:
        return [{"layer": self.name, "op": "pool fwd+bwd", "engine": self.engine, "algo": self.mode,
                 "chunk": self.chunk, "chunks": -(-self.n // self.chunk), "time_ms": self.ms, "workspace_bytes": 0}]
