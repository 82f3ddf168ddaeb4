"""The whole step's numerics against float64, judged per decision: every pooling and ReLU decision of one
training step of ours against a float64 recomputation's (PyTorch, float64, same parameters and batch);
every gradient of the images whose decisions all agree, and each decision that differs with its margin;
beside them the distances at the step's own decisions and at float64's, and PyTorch's float32 step's.

The judge the GPU tests and the program scripts/numerics.py share (the program runs it over batch sizes,
engines and datasets).

Note [judging per decision]: one image decides the distance of a whole batch. On Fashion-MNIST at batch
8192, --engine ours landed 1.8e-4 from float64 in relative L2 (conv2's weight), cuDNN 1.6e-6: bisected
with 0/1 weights on each image's loss, all of it came from one image, one of whose conv2 pre-activations
is -3.1e-8 in float64, in a window of four values <= 0; summed in float32 in 2000 random orders it comes
out positive 72% of the time, ours positive, cuDNN's negative, and that one ReLU decision passes a whole
gradient term. So the step is judged per decision: the images whose every decision (each live pooling
window's argmax, each pooled output's and fc1's ReLU) agrees with float64's are held to RTOL_AGREE
(1e-6) in relative L2 on every gradient of their loss alone (ours: the other images' dlogits rows zeroed,
the gradients run from the dlogits given, as lenet.torch runs them); each decision that differs is
listed with its margin in float64 (a window's maximum less its value at the entry ours chose; a ReLU's
|pre-activation|, never its output, which is 0 on float64's side of a flip) relative to its layer's
scale (the largest |value| of that layer in the batch), which must be below MARGIN (1e-6): a wider one
is a wrong decision, not float32's. At least MIN_AGREE (half) of the batch must agree, so that a step
whose every image differs cannot pass with nothing judged.

Note [step numerics]: max-pooling and ReLU are discontinuous. Where float64 sees a near-tie (two
window entries within rounding, or a pre-activation within rounding of 0), float32 may decide the
other way, and that one decision moves a few gradient entries by a whole term; no float32
implementation can avoid it at large batches (at N=65536 about one window in 16.8 M has its top two
within 1.1e-7). Measured on an H100 (standard-normal batches, PyTorch's initialization): at batch
8192 one window of 6.5 M decided otherwise put conv1's weight gradient 1.8e-4 from float64 in
relative L2, where the same step with no decision differing landed at 1.7e-6; PyTorch's float32 step
on another batch of 8192 took one ReLU the other way and landed 1.5e-4 off. A bound on the distance
from float64's own decisions therefore fails on whichever implementation meets a near-tie.
So the step is judged against float64 recomputed at the decisions the step took (its argmaxes and
ReLU masks; ``float64_step(at=...)``): every gradient tensor within RTOL_L2 = 1e-5 in relative L2,
||g - g64|| / ||g64||, which a wrong index, a missing term or a sum of the wrong products fails by
orders of magnitude. Beside it are reported the distance from float64's own decisions (relative L2
and max-elementwise, max |g - g64| / max |g64|) and the count of decisions that differ, which
explains that distance, with PyTorch's float32 step on the same batch measured the same way.

FFT and the decisions (batch 20000, --engine legacy, H100): --algo exhaustive chose FFT for conv1's
forward and weight gradient and conv2's data gradient. That step took 5 decisions otherwise than
float64 (1 + 2 windows, 1 ReLU of p1, 1 of fc1) where the heuristic's implicit GEMM took 1 (a ReLU of
p1), and it landed 8.1e-4 from float64's decisions (fc1.weight 1.0e-3 max-elementwise) against
2.8e-6; at its own decisions, 1.5e-6. So FFT's larger rounding does flip more near-ties, but each
flip is a near-tie that a float32 step may take either way, and the gradient is exact for the
decisions it took. Candidates therefore need no margin beyond the search's exactness bound
(EXACT_RTOL in descriptors/exact.py): a margin would trade measured speed for moving which
near-ties flip, not for a more correct gradient.

Decisions are read from what each engine keeps: our kernels' argmax bytes, or cuDNN's unpooled
output (whose first maximum is the argmax); the ReLU decisions are those of the pooled outputs
(ReLU commutes with max pooling) and of fc1. Only windows whose float64 output is positive count
(elsewhere the gradient is 0 either way). The batch is standard normal images with uniform labels,
the parameters PyTorch's default initialization: the benchmark's inputs.
"""

from __future__ import annotations

import numpy as np

RTOL_L2 = 1e-5   # the bar, per gradient tensor, at the step's own decisions (Note [step numerics])


def windows(c):
    """(N, C, H/2, W/2, 4) view of the 2x2/2 windows of c (N, C, H, W), in the order a00, a01, a10, a11."""
    n, k, h, w = c.shape
    return c.reshape(n, k, h // 2, 2, w // 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(n, k, h // 2, w // 2, 4)


def float64_step(torch, state: dict, x, y, at=None, keep=None):
    """(gradients, pooled argmaxes, pooled outputs, fc1 pre-activation, conv outputs) of the step in
    float64; with ``at`` = (argmaxes per stage, live masks per stage, fc1's ReLU mask), at those decisions
    instead of its own; with ``keep`` (a bool per image), the loss of the images it keeps only (still
    divided by the whole batch, as the step's dlogits are)."""
    import torch.nn.functional as F

    p = {k: torch.as_tensor(v, device="cuda", dtype=torch.float64).requires_grad_() for k, v in state.items()}
    t = torch.as_tensor(x, device="cuda", dtype=torch.float64).reshape(-1, 1, 28, 28)

    def stage(a, i):   # relu(maxpool(a)), or the window entry ``at`` names, kept where ``at`` says it is live
        if at is None:
            return F.relu(F.max_pool2d(a, 2))
        return torch.take_along_dim(windows(a), at[0][i][..., None], -1)[..., 0] * at[1][i]

    c1 = F.conv2d(t, p["conv1.weight"], p["conv1.bias"])
    p1 = stage(c1, 0)
    c2 = F.conv2d(p1, p["conv2.weight"], p["conv2.bias"])
    p2 = stage(c2, 1)
    a3 = F.linear(p2.flatten(1), p["fc1.weight"], p["fc1.bias"])
    logits = F.linear(F.relu(a3) if at is None else a3 * at[2], p["fc2.weight"], p["fc2.bias"])
    per = F.cross_entropy(logits, torch.as_tensor(y, device="cuda").long(), reduction="none")
    loss = (per if keep is None else per * keep.double()).sum() / len(y)
    grads = torch.autograd.grad(loss, list(p.values()))
    with torch.no_grad():
        arg = [windows(c).argmax(-1) for c in (c1, c2)]   # the first maximum, as ours and cuDNN's
    return ({k: g.detach() for k, g in zip(p, grads)}, arg, [p1.detach(), p2.detach()], a3.detach(),
            [c1.detach(), c2.detach()])


def torch_float32_grads(torch, state: dict, x, y) -> dict:
    from torch_lenet import exact_float32, from_state

    exact_float32()
    m = from_state(state)
    loss = torch.nn.functional.cross_entropy(m(torch.as_tensor(x, device="cuda")),
                                             torch.as_tensor(y, device="cuda").long())
    loss.backward()
    return {k: v.grad.detach().double() for k, v in m.named_parameters()}


def distances(grads: dict, ref: dict) -> dict:
    """Per tensor: (relative L2, max-elementwise relative) against ``ref``."""
    out = {}
    for k, r in ref.items():
        g = grads[k]
        out[k] = (float((g - r).norm() / r.norm()), float((g - r).abs().max() / r.abs().max()))
    return out


def our_decisions(torch, model, n: int):
    """Per stage, the argmax byte of every pooled window at batch n, from the engine that ran it."""
    import cupy

    out = []
    for stage, planned in zip(model.stages, model.plan(n).stages):
        own = model.planner.state(planned.engine)[("stage", stage.name)]
        if planned.engine == "ours":
            arg = torch.as_tensor(cupy.asnumpy(own["arg"][:n] & 3), device="cuda").long()   # less the ReLU bit
        else:
            arg = windows(torch.as_tensor(own["c"][:n], device="cuda")).argmax(-1)
        out.append(arg)
    return out


def measure(model, state: dict, x, y) -> dict:
    """One step of ``model`` (forward, backward; no update) on (x, y) with parameters ``state``, against
    float64: {"same": {tensor: (l2, max)} at the step's own decisions, "ours": {...} at float64's,
    "torch": {...} PyTorch float32's at float64's, "windows": [differing per stage], "relu": [differing
    per pooled output, fc1], "live": [windows that count per stage]}."""
    import torch

    n = len(y)
    model.load_state_dict(state)
    model.load_batch(x, y)
    model.forward(n)
    model.backward(n)
    ours = {k: torch.as_tensor(v, device="cuda", dtype=torch.float64) for k, v in model.grad_dict().items()}
    g64, arg64, pooled64, a3, _ = float64_step(torch, state, x, y)
    mine = our_decisions(torch, model, n)
    live = [p > 0 for p in pooled64]
    differ = [int(((a != b) & m).sum()) for a, b, m in zip(mine, arg64, live)]
    pooled32 = [torch.as_tensor(model.buf[k][:n], device="cuda") for k in ("p1", "p2")]
    h1 = torch.as_tensor(model.buf["h1"][:n], device="cuda")
    relu = [int(((a > 0) != (b > 0)).sum()) for a, b in zip(pooled32, pooled64)] + [int(((h1 > 0) != (a3 > 0)).sum())]
    at = (mine, [(p > 0).double() for p in pooled32], (h1 > 0).double())
    same = float64_step(torch, state, x, y, at=at)[0]
    return {"same": distances(ours, same), "ours": distances(ours, g64),
            "torch": distances(torch_float32_grads(torch, state, x, y), g64),
            "windows": differ, "relu": relu, "live": [int(m.sum()) for m in live]}


RTOL_AGREE = 1e-6    # the bar for the images whose decisions agree with float64's (Note [judging per decision])
MARGIN = 1e-6        # a decision that differs must be this close to its tie, relative to its layer's scale
MIN_AGREE = 0.5      # the least share of the batch whose decisions all agree: fewer leave too little to judge


def host_windows(c: np.ndarray) -> np.ndarray:
    """(N, C, H/2, W/2, 4) view of the 2x2/2 windows of c (N, C, H, W), in the order a00, a01, a10, a11 (as
    ``windows``, for NumPy arrays)."""
    n, k, h, w = c.shape
    return c.reshape(n, k, h // 2, 2, w // 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, k, h // 2, w // 2, 4)


def differing_decisions(chosen: list, convs: list, pooled: list, h1: np.ndarray, a3: np.ndarray):
    """Note [judging per decision], on the host (NumPy alone): (a bool per image, whether any of its decisions
    differs from float64's; the differing decisions as (kind, layer, margin relative to its layer's scale)).

    chosen: per stage, the window entry ours took (N, C, H/2, W/2), 0..3; convs: per stage, float64's conv
    outputs before ReLU (N, C, H, W); pooled: per stage, ours' pooled outputs after ReLU (N, C, H/2, W/2);
    h1: ours' fc1 output after ReLU (N, 120); a3: float64's fc1 pre-activation (N, 120).
    A window both keep live that ours routed to another entry differs by float64's maximum less float64's
    value at the entry ours chose (not the top two's gap: ours may have taken the third). A ReLU taken the
    other way differs by its pre-activation in float64, never by the value after it (0 on float64's side
    of a flip): where ours passed a window's entry, float64's value of that entry (how far below 0 it is);
    where ours passed none, float64's maximum (how far above 0); fc1's by |its input| in float64."""
    n = len(a3)
    differ = np.zeros(n, bool)
    margins = []
    for i, (arg, c, p32) in enumerate(zip(chosen, convs, pooled)):
        win = host_windows(np.asarray(c, np.float64))
        scale = float(np.abs(c).max()) or 1.0
        top = win.max(-1)                                          # float64's pooled value before ReLU
        first = win.argmax(-1)                                     # its first maximum, as ours and cuDNN's
        at = np.take_along_axis(win, np.asarray(arg, np.int64)[..., None], -1)[..., 0]   # float64 at ours' entry
        on32, on64 = np.asarray(p32) > 0, top > 0
        wrong = (np.asarray(arg) != first) & on32 & on64          # a live window routed elsewhere
        relu = on32 != on64                                       # a pooled output on the other side of 0
        differ |= (wrong | relu).reshape(n, -1).any(1)
        margins += [("window", f"stage {i + 1}", float(m) / scale) for m in (top - at)[wrong]]
        margins += [("relu", f"stage {i + 1}", abs(float(v)) / scale) for v in np.where(on32, at, top)[relu]]
    fc1 = (np.asarray(h1) > 0) != (np.asarray(a3) > 0)
    differ |= fc1.any(1)
    scale = float(np.abs(a3).max()) or 1.0
    margins += [("relu", "fc1", abs(float(v)) / scale) for v in np.asarray(a3)[fc1]]
    return differ, margins


def verdict(agree: dict, kept: int, n: int, worst: float) -> str | None:
    """Why the judged step fails, or None: too few images agree to judge (fewer than MIN_AGREE of the batch,
    none at all included), an agreeing image's gradient over RTOL_AGREE, or a differing decision wider
    than MARGIN of its layer's scale from a tie."""
    if kept < max(1, MIN_AGREE * n):
        return f"{kept} of {n} images agree with float64's decisions, fewer than {MIN_AGREE:.0%}: too few to judge"
    over = {k: v[0] for k, v in agree.items() if not v[0] <= RTOL_AGREE}
    if over:
        return f"the agreeing images' gradients over {RTOL_AGREE:g} in relative L2: {over}"
    if not worst <= MARGIN:
        return f"a differing decision {worst:.1e} of its layer's scale from a tie (bar {MARGIN:g})"
    return None


def our_gradients(torch, model, n: int, keep):
    """Our gradients of the loss of the images ``keep`` says (dlogits zeroed for the others), run as the
    step runs them: forward, our loss kernel's dlogits, then every gradient from dlogits given."""
    import cupy

    step = model.plan(n)
    with model.stream:
        step.forward()
        step.loss.train()
        cupy.multiply(model.buf["dlogits"][:n], cupy.asarray(keep.cpu().numpy(), cupy.float32)[:, None],
                      out=model.buf["dlogits"][:n])
        step.backward_given()
    return {k: torch.as_tensor(v, device="cuda", dtype=torch.float64) for k, v in model.grad_dict().items()}


def judge(model, state: dict, x, y) -> dict:
    """Note [judging per decision]: every pooling and ReLU decision of our step against float64's
    (differing_decisions); the images whose decisions all agree, at least MIN_AGREE of the batch, are held
    to RTOL_AGREE in relative L2 on every gradient of their loss alone (ours: their dlogits rows, the
    others' zeroed); each decision that differs is listed with its margin in float64 (float64's window
    maximum less its value at the entry ours chose; a ReLU's |pre-activation|), relative to its layer's
    scale (the largest |value| of that layer in the batch), which must be below MARGIN (verdict)."""
    import torch

    n = len(y)
    model.load_state_dict(state)
    model.load_batch(x, y)
    model.forward(n)
    model.stream.synchronize()   # its buffers are read on the host below
    _, _, _, a3, convs = float64_step(torch, state, x, y)
    mine = our_decisions(torch, model, n)
    host = lambda t: t.cpu().numpy()   # noqa: E731
    differ, margins = differing_decisions([host(a) for a in mine], [host(c) for c in convs],
                                          [model.buf[k][:n].get() for k in ("p1", "p2")], model.buf["h1"][:n].get(),
                                          host(a3))
    keep = torch.as_tensor(~differ, device="cuda")
    ours = our_gradients(torch, model, n, keep)
    g64 = float64_step(torch, state, x, y, keep=keep)[0]
    agree = distances(ours, g64) if keep.any() else {}
    worst = max((m for _, _, m in margins), default=0.0)
    why = verdict(agree, int(keep.sum()), n, worst)
    return {"agree": agree, "images": n, "kept": int(keep.sum()), "decisions": margins, "worst_margin": worst,
            "ok": why is None, "why": why}
