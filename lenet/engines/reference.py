"""The exact answer of a stage, from cuDNN, that every candidate of ours is checked against.

Note [checking a stage]: a stage holds two decisions, the pooling's argmax and the ReLU, and a
float32 decision taken at a near-tie may go either way: two exact float32 implementations that sum
in different orders can route a gradient to different positions, and one such decision moves a
weight-gradient entry by a whole term. So a candidate is checked against the same decisions:
  forward   its pooled output within EXACT_RTOL (norm-wise) of the reference, its ReLU decisions
            (pooled output > 0) equal to the reference's away from zero, and its argmax equal to the
            reference's at every window with a live output (> 0) whose top two values are more than
            TIE_RTOL * max|conv| apart, and at every live window whose four values are exactly equal
            (a constant background: the first maximum, a00, wins in every implementation); the
            near-ties it may decide either way are counted; and its argmax bytes' ReLU bit set exactly where its own pooled output is not > 0 (Note
            [the ReLU bit] in lenet/kernels/stage_common.cu);
  backward  given the reference's argmax bytes (their ReLU bits the reference's) and the gradient
            unmasked, its weight, bias and input gradients within EXACT_RTOL of the reference's (which
            masks by its ReLU), and its input gradient exactly 0 wherever the input is exactly 0 (the
            previous ReLU's mask). It runs twice: on its own grid (a block an image, and the reduction of
            the blocks' rows), and on one block that sums all CHECK_BATCH images, the longest sums a
            block of any batch up to CHECK_BATCH images a block does (Note [an image's own sums] in
            lenet/kernels/stage2_backward_roles.cu: a rounding that grows with the images a block sums,
            5.9e-5 off at 65536 images, passed a check that only ran the first).
Note [real-data operands]: random normals never tie and are never exactly 0. Every Fashion-MNIST batch
has both: a constant background (every window of it an exact tie, every conv output over it equal),
pixels quantized to 256 levels, and after a ReLU, exact zeros. So half the check's images are
random normals and half are quantized pictures of strokes on a constant background (``operands``),
and the stage's input, where it is a ReLU's output, holds exact zeros in both halves.
The reference is cuDNN's exact descriptor-API convolutions (descriptors.exact.reference, FMA
float32); the operands, the bias, the pooling, the routing through the argmax and every comparison
are NumPy's, on the host. Note [no generic kernels in the check]: done by CuPy on the GPU, they
took about 20 of CuPy's generic kernels and six CUB reductions (count_nonzero, max) that a first
run on a fresh machine compiled with NVRTC before its first step, most of its start-up
(docs/engines.md, "The stage check on the host"). At CHECK_BATCH images the host's work takes
milliseconds.
A candidate is checked once per model before it is timed; a stored choice (Note [stored choices] in
lenet/plan.py) was checked when it was stored, and its key names the GPU, the driver, the libraries
and a digest of our kernel sources (lenet.kernels.source_digest), so it is not checked again: a later
run's start-up skips the reference's cuDNN calls (docs/engines.md, "The stage check on the host").
"""

from __future__ import annotations

from dataclasses import dataclass

from descriptors.exact import EXACT_RTOL, reference

TIE_RTOL = 1e-4
CHECK_BATCH = 256
ARG_OFF = 4   # an argmax byte's ReLU bit: ARG_OFF in lenet/kernels/stage_common.cu


@dataclass
class StageReference:
    # What the kernels read, on the GPU:
    x: object      # (m, C, H, W) operands ...
    w: object
    b: object
    dy: object     # (m, K, H/2, W/2) the pooled gradient, unmasked (the backward masks it by arg's ReLU bit)
    arg: object    # (m, K, H/2, W/2) uint8 argmax q = 2 * dy + dx, | ARG_OFF where the reference's ReLU is off
    # What they must produce, on the host (NumPy):
    y: object      # pooled output
    arg_host: object
    decided: object  # bool: live windows whose argmax is no near-tie, or an exact four-way tie
    flat: object     # bool: live windows whose four values are exactly equal (a constant background)
    live: object     # bool: windows whose ReLU decision is no near-tie of 0 (y > 0 must agree there)
    dw: object
    db: object
    dx: object     # masked by x > 0, or None
    x_zero: object   # bool: where the input is exactly 0 (dx must be exactly 0 there), or None


def pictures(rng, m: int, shape) -> "object":
    """m quantized pictures (Note [real-data operands]): a constant background level, a few rectangles
    of random levels and one random-level stroke each, in 256 levels, normalized like Fashion-MNIST
    (mean 0.286, std 0.353)."""
    import numpy as np

    c, h, w = shape
    q = np.zeros((m, c, h, w), np.float32)
    for i in range(m):
        q[i] = rng.integers(0, 3) * 40   # the background: 0, 40 or 80 of 255
        for _ in range(rng.integers(1, 4)):
            r0, c0 = rng.integers(0, h - 2), rng.integers(0, w - 2)
            q[i, :, r0:r0 + rng.integers(2, h // 2), c0:c0 + rng.integers(2, w // 2)] = rng.integers(0, 256)
        r = rng.integers(0, h)
        q[i, :, r, :] = rng.integers(0, 256, w)
    return ((q / np.float32(255) - np.float32(0.286)) / np.float32(0.353)).astype(np.float32)


def operands(spec, m: int, seed: int = 0):
    """x (half random normals, half quantized pictures; a ReLU output, with exact zeros, when the stage
    has an input gradient), w, b, dy at batch m (NumPy)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    f32 = np.float32
    half = m // 2
    x = np.concatenate([rng.standard_normal((m - half, *spec.x), dtype=f32), pictures(rng, half, spec.x)])
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


def _quarters(c):
    """A pooling window's four values as four strided views of c (N, K, H, W), in the order our kernels
    number them (q = 2 * dy + dx): top-left, top-right, bottom-left, bottom-right. No copy: Note [the
    pooling on the host]."""
    return c[:, :, 0::2, 0::2], c[:, :, 0::2, 1::2], c[:, :, 1::2, 0::2], c[:, :, 1::2, 1::2]


def pool_reference(c, dy_raw):
    """The pooling's decisions and the gradient routed through them, from the conv output plus bias c (N, K,
    H, W) and the pooled gradient dy_raw (N, K, H/2, W/2), on the host: (y, arg, top, second, flat, dy, dc),
    where arg is each window's first maximum (np.argmax over its four values), top and second its two
    largest values, flat whether its four values are equal and top > 0 (a live constant window), dy dy_raw
    masked by top > 0, and dc (N, K, H, W) dy routed to each window's argmax, every other element 0 * dy.

    Note [the pooling on the host]: written over the window's four values as a last axis of a transposed
    copy (reshape, transpose, argmax, an equality over the axis, the routing's product over it, a transpose
    back) it took 30 ms for conv1's 256 images on a CPU, on a first run's critical path (the preload thread's
    first plan); over four strided views of c, 14 ms (conv2's: 7 -> 3), and the same values bit for bit, -0.0
    included (tests/test_engines_cpu.py holds it to the window form)."""
    import numpy as np

    a, b, cc, d = _quarters(c)
    hi1, lo1, hi2, lo2 = np.maximum(a, b), np.minimum(a, b), np.maximum(cc, d), np.minimum(cc, d)
    top, second = np.maximum(hi1, hi2), np.maximum(np.minimum(hi1, hi2), np.maximum(lo1, lo2))
    arg = np.where(a == top, 0, np.where(b == top, 1, np.where(cc == top, 2, 3))).astype(np.uint8)
    flat = (a == a) & (b == a) & (cc == a) & (d == a)
    on = top > 0
    dy = (dy_raw * on).astype(np.float32)
    dc = np.empty(c.shape, np.float32)
    for q, part in enumerate(_quarters(dc)):
        np.multiply(arg == q, dy, out=part)
    return np.maximum(top, np.float32(0)), arg, top, second, flat & on, dy, dc


def stage_reference(handle, spec, m: int = CHECK_BATCH, legacy=None) -> StageReference:
    """The reference at m images (``legacy``: the descriptor-API source whose descriptors it may use)."""
    import cupy
    import numpy as np

    k, h, ww = spec.conv_chw
    xh, wh, bh, dy_raw = operands(spec, m)
    with handle.stream:   # made on the stream cuDNN reads them on (the model's, which does not wait for others)
        x, w, b = cupy.asarray(xh), cupy.asarray(wh), cupy.asarray(bh)
        c = cupy.empty((m, k, h, ww), cupy.float32)
    reference(handle, spec.conv("fwd", m), {"x": x, "w": w, "y": c}, legacy)
    ch = c.get(stream=handle.stream) + bh.reshape(1, k, 1, 1)
    y, arg, top, second, flat, dy, dc = pool_reference(ch, dy_raw)   # arg: the first maximum, as our kernels take it
    scale = TIE_RTOL * float(np.abs(ch).max())
    decided = (top > 0) & ((top - second > scale) | flat)
    live = np.abs(top) > scale
    arg_bits = arg | np.where(top > 0, 0, ARG_OFF).astype(np.uint8)
    db = dc.sum(axis=(0, 2, 3), dtype=np.float64).astype(np.float32)
    with handle.stream:
        dcd, dyd, argd = cupy.asarray(dc), cupy.asarray(dy_raw), cupy.asarray(arg_bits)
        dw = cupy.empty(spec.w, cupy.float32)
    reference(handle, spec.conv("bwd-filter", m), {"x": x, "dy": dcd, "dw": dw}, legacy)
    dx = None
    if spec.dx:
        with handle.stream:
            dxd = cupy.empty_like(x)
        reference(handle, spec.conv("bwd-data", m), {"dy": dcd, "w": w, "dx": dxd}, legacy)
        dx = dxd.get(stream=handle.stream) * (xh > 0)
    dwh = dw.get(stream=handle.stream)
    handle.stream.synchronize()
    return StageReference(x, w, b, dyd, argd, y, arg, decided, flat, live, dwh, db, dx, (xh == 0) if spec.dx else None)


def check_forward(ref: StageReference, y, arg) -> tuple[float, int, str | None]:
    """(distance of y, number of windows decided otherwise at a near-tie, why it fails or None)."""
    import numpy as np

    yh, ah = _host(y), _host(arg)
    err = distance(yh, ref.y)
    differ = (ah & 3) != ref.arg_host
    wrong = int(np.count_nonzero(differ & ref.decided))
    ties = int(np.count_nonzero(differ)) - wrong
    relu = int(np.count_nonzero(((yh > 0) != (ref.y > 0)) & ref.live))
    bits = int(np.count_nonzero(((ah & ARG_OFF) != 0) != ~(yh > 0)) + np.count_nonzero(ah & ~np.uint8(3 | ARG_OFF)))
    if not err <= EXACT_RTOL:
        return err, ties, f"pooled output is {err:.1e} from cuDNN's exact result (bound {EXACT_RTOL:.0e})"
    if wrong:
        return err, ties, f"{wrong} pooling windows took another argmax than cuDNN's away from any near-tie"
    if relu:
        return err, ties, f"{relu} pooled outputs took another ReLU decision than cuDNN's away from 0"
    if bits:
        return err, ties, f"{bits} argmax bytes' ReLU bits disagree with the pooled output (set where it is not > 0)"
    return err, ties, None


def check_backward(ref: StageReference, dw, db, dx=None) -> tuple[float, str | None]:
    """(largest distance of dw, db, dx from the reference's, why it fails or None)."""
    import numpy as np

    errs = {"dw": distance(dw, ref.dw), "db": distance(db, ref.db)}
    if ref.dx is not None:
        errs["dx"] = distance(dx, ref.dx)
    worst = max(errs, key=lambda k: errs[k] if errs[k] == errs[k] else float("inf"))
    err = errs[worst]
    if not err <= EXACT_RTOL:
        return err, f"{worst} is {err:.1e} from cuDNN's exact result (bound {EXACT_RTOL:.0e})"
    if ref.x_zero is not None:
        leaked = int(np.count_nonzero(_host(dx)[ref.x_zero]))
        if leaked:
            return err, f"dx is nonzero at {leaked} inputs that are exactly 0 (the previous ReLU's mask)"
    return err, None
