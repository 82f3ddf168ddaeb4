"""What checks a candidate of cuDNN's convolutions: the exact reference (the descriptor API in FMA
float32) and how far a candidate may be from it under a policy.

Note [exact candidates]: every candidate runs on the same random operands as an exact
reference (the descriptor API's implicit GEMM / algo_1 in FMA float32, ~1e-6 of float64),
its output poisoned with NaN first, and its norm-wise relative distance from the reference
is kept with its time. Under heuristic or exhaustive a candidate farther than EXACT_RTOL
(3e-5; every exact algorithm and plan measured <= 1.3e-6 at LeNet's shapes) is dropped: numerical
notes do not catch everything (graph plan eng17_k25=0 of conv1's weight gradient carries no
TF32 or Winograd note and is off by 5.3e-4: docs/probes.md, conv_engines.py). With
allow_winograd the bound is WINOGRAD_RTOL, with allow_tf32 TF32_RTOL. A candidate the user
names is kept whatever its distance, which train_step reports.
"""

from __future__ import annotations

from .algorithms import AlgoPolicy, AlgorithmNotSupportedError, Workspace
from .candidates import ConvSpec, LegacyConvs

EXACT_RTOL = 3e-5
WINOGRAD_RTOL = 3e-3
TF32_RTOL = 1e-2
# The exact reference of each direction, first supported wins (see Note [exact candidates]).
REFERENCE = {"fwd": ("implicit_gemm", "implicit_precomp_gemm", "gemm"), "bwd-data": ("algo_1", "algo_0"),
             "bwd-filter": ("algo_1", "algo_0", "algo_3")}


def tolerance(policy) -> float:
    """How far from the exact reference a candidate may be under ``policy`` (its allow_tf32 and
    allow_winograd)."""
    return TF32_RTOL if policy.allow_tf32 else WINOGRAD_RTOL if policy.allow_winograd else EXACT_RTOL


def reference(handle, spec: ConvSpec, arrays: dict, legacy: LegacyConvs | None = None):
    """The exact answer on ``arrays`` (a copy), from the descriptor API in FMA float32; ``legacy`` holds
    the descriptors it makes (a source of the caller's, or one made and closed here)."""
    import cupy

    own = legacy is None
    legacy = legacy or LegacyConvs()
    exact = AlgoPolicy()
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
    with handle.stream:   # a copy, not CuPy's copy kernel (Note [first run] in lenet/kernels/nvrtc.py)
        ref.data.copy_from_device_async(out.data, out.nbytes)
    handle.stream.synchronize()
    if own:
        legacy.close()
    return ref


__all__ = ["reference", "tolerance", "EXACT_RTOL", "WINOGRAD_RTOL", "TF32_RTOL", "REFERENCE"]
