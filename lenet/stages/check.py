"""The exact answer of a stage, from cuDNN, that every candidate of ours is checked against.

Note [checking a stage]: a stage holds two decisions, the pooling's argmax and the ReLU, and a
float32 decision taken at a near-tie may go either way: two exact float32 implementations that sum
in different orders can route a gradient to different positions, and one such decision moves a
weight-gradient entry by a whole term. So a candidate is checked against the same decisions:
  forward   its pooled output within EXACT_RTOL (norm-wise) of the reference, and its argmax equal
            to the reference's at every window with a live output (> 0) whose top two values are
            more than TIE_RTOL * max|conv| apart (the ties it may decide either way are counted);
  backward  given the reference's argmax and the gradient masked by the reference's ReLU, its weight,
            bias and input gradients within EXACT_RTOL of the reference's.
The reference is cuDNN's exact descriptor-API convolutions (descriptors.search.reference, FMA
float32); the operands, the bias, the pooling, the routing through the argmax and every comparison
are NumPy's, on the host. Note [no generic kernels in the check]: done by CuPy on the GPU, they
took about 20 of CuPy's generic kernels and six CUB reductions (count_nonzero, max) that a first
run on a fresh machine compiled with NVRTC before its first step: 16 s of its 26 (H100, every
cache empty). At CHECK_BATCH images the host's work takes milliseconds.
A candidate is checked once per model before it is timed; a stored choice (Note [stored choices] in
descriptors/search.py) was checked when it was stored, and its key names the GPU, the driver, the
libraries and a digest of our kernel sources (lenet.kernels.source_digest), so it is not checked
again: a later run's start-up skips the reference's cuDNN calls (0.4 s measured on an H100).
"""

from __future__ import annotations

from dataclasses import dataclass

from descriptors.search import EXACT_RTOL, reference

TIE_RTOL = 1e-4
CHECK_BATCH = 256


@dataclass
class StageReference:
    # What the kernels read, on the GPU:
    x: object      # (m, C, H, W) operands ...
    w: object
    b: object
    dy: object     # (m, K, H/2, W/2) the pooled gradient masked by the reference's ReLU
    arg: object    # (m, K, H/2, W/2) uint8 argmax q = 2 * dy + dx
    # What they must produce, on the host (NumPy):
    y: object      # pooled output
    arg_host: object
    decided: object  # bool: live windows whose argmax is not a near-tie
    dw: object
    db: object
    dx: object     # masked by x > 0, or None


def operands(spec, m: int, seed: int = 0):
    """Random x (a ReLU output when the stage has an input gradient), w, b, dy at batch m (NumPy)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    f32 = np.float32
    x = rng.standard_normal((m, *spec.x), dtype=f32)
    if spec.dx:
        x = np.maximum(x, f32(0))
    w = rng.standard_normal(spec.w, dtype=f32) * f32(0.2)
    b = rng.standard_normal(spec.w[0], dtype=f32) * f32(0.1)
    dy = rng.standard_normal((m, *spec.y), dtype=f32)
    return x, w, b, dy


def _host(a):
    """A NumPy copy of a CuPy array (or the array itself)."""
    import numpy as np

    return a.get() if hasattr(a, "get") else np.asarray(a)


def distance(out, ref) -> float:
    """|out - ref| / |ref| in float64, on the host."""
    import numpy as np

    out, ref = _host(out).astype(np.float64).ravel(), _host(ref).astype(np.float64).ravel()
    num, den = float(np.linalg.norm(out - ref)), float(np.linalg.norm(ref))
    return num / den if den > 0 else num


def stage_reference(handle, spec, m: int = CHECK_BATCH) -> StageReference:
    import cupy
    import numpy as np

    k, h, ww = spec.conv_chw
    xh, wh, bh, dy_raw = operands(spec, m)
    with handle.stream:   # made on the stream cuDNN reads them on (the model's, which does not wait for others)
        x, w, b = cupy.asarray(xh), cupy.asarray(wh), cupy.asarray(bh)
        c = cupy.empty((m, k, h, ww), cupy.float32)
    reference(handle, spec.conv("fwd", m), {"x": x, "w": w, "y": c})
    ch = c.get(stream=handle.stream) + bh.reshape(1, k, 1, 1)
    win = ch.reshape(m, k, h // 2, 2, ww // 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(m, k, h // 2, ww // 2, 4)
    arg = win.argmax(axis=-1).astype(np.uint8)   # the first maximum, as our kernels take it
    top2 = np.sort(win, axis=-1)[..., 2:]
    top = top2[..., 1]
    decided = (top > 0) & (top2[..., 1] - top2[..., 0] > TIE_RTOL * float(np.abs(ch).max()))
    y = np.maximum(top, np.float32(0))
    dy = (dy_raw * (top > 0)).astype(np.float32)
    routed = (np.arange(4, dtype=np.uint8) == arg[..., None]) * dy[..., None]
    dc = np.ascontiguousarray(routed.reshape(m, k, h // 2, ww // 2, 2, 2).transpose(0, 1, 2, 4, 3, 5)
                              .reshape(m, k, h, ww), dtype=np.float32)
    db = dc.sum(axis=(0, 2, 3), dtype=np.float64).astype(np.float32)
    with handle.stream:
        dcd, dyd, argd = cupy.asarray(dc), cupy.asarray(dy), cupy.asarray(arg)
        dw = cupy.empty(spec.w, cupy.float32)
    reference(handle, spec.conv("bwd-filter", m), {"x": x, "dy": dcd, "dw": dw})
    dx = None
    if spec.dx:
        with handle.stream:
            dxd = cupy.empty_like(x)
        reference(handle, spec.conv("bwd-data", m), {"dy": dcd, "w": w, "dx": dxd})
        dx = dxd.get(stream=handle.stream) * (xh > 0)
    dwh = dw.get(stream=handle.stream)
    handle.stream.synchronize()
    return StageReference(x, w, b, dyd, argd, y, arg, decided, dwh, db, dx)


def check_forward(ref: StageReference, y, arg) -> tuple[float, int, str | None]:
    """(distance of y, number of windows decided otherwise at a near-tie, why it fails or None)."""
    import numpy as np

    err = distance(y, ref.y)
    differ = _host(arg) != ref.arg_host
    wrong = int(np.count_nonzero(differ & ref.decided))
    ties = int(np.count_nonzero(differ)) - wrong
    if not err <= EXACT_RTOL:
        return err, ties, f"pooled output is {err:.1e} from cuDNN's exact result (bound {EXACT_RTOL:.0e})"
    if wrong:
        return err, ties, f"{wrong} pooling windows took another argmax than cuDNN's away from any tie"
    return err, ties, None


def check_backward(ref: StageReference, dw, db, dx=None) -> tuple[float, str | None]:
    """(largest distance of dw, db, dx from the reference's, why it fails or None)."""
    errs = {"dw": distance(dw, ref.dw), "db": distance(db, ref.db)}
    if ref.dx is not None:
        errs["dx"] = distance(dx, ref.dx)
    worst = max(errs, key=lambda k: errs[k] if errs[k] == errs[k] else float("inf"))
    err = errs[worst]
    if not err <= EXACT_RTOL:
        return err, f"{worst} is {err:.1e} from cuDNN's exact result (bound {EXACT_RTOL:.0e})"
    return err, None
