"""What planning an operation needs besides the tensors it reads and writes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanContext:
    """The cuDNN handle (its stream is the model's), the policy that filters and chooses candidates,
    the workspace every convolution shares, cuBLAS (with a vector of ones for its sums), cuDNN's
    pooling descriptor, and how the step will run: ``fused`` lets operations fuse, ``captured`` times
    candidates as a CUDA graph runs them (else as eager launches)."""

    handle: object
    policy: object
    workspace: object
    blas: object
    ones: object
    pool: object
    fused: bool
    captured: bool
