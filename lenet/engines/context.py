"""What every engine and the planner share for one model: the GPU resources its planned operations use
(the handle and its stream, the workspace every cuDNN call shares, cuBLAS with a vector of ones for its
sums, the model's one cuBLASLt handle, the side stream) and how the step runs (``captured``: in a CUDA
graph). One per model (the planner's ``ctx``); nothing here is shared between two models.

Note [side stream]: a weight gradient summed from per-block partial rows (our stage and head kernels)
is read by nothing but the update, while the layer below waits for the data gradient only.
``SideStream.run(fn)`` launches fn on a second stream after everything queued on the main stream so
far; ``join()`` makes the main stream wait for all of it. Inside a captured step the pair becomes a
parallel branch of the CUDA graph, so at small batches the reduction kernels (a few microseconds each,
plus their launch) leave the chain of dependent launches that sets the step's time. Every step (and
every timed candidate) joins before it ends: nothing is left running. Only while the work beside it
leaves SMs idle, though: our stage kernels split their images among their blocks up front, so a
reduction sharing their SMs at a large batch slows the blocks it meets and with them the whole kernel
(docs/engines.md, "The side stream"). Ops fork only when their grid fits in the SMs.
"""

from __future__ import annotations

import numpy as np

from descriptors.algorithms import Workspace

from ..blas import Blas, LazyLt


class SideStream:
    """Work off the step's critical path, forked from the main stream and joined back before the update
    (Note [side stream]): on lane 0 (``stream``) the weight gradients' sums, on lane 1 the loss's total
    (Note [the loss beside the step] in lenet/kernels/head_split.cu), each a stream of its own so that
    neither waits for the other."""

    LANES = 2

    def __init__(self, main):
        import cupy

        self.main = main
        self.streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(self.LANES)]
        self.stream = self.streams[0]
        self._fork = cupy.cuda.Event(disable_timing=True)
        self._done = [cupy.cuda.Event(disable_timing=True) for _ in range(self.LANES)]
        self._pending: set[int] = set()

    @staticmethod
    def fits(blocks: int) -> bool:
        """Whether a grid of ``blocks`` leaves the SMs room for the main stream's work: the rule above."""
        from ..kernels import sm_count

        return blocks <= sm_count()

    def joined(self, fn):
        """fn, then the join: what a step waits for (how a candidate that forks is timed)."""
        def run():
            fn()
            self.join()
        return run

    def run(self, fn, lane: int = 0) -> None:
        """fn's launches on ``lane``, after everything queued on the main stream so far."""
        stream = self.streams[lane]
        self._fork.record(self.main)
        stream.wait_event(self._fork)
        with stream:
            fn()
        self._pending.add(lane)

    def join(self) -> None:
        for lane in sorted(self._pending):
            self._done[lane].record(self.streams[lane])
            self.main.wait_event(self._done[lane])
        self._pending.clear()


class Context:
    """One model's shared GPU resources (above), made on its handle's stream."""

    def __init__(self, handle, max_batch: int, captured: bool = True):
        import cupy

        self.handle, self.stream = handle, handle.stream
        self.captured = bool(captured)
        self.workspace = Workspace()
        with self.stream:
            self.blas = Blas(self.stream)
            self.side = SideStream(self.stream)
            self.ones = cupy.asarray(np.ones(max(int(max_batch), 576), np.float32))   # (max(N, 24*24),)
        self.lt = LazyLt(self.stream)   # cuBLASLt, made on first use

    @property
    def device_id(self) -> int:
        return self.handle.device_id

    def close(self) -> None:
        self.blas.close()


__all__ = ["Context", "SideStream"]
