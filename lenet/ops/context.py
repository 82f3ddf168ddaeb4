"""What planning an operation needs besides the tensors it reads and writes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanContext:
    """The cuDNN handle (its stream is the model's), the policy that filters and chooses candidates,
    the model's search (descriptors.search.Search: its caches and its store of choices), the workspace
    every convolution shares, cuBLAS (with a vector of ones for its sums), cuBLASLt (made
    on first use), cuDNN's pooling and ReLU descriptors, the side stream, and how the step will run:
    ``fused`` lets operations fuse, ``captured`` times candidates as a CUDA graph runs them (else as
    eager launches)."""

    handle: object
    policy: object
    search: object
    workspace: object
    blas: object
    ones: object
    lt: object        # lenet.blas.LazyLt
    pool: object
    relu: object
    side: "SideStream"
    fused: bool
    captured: bool

    @property
    def stream(self):
        return self.handle.stream


class SideStream:
    """Work off the step's critical path, forked from the main stream and joined back before the update.

    Note [side stream]: a weight gradient summed from per-block partial rows (our stage and head
    kernels) is read by nothing but the update, while the layer below waits for the data gradient
    only. ``run(fn)`` launches fn on a second stream after everything queued on the main stream so
    far; ``join()`` makes the main stream wait for all of it. Inside a captured step the pair becomes
    a parallel branch of the CUDA graph, so at small batches the reduction kernels (a few
    microseconds each, plus their launch) leave the chain of dependent launches that sets the
    step's time. Every step (and every timed candidate) joins before it ends: nothing is left running.
    Only while the work beside it leaves SMs idle, though: our stage kernels split their images among
    their blocks up front, so a reduction sharing their SMs at a large batch slows the blocks it meets
    and with them the whole kernel (the step at batch 8192 went from 817 to 889 us on an H100 when every
    reduction forked). Ops fork only when their grid fits in the SMs.
    """

    def __init__(self, main):
        import cupy

        self.main = main
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._fork = cupy.cuda.Event(disable_timing=True)
        self._done = cupy.cuda.Event(disable_timing=True)
        self._pending = False

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

    def run(self, fn) -> None:
        self._fork.record(self.main)
        self.stream.wait_event(self._fork)
        with self.stream:
            fn()
        self._pending = True

    def join(self) -> None:
        if self._pending:
            self._done.record(self.stream)
            self.main.wait_event(self._done)
            self._pending = False
