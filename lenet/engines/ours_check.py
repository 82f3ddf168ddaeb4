"""Our stage kernels against cuDNN's exact result (Note [checking a stage] in lenet/engines/reference.py):
each launch shape and version once per model before it is timed, and a pack version as the pack
launches it (Note [checking a pack]). Part of our engine (lenet/engines/ours.py)."""

from __future__ import annotations

import numpy as np

from ..kernels import stages
from ..kernels.stages import Forward
from . import reference
from .base import Check, sums_as_lone

PACK_CHECK_MODELS = 3   # models of a pack version's check (Note [checking a pack])


class OurScratch:
    """What every part of our engine asks: its buffers for one model, and how a pack shares the SMs."""

    name: str   # the engine's (lenet/engines/ours.py)

    def _scratch(self, planner, key, make):
        """This engine's buffers for one model, made (and zeroed) once, on the model's stream."""
        state = planner.state(self.name)
        if key not in state:
            with planner.ctx.stream:
                state[key] = make()
        return state[key]

    @staticmethod
    def share(op, n: int, policy) -> int:
        """How many models share the SMs in each model's grid: a pack's K, or 1 (each model its lone run's
        grid and candidates) where a model sums as its lone run does (``sums_as_lone``: under
        --deterministic, or a pack small enough; Note [a pack and a lone run] in lenet/pack.py)."""
        return 1 if sums_as_lone(op.models, n, policy) else op.models



class OurChecks(OurScratch):
    """A stage candidate of ours checked against cuDNN's exact result, once per candidate and model."""

    def _reference(self, planner, spec):
        state = planner.state(self.name)
        key = ("reference", planner.ctx.handle.device_id, spec)
        if key not in state:
            state[key] = reference.stage_reference(planner.ctx.handle, spec)
        return state[key]


    def check_stage(self, planner, spec, cand, models: int = 1, lone_grid: bool = False) -> Check:
        """A launch shape against cuDNN's exact result, once per candidate and model (Note [checking a
        stage]); for a pack of ``models``, its pack version as the pack launches it (``lone_grid``: each
        model on its lone run's grid, as under --deterministic)."""
        state = planner.state(self.name)
        models = min(models, PACK_CHECK_MODELS)
        lone_grid = lone_grid and models > 1
        key = ("check", planner.ctx.handle.device_id, spec, cand, models) + (("lone grid",) if lone_grid else ())
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

        ks, handle = stages.for_spec(spec), planner.ctx.handle
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

        ks, handle = stages.for_spec(spec), planner.ctx.handle
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

