"""Our engine: kernels of our own (lenet/kernels/), for every operation of the network.

  stage   each direction fused into one kernel (stage*.cu; the backward plus one reduction of the
          per-block weight and bias gradients): the candidates are launch shapes and kernel versions
          (lenet/kernels/stages.py), chosen per direction by the planner, each checked against cuDNN's
          exact result first (Note [checking a stage] in lenet/engines/reference.py)
  head    the forward, loss, dlogits and data gradients in one kernel (head.cu: G images per block
          iteration) or two (head_split.cu: fc1 over 15 blocks a slice of G images, then the rest over 8;
          Note [head split]), and the weight gradients on the side stream (head_weights.cu); or, at large
          batches, fc1 and its two gradient products on cuBLASLt and the rest in one pass of ours
          (head_tail.cu: Note [head tail]); the form and G are the candidates (Note [head latency] in
          lenet/kernels/head.cu); a pack's, their pack versions, each model on its lone run's grid
          (head_common.cu)
  loss    softmax cross-entropy (softmax_ce.cu), where the head does not fuse it; and evaluation's
  update  SGD with momentum, weight decay and the moving average, one launch (sgd.cu)

``heuristic`` takes each list's first launch shape (a rule: no timing), ``exhaustive`` times them all.
Our kernels are float32 and deterministic: a fixed launch shape sums the gradients in a fixed order (Note
[stage backward through the argmax] in stage_common.cu). FMA float32, but for conv2's backward versions 7 and 8,
whose weight gradient runs on the tensor cores as three TF32 products per float32 product, within float32's
accuracy (Note [three tf32 products] in lenet/kernels/tf32.cu); it passes the same check.

Note [pinned candidates]: --algo may name one of our candidates as train_step prints it:
``fused-fwd-v1-i1-g8`` pins the stages' forward, ``fused-bwd-v2-g4`` their backward (both backward
directions of the policy). A pinned candidate still passes the check against cuDNN's exact result;
one a stage does not offer (conv1 ships forward version 1 and backward version 2, conv2 forward versions 1
and 2 and backward versions 3, 4, 5, 7 and 8: ``fused-bwd-v3-...`` to ``fused-bwd-v8-...`` pin conv2's and are
refused for conv1; a version that moved to dev/ is no kernel of ours) is an error naming those it has.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from descriptors.algorithms import AlgorithmNotSupportedError, UnknownAlgorithmError

from .. import params as P
from ..kernels import SoftmaxCE, pack_module, prefetch, sgd_launch, sm_count, source_digest
from ..kernels import head as head_kernels
from ..kernels.head import HeadShape
from ..kernels import stages
from ..kernels.stages import Backward, Forward
from . import reference
from .base import LONE_SUMS_PER_SM, Check, Named, Trial, sums_as_lone


def pins(name: str) -> tuple[str, ...]:
    """The policy directions a candidate name of ours fixes: a forward's, "fwd"; a backward's, both
    backward directions (one kernel computes the stage's data and weight gradients). A name of our form
    that no stage's kernels offer (a version, an image count or a grid that does not exist) is an
    UnknownAlgorithmError naming those that do: checked with the flags, before any GPU work."""
    c = stages.parse_name(name)
    if c is None:
        return ()
    if not any(ks.offers(c) for ks in stages.kernels().values()):
        raise UnknownAlgorithmError(f"--algo {name}: no kernel of ours has that name; ours are {stages.names()}")
    return ("fwd",) if isinstance(c, Forward) else ("bwd-data", "bwd-filter")


PACK_CHECK_MODELS = 3   # models of a pack version's check (Note [checking a pack])
TUNED_ALGOS = 8         # cuBLASLt algorithms the tail form times for each of its products
# Note [sliced weight gradient]: fc1's weight gradient sums 120 x 256 products over the whole batch, and
# cuBLASLt's own split of that sum left most of an H100 idle: at 8192 images 52.8 us over 64 blocks (8
# tiles, split 8 ways), at 65536 166 us (8 x 15 blocks) with the fastest of its first 8 algorithms. Our
# tail form can run it as S matmuls over slices of n // S images in one batched call (8 S tiles), the
# rest of the images in one more, and add the S (+ 1) partial products in order with stage_reduce: a
# fixed S sums in a fixed order. The search times S in DW1_SLICES against cuBLASLt's one matmul.
DW1_SLICES = (64, 32, 16, 8)
DW1_MIN_ROWS = 128             # slices the search times have at least this many images


class Ours:
    name = "ours"
    flag = "ours"
    kinds = ("stage", "head", "loss", "update")
    pins = staticmethod(pins)

    # ---------------------------------------------------------------- rules

    def refuses(self, op, policy) -> str | None:
        if op.kind in ("loss", "update"):
            return None   # our kernels alone run these, under every engine
        if policy.engine not in ("auto", self.flag):
            return f"engine {policy.engine} runs cuDNN only"
        if not policy.fused:
            return "fusion is off (--no-fused), and our stages and head are fused kernels"
        if op.kind != "stage":
            return None
        if policy.chunk is not None:
            return "runs the whole batch in one launch, and --chunk fixes cuDNN's calls"
        theirs = [name for name, owner in policy.owners().items() if owner != self.name]
        if theirs:
            return f"--algo names cuDNN's {theirs[0]}"
        if op.spec.dx and not op.spec.dx_mask:
            return f"no kernel of ours computes stage {op.spec.name}'s unmasked input gradient (the images')"
        if stages.for_spec(op.spec) is None:
            return f"no kernel of ours for x {op.spec.x}, w {op.spec.w}"
        return None

    def refuses_flags(self, policy) -> str | None:
        if not policy.fused:
            return "runs our fused stage kernels only: drop --no-fused, or name a cuDNN engine"
        if policy.chunk is not None:
            return "runs each stage in one launch over the whole batch: --chunk applies to cuDNN's engines only"
        return None

    def version(self) -> str:
        """The kernels' sources and the architecture they are compiled for (Note [kernel architecture] in
        lenet/kernels/nvrtc.py): a stored choice of another either is searched again."""
        from ..kernels import nvrtc

        want = nvrtc.requested_arch()
        return source_digest() + (f"-compute_{want}" if want is not None else "")

    @staticmethod
    def scratch_per_image(op, policy) -> int:
        """Bytes per image of max_batch this engine allocates for ``op``: a stage's argmax bytes; in a pack,
        its head's partial rows, and under --deterministic its stages' on each model's lone grid (at most
        one row per image: Note [a pack and a lone run] in lenet/pack.py)."""
        if op.kind == "stage":
            lone = op.models > 1 and policy.deterministic
            return int(np.prod(op.spec.y)) + (4 * stages.for_spec(op.spec).width if lone else 0)
        return -(-4 * head_kernels.WIDTH // head_kernels.HEAD_PER[0]) if op.kind == "head" and op.models > 1 else 0

    def warm(self, batches=None) -> None:
        """Start compiling the kernels the heuristic runs at these batch sizes (or reading them from the
        kernel cache) on threads of their own (Note [first run] in lenet/kernels/nvrtc.py); the rest
        compile when a plan asks for them: versions only a search times would share the CPU with the
        compiles a first step waits for."""
        large = not batches or max(batches) >= head_kernels.TAIL_HEURISTIC_MIN   # the tail form's kernels
        prefetch(stages.heuristic_modules(batches) + (("head_tail",) if large else ()))

    # ---------------------------------------------------------------- the protocol

    def candidates(self, op, n: int, planner) -> list:
        if op.kind == "head":
            # A pack that sums as its lone runs takes its lone run's shapes (Note [a pack and a lone run] in
            # lenet/pack.py); a reproducible policy's rule never the tail form, whose sums are cuBLASLt's
            # algorithms' (a search still may).
            policy, K = planner.policy, op.models
            heuristic = policy.choice("fwd") == "heuristic"
            lone = K > 1 and sums_as_lone(K, n, policy)
            return [replace(s, engine=self.name) for s in head_kernels.shapes(n, heuristic, 1 if lone else K)
                    if not (policy.reproducible and s.form == "tail")]
        return [Named(self.name, {"stage": "fused kernels", "loss": "softmax_ce", "update": "sgd"}[op.kind])]

    def check(self, op, candidate, planner) -> Check:
        # A stage's directions are checked as they are chosen (``_direction``); the head, the loss and the
        # update are held to PyTorch's in float64 by the GPU tests, not at plan time.
        return Check()

    def recall(self, op, n: int, stored: dict, planner):
        if op.kind == "head":
            shape = HeadShape.decode(stored)
            return next((c for c in self.candidates(op, n, planner) if c == shape), None)
        return self.candidates(op, n, planner)[0]

    def bind(self, op, n: int, candidate, planner):
        if op.kind == "stage":
            return self._stage(op, n, planner)
        if op.kind == "head":
            return self._head(op, n, candidate, planner)
        if op.kind == "loss":
            K = op.models
            sce = self._scratch(planner, ("sce", K), lambda: SoftmaxCE(models=K))
            return PlannedLoss(op.tensors, n, sce, planner.stream, K)
        return PlannedUpdate(op.tensors, planner.stream)

    @staticmethod
    def _scratch(planner, key, make):
        """This engine's buffers for one model, made (and zeroed) once, on the model's stream."""
        state = planner.state("ours")
        if key not in state:
            with planner.stream:
                state[key] = make()
        return state[key]

    # ---------------------------------------------------------------- stages

    def stage_candidates(self, spec, policy, n: int | None = None) -> tuple[list, list]:
        """(forward candidates, backward candidates) of a stage under ``policy`` at batch n: the first of
        each (heuristic), all (exhaustive), or the one --algo names (Note [pinned candidates])."""
        ks = stages.for_spec(spec)
        out = []
        for cands, directions in ((ks.forward_candidates(n), ("fwd",)),
                                  (ks.backward_candidates(n), ("bwd-filter", "bwd-data"))):
            named = {policy.choice(d) for d in directions if policy.fixed(d)}
            if len(named) > 1:
                raise AlgorithmNotSupportedError(f"--algo pins two backwards of ours ({', '.join(sorted(named))}); "
                                                 f"one kernel runs both gradients: name one")
            if named:
                pick = stages.parse_name(named.pop())
                if not ks.offers(pick):
                    raise AlgorithmNotSupportedError(
                        f"stage {spec.name} has no candidate {pick.name}; it offers "
                        f"{', '.join(c.name for c in cands[:3])} ... ({len(cands)} in all, as train_step "
                        f"--algo exhaustive lists the winners)")
                why = ks.refuses(pick)
                if why is not None:
                    raise AlgorithmNotSupportedError(f"stage {spec.name}: {why}")
                cands = [pick]
            elif all(policy.choice(d) == "heuristic" for d in directions):
                cands = cands[:1]
            out.append(cands)
        return out[0], out[1]

    def _reference(self, planner, spec):
        state = planner.state("ours")
        key = ("reference", planner.handle.device_id, spec)
        if key not in state:
            state[key] = reference.stage_reference(planner.handle, spec)
        return state[key]

    def check_stage(self, planner, spec, cand, models: int = 1, lone_grid: bool = False) -> Check:
        """A launch shape against cuDNN's exact result, once per candidate and model (Note [checking a
        stage]); for a pack of ``models``, its pack version as the pack launches it (``lone_grid``: each
        model on its lone run's grid, as under --deterministic)."""
        state = planner.state("ours")
        models = min(models, PACK_CHECK_MODELS)
        lone_grid = lone_grid and models > 1
        key = ("check", planner.handle.device_id, spec, cand, models) + (("lone grid",) if lone_grid else ())
        if key not in state:
            state[key] = self._run_check(planner, spec, cand) if models == 1 else \
                self._run_pack_check(planner, spec, cand, models, 1 if lone_grid else models)
        return state[key]

    def _run_pack_check(self, planner, spec, cand, K: int, share: int) -> Check:
        """Note [checking a pack]: the pack version of a launch shape (lenet/kernels/stage_common.cu, Note
        [model from the grid]) is its own binary. It is checked as the pack launches it, K models on the
        grid, each given the reference's operands at its own rows and parameter offset: every model's result
        must pass the one-model check against cuDNN's, and the worst is the candidate's. PACK_CHECK_MODELS
        models stand for any K: the pack version differs from the one-model kernel only in the offsets of
        blockIdx.y, the same for every model, and a check reads each model's output back to the host."""
        import cupy

        from ..kernels import device_copy

        ks, handle = stages.for_spec(spec), planner.handle
        ref = self._reference(planner, spec)
        m = ref.x.shape[0]
        wsize, bsize = int(np.prod(spec.w)), spec.w[0]
        boff = -(-wsize // 64) * 64
        ps = boff + -(-bsize // 64) * 64   # each model's (w, b) row, as the flat parameter buffer lays them out

        def unset(shape, dtype=np.float32):
            a = cupy.empty(shape, dtype)
            a.data.memset_async(0xFF, a.nbytes)
            return a

        def copies(a):   # K copies of a, one after another
            out = cupy.empty((K * a.shape[0], *a.shape[1:]), a.dtype)
            for k in range(K):
                device_copy(out[k * a.shape[0]:(k + 1) * a.shape[0]], a)
            return out
        checks = []
        with handle.stream:
            params = cupy.zeros((K, ps), cupy.float32)
            for k in range(K):
                device_copy(params[k, :wsize], ref.w.reshape(-1))
                device_copy(params[k, boff:boff + bsize], ref.b.reshape(-1))
            x, w, b = copies(ref.x), params[0, :wsize].reshape(spec.w), params[0, boff:boff + bsize]
            if isinstance(cand, Forward):
                y, arg = unset((K * m, *ref.y.shape[1:])), unset((K * m, *ref.arg.shape[1:]), np.uint8)
                stages.stage_forward(ks, cand, m, handle.stream, x, w, b, y, arg, K, ps, share)()
                for k in range(K):
                    rows = slice(k * m, (k + 1) * m)
                    checks.append(reference.check_forward(ref, y[rows], arg[rows]))
            else:
                part = cupy.zeros((cand.grid(m, share) * K, ks.width), cupy.float32)
                grads = unset((K, ps))
                dx = unset((K * m, *ref.x.shape[1:])) if spec.dx else None
                stages.stage_backward(ks, cand, m, handle.stream, part, x, w, copies(ref.arg), copies(ref.dy),
                                      grads[0, :wsize].reshape(spec.w), grads[0, boff:boff + bsize], dx, None, K, ps,
                                      share)()
                for k in range(K):
                    (err, why) = reference.check_backward(ref, grads[k, :wsize].reshape(spec.w),
                                                          grads[k, boff:boff + bsize],
                                                          dx[k * m:(k + 1) * m] if dx is not None else None)
                    checks.append((err, 0, why))
        handle.stream.synchronize()
        failed = [c for c in checks if c[2] is not None]
        err, ties, why = failed[0] if failed else max(checks, key=lambda c: c[0])
        return Check(err, ties, why if why is None else f"in a pack of {K}: {why}")

    def _run_check(self, planner, spec, cand) -> Check:
        import cupy

        ks, handle = stages.for_spec(spec), planner.handle
        ref = self._reference(planner, spec)
        m = ref.x.shape[0]

        def unset(shape, dtype=np.float32):
            """Every bit set, as a search marks its outputs: NaN as float32, 255 as a byte, what a kernel
            that does not write there leaves; a memset, no fill kernel to compile (Note [no generic
            kernels in the check] in lenet/engines/reference.py)."""
            a = cupy.empty(shape, dtype)
            a.data.memset_async(0xFF, a.nbytes)
            return a
        with handle.stream:
            if isinstance(cand, Forward):
                y, arg = unset(ref.y.shape), unset(ref.arg.shape, np.uint8)
                stages.stage_forward(ks, cand, m, handle.stream, ref.x, ref.w, ref.b, y, arg)()
                err, ties, why = reference.check_forward(ref, y, arg)
            else:   # on its grid, then on one block that sums all m images (Note [checking a stage])
                part = cupy.zeros((cand.grid(m), ks.width), cupy.float32)
                checks = []
                for share in (1, cand.one_block()):
                    dw, db = unset(spec.w), unset(spec.w[0])
                    dx = unset(ref.x.shape) if spec.dx else None
                    stages.stage_backward(ks, cand, m, handle.stream, part, ref.x, ref.w, ref.arg, ref.dy, dw, db, dx,
                                          share=share)()
                    checks.append(reference.check_backward(ref, dw, db, dx))
                failed = [c for c in checks if c[1] is not None]
                (err, why), ties = failed[0] if failed else max(checks, key=lambda c: c[0]), 0
                if why is not None and checks[0][1] is None:
                    why = f"summed by one block: {why}"
        handle.stream.synchronize()
        return Check(err, ties, why)

    @staticmethod
    def share(op, n: int, policy) -> int:
        """How many models share the SMs in each model's grid: a pack's K, or 1 (each model its lone run's
        grid and candidates) where a model sums as its lone run does (``sums_as_lone``: under
        --deterministic, or a pack small enough; Note [a pack and a lone run] in lenet/pack.py)."""
        return 1 if sums_as_lone(op.models, n, policy) else op.models

    def _stage(self, op, n: int, planner) -> "OursStagePlan":
        spec, ks, stream, side = op.spec, stages.for_spec(op.spec), planner.stream, planner.side
        K = op.models   # a pack: Note [model from the grid] in lenet/kernels/stage_common.cu
        share = self.share(op, n, planner.policy)

        def make():   # rows for every batch up to max_batch: a pack's grids round up per model
            import cupy

            most = max(stages.BACKWARD_BLOCKS_PER_SM) * sm_count()
            lone = K * min(op.max_batch, most)   # each model on its lone grid: at most one row per image
            if K > 1 and not planner.policy.deterministic:   # and only while K n <= LONE_SUMS_PER_SM SMs
                lone = min(lone, LONE_SUMS_PER_SM * sm_count())
            rows = lone if K == 1 else max(most + K, lone)
            return {"arg": cupy.zeros((K * op.max_batch, *spec.y), cupy.uint8),   # (N, K, H/2, W/2) argmax bytes
                    "part": cupy.zeros((rows, ks.width), cupy.float32)}          # (blocks, mw + mb) partial sums
        own = self._scratch(planner, ("stage", op.name), make)
        t, arg = op.tensors.rows(K * n), own["arg"][: K * n]
        fwds, bwds = self.stage_candidates(spec, planner.policy, share * n)   # a pack fills the GPU as K n images do
        prefetch({pack_module(m, K) for m in {ks.module(c).name for c in fwds + bwds} | {"stage_reduce"}})   # at once

        def forward(c):
            run = stages.stage_forward(ks, c, n, stream, t.x, t.w, t.b, t.y, arg, K, P.TOTAL, share)
            return run, run

        def backward(c):   # the reduction goes to the side stream only while the grid leaves SMs idle
            run = stages.stage_backward(ks, c, n, stream, own["part"], t.x, t.w, arg, t.dy, t.dw, t.db, t.dx,
                                        side if side.fits(K * c.grid(n, share)) else None, K, P.TOTAL, share)
            return run, side.joined(run)
        fwd = self._direction(op, n, "fwd", fwds, forward, planner)
        bwd = self._direction(op, n, "bwd", bwds, backward, planner, before=fwd.best.plan)
        return OursStagePlan(spec, n, fwd.best, bwd.best)

    def _direction(self, op, n, d: str, cands: list, launcher, planner, before=None):
        """The planner's decision for one direction of a stage: every candidate checked, then timed (where
        there is more than one) as the step runs it; ``before`` runs first (the backward reads what the
        chosen forward leaves: the argmax)."""
        ks = stages.for_spec(op.spec)
        kind = Forward if d == "fwd" else Backward

        def trial(c, best):
            check = self.check_stage(planner, op.spec, c, op.models, self.share(op, n, planner.policy) == 1)
            if check.why is not None:
                return check.why
            run, timed = launcher(c)
            if before is not None:
                before()
            return Trial(c, planner.time(timed) if len(cands) > 1 else None, check, run)

        def recall(stored):   # checked when it was stored (Note [checking a stage]); offered now (the heuristic's)
            c = stages.parse_name(stored["name"])
            if not isinstance(c, kind) or not ks.offers(c) or c not in cands:
                return None
            return Trial(c, stored.get("ms"), Check(stored.get("error"), int(stored.get("ties") or 0)), launcher(c)[0])

        def encode(dec):
            b = dec.best
            return {"name": b.candidate.name, "ms": b.ms, "error": b.check.error, "ties": b.check.ties}
        lone = {"lone_grids": self.share(op, n, planner.policy) == 1} if op.models > 1 else {}   # which sums
        key = planner.key(f"stage {op.name} {d}", {"n": n, **op.key(), **lone}, (self,))
        return planner.choose(key, cands, trial, recall=recall, encode=encode,
                              what=f"the {d} kernel of ours for stage {op.name}")

    # ---------------------------------------------------------------- the head

    def _head(self, op, n: int, shape: HeadShape, planner) -> "OursHeadPlan":
        K = op.models   # a pack: each model on its lone run's grid (head_common.cu)
        part, sce = self._scratch(planner, ("head", K), lambda: head_kernels.scratch(K, op.max_batch))
        if shape.form == "tail":
            return OursHeadPlan(self._tail(op, n, shape, sce, planner), shape, n)
        if K > 1:
            prefetch((pack_module("head_split" if shape.split else "head", K), pack_module("head_weights", K),
                      pack_module("stage_reduce", K)))
        return OursHeadPlan(head_kernels.HeadLaunches(op.tensors, op.loss, n, shape, part, sce, planner.stream,
                                                      planner.side, K), shape, n)

    def _tail(self, op, n: int, shape: HeadShape, sce, planner) -> "head_kernels.TailLaunches":
        """The tail form (Note [head tail] in lenet/kernels/head_tail.cu): fc1's three products on cuBLASLt
        (a pack's batched, or each model's alone where it sums as its lone run), the rest ours."""
        from ..blas import LazyLt, LtUnavailable
        from .fc import fc_matmuls

        K = op.models
        prefetch((pack_module("head_tail", K), pack_module("stage_reduce", K)))
        rows = self._scratch(planner, ("tail", K), lambda: head_kernels.tail_scratch(K, op.max_batch))
        lt = self._scratch(planner, "lt", lambda: LazyLt(planner.stream))
        names = ("fc1", "dW1", "dp2")
        share = self.share(op, n, planner.policy)
        try:
            if share > 1 or K == 1:   # Note [tuned matmuls] in lenet/blas.py
                mats = [fc_matmuls(lt.get(), op.tensors, n, K, names=names, bias_grads=False, algos=TUNED_ALGOS)]
                picks = self._tail_picks(lt.get(), op, n, mats[0], planner)
                for name in ("fc1", "dp2"):
                    mats[0][name].use(getattr(picks, name))
                mats[0]["dW1"] = self._dw1(lt.get(), op, n, mats[0]["dW1"], picks.dW1, picks.slices, planner)[1]
            else:
                mats = [fc_matmuls(lt.get(), op.tensors, n, K, model=m, names=names, bias_grads=False)
                        for m in range(K)]
        except (LtUnavailable, ImportError) as e:
            raise AlgorithmNotSupportedError(f"{shape.name}: {e}") from None
        return head_kernels.TailLaunches(op.tensors, op.loss, n, shape, mats, rows, sce, planner.stream, K,
                                         mask=op.dx_mask, share=share)

    def _tail_picks(self, lt, op, n: int, mats: dict, planner) -> "TailPicks":
        """The tail's cuBLASLt algorithms and dW1's slices: a decision of the planner's (Note [stored
        choices] in lenet/plan.py), so a later run recalls it instead of timing them again (70 ms of a fast
        run's start-up on an H100, at its evaluation batch of 1000). Timed: a reproducible policy's rule
        never takes the tail form (``candidates``)."""
        def search(c, best):
            for name in ("fc1", "dp2"):
                mats[name].tune(planner.time)
            dw1 = mats["dW1"]
            best_ms = min(dw1.tune(planner.time))
            algo, slices = dw1.pick, 1
            if op.models == 1:   # Note [sliced weight gradient]
                for S in DW1_SLICES:
                    if n // S >= DW1_MIN_ROWS:
                        mm, run = self._dw1(lt, op, n, dw1, 0, S, planner)
                        mm.tune(planner.time)
                        ms = planner.time(run)
                        if ms < best_ms:
                            algo, slices, best_ms = mm.pick, S, ms
            return Trial(TailPicks(self.name, mats["fc1"].pick, algo, mats["dp2"].pick, slices), None)

        def recall(stored):
            p = TailPicks(self.name, *(int(stored[k]) for k in ("fc1", "dW1", "dp2", "slices")))
            ok = p.fc1 < len(mats["fc1"].algos) and p.dp2 < len(mats["dp2"].algos) and p.dW1 < TUNED_ALGOS and (
                p.slices == 1 and p.dW1 < len(mats["dW1"].algos)
                or op.models == 1 and p.slices in DW1_SLICES and n // p.slices >= DW1_MIN_ROWS)
            return Trial(p, None) if ok else None

        key = planner.key("head tail matmuls", {"n": n, **op.key()}, (self,))
        return planner.choose(key, [TailPicks(self.name)], search, recall=recall,
                              encode=lambda d: d.best.candidate.encode(),
                              what=f"the tail's cuBLASLt algorithms at batch {n}").best.candidate

    def _dw1(self, lt, op, n: int, whole, algo: int, slices: int, planner):
        """dW1 = dh1^T p2 over the batch: cuBLASLt's one matmul (``whole``, slices 1), or S of them over
        slices of the images in one batched call, their partial products added in slice order by
        stage_reduce (Note [sliced weight gradient]), the matmul running cuBLASLt's algorithm ``algo``.
        Returns (the matmul, what runs dW1)."""
        if slices == 1:
            whole.use(algo)
            return whole, whole
        import cupy

        from ..blas import LtMatmul
        from ..kernels import kernel
        from ..kernels.launch import Launch

        t, width = op.tensors, P.SHAPES["fc1.weight"][0] * P.SHAPES["fc1.weight"][1]
        part = self._scratch(planner, "dw1 rows", lambda: cupy.zeros((max(DW1_SLICES) + 1, width), cupy.float32))
        red = kernel("stage_reduce", "stage_reduce_kernel")
        g, S = t.g["fc1.weight"], slices
        r = n // S
        mm = LtMatmul(lt, t.dh1[:r], t.x[:r], part[0].reshape(g.shape), trans_a=True, batch=S,
                      strides=(r * t.dh1.shape[1], r * t.x.shape[1], width), algos=TUNED_ALGOS)
        mm.use(min(algo, len(mm.algos) - 1))
        rest = (LtMatmul(lt, t.dh1[S * r:n], t.x[S * r:n], part[S].reshape(g.shape), trans_a=True)
                if S * r < n else None)
        rows = S + (rest is not None)
        reduce = Launch(red, (-(-width // 32),), (256,), (part, g, g, np.int32(rows), np.int32(width), np.int32(0),
                                                         np.int32(P.TOTAL)), planner.stream)

        def run():
            mm()
            if rest is not None:
                rest()
            reduce()
        return mm, run


@dataclass(frozen=True)
class TailPicks:
    """The tail form's cuBLASLt choices (``Ours._tail_picks``): the algorithm of each product (an index in
    its heuristic's ranking) and the slices of dW1 (1: one matmul)."""

    engine: str
    fc1: int = 0
    dW1: int = 0
    dp2: int = 0
    slices: int = 1

    @property
    def name(self) -> str:
        return f"fc1 a{self.fc1}, dW1 a{self.dW1}" + (f" over {self.slices} slices" if self.slices > 1 else "") + \
            f", dp2 a{self.dp2}"

    def encode(self) -> dict:
        return {"fc1": self.fc1, "dW1": self.dW1, "dp2": self.dp2, "slices": self.slices}


class OursStagePlan:
    """A stage on our kernels at batch n: the chosen forward and backward (lenet.plan.Trial each)."""

    engine = "ours"
    workspace_bytes = 0
    masks_dy = True   # the argmax byte's ReLU bit (Note [the ReLU bit] in lenet/kernels/stage_common.cu)

    def __init__(self, spec, n: int, fwd, bwd):
        self.spec, self.n, self.fwd, self.bwd = spec, n, fwd, bwd
        self.forward, self.backward = fwd.plan, bwd.plan

    def describe(self) -> list[dict]:
        name, f, b = self.spec.name, self.fwd, self.bwd
        return [
            {"layer": name, "op": "fwd+bias_relu_pool", "engine": "ours", "algo": f.candidate.name, "fused": True,
             "chunk": self.n, "chunks": 1, "time_ms": f.ms, "workspace_bytes": 0, "error": f.check.error,
             "ties": f.check.ties, "deterministic": True, "math": "fp32"},
            {"layer": name, "op": "bwd" + ("+data" if self.spec.dx else "") + "+filter+bias", "engine": "ours",
             "algo": b.candidate.name, "fused": True, "chunk": self.n, "chunks": 1, "time_ms": b.ms,
             "workspace_bytes": 0, "error": b.check.error, "deterministic": True, "math": "fp32"},
        ]


class OursHeadPlan:
    """The head on our kernels at batch n (lenet.kernels.head.HeadLaunches)."""

    engine = "ours"
    workspace_bytes = 0
    fuses_loss = True    # a training forward computes the loss and dlogits itself

    def __init__(self, launches, shape: HeadShape, n: int):
        self.shape, self.n = shape, n
        self.forward, self.forward_loss = launches.forward, launches.forward_loss
        self.backward, self.backward_given = launches.backward, launches.backward_given
        self.masks_dx = launches.masks_dx   # dx masked by x > 0 here (else by the stage below: lenet/ops.py, Head)

    def describe(self) -> list[dict]:
        return [{"layer": "fc1+fc2", "op": "fwd+loss+bwd", "engine": "ours", "algo": self.shape.name,
                 "fused": True, "chunk": self.n, "chunks": 1, "time_ms": (self.times or {}).get(f"ours:{self.shape.name}"),
                 "workspace_bytes": 0, "deterministic": True}]

    times: dict | None = None


class PlannedLoss:
    """Softmax cross-entropy at batch n. ``train()``: the mean loss (label-smoothed) into ``loss``,
    dlogits, and the running sum; ``evaluate()``: the summed plain loss and right answers added to the
    device totals, scored on the mean of the logits and ``mean_with`` when given."""

    engine = "ours"
    workspace_bytes = 0

    def __init__(self, t, n: int, sce: SoftmaxCE, stream, models: int = 1):
        self.n, self.t, self.sce, self.stream, self.models = n, t, sce, stream, models
        rows = models * n   # a pack's models one after another (Note [packs] in lenet/ops.py)
        self.logits, self.labels, self.dlogits = t.logits[:rows], t.labels[:rows], t.dlogits[:rows]

    def train(self) -> None:
        t, n = self.t, self.n
        with self.stream:
            self.sce.forward_backward(self.logits, self.labels, self.dlogits, t.loss, t.correct, n,
                                      grad_scale=1.0 / n, loss_scale=1.0 / n, running=t.running,
                                      label_smoothing=t.label_smoothing, models=self.models)

    def evaluate(self, mean_with=None) -> None:
        t, n = self.t, self.n
        with self.stream:
            self.sce.forward_backward(self.logits, self.labels, None, t.loss, t.correct, n,
                                      grad_scale=1.0 / n, loss_scale=1.0, accumulate=True, mean_with=mean_with,
                                      models=self.models)

    def describe(self) -> list[dict]:
        return [{"layer": "loss", "op": "softmax-CE fwd+bwd", "engine": "ours", "algo": "softmax_ce_kernel",
                 "chunk": self.n, "chunks": 1, "workspace_bytes": 0}]


class PlannedUpdate:
    """PyTorch's torch.optim.SGD rule with momentum (plain or Nesterov) and weight decay, the learning
    rate read from device memory; then ema += (1 - ema_decay) * (params - ema) when the model keeps a
    moving average. One launch over the flat buffers (lenet.ops.UpdateTensors)."""

    engine = "ours"
    workspace_bytes = 0

    def __init__(self, t, stream):
        self.t = t
        self._launch = sgd_launch(stream, t.params, t.grads, t.velocity, t.lr, t.momentum, t.weight_decay,
                                  t.nesterov, t.ema, t.ema_decay or 0.0, t.models, t.hyper)

    def __call__(self) -> None:
        self._launch()

    def describe(self) -> list[dict]:
        what = ("nesterov " if self.t.nesterov else "") + ("+ ema" if self.t.ema_decay else "")
        return [{"layer": "sgd", "op": ("update " + what).strip(), "engine": "ours", "algo": "sgd_kernel",
                 "chunk": None, "chunks": 1, "workspace_bytes": 0}]
