"""Measure every cuDNN convolution algorithm's error, and the whole LeNet step's, against
PyTorch in float32 and in float64 (the truth). Prints tables; --json writes them.

    python3 scripts/algo_errors.py [--json PATH]

This is what the tolerances in tests/conftest.py (Note [tolerance]) are based on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # the PyTorch reference: tests/torch_lenet.py

import descriptors as D  # noqa: E402
from descriptors import Direction  # noqa: E402
from lenet.engines import Policy  # noqa: E402
from lenet.engines.cudnn import supported_names  # noqa: E402
from torch_lenet import exact_float32, from_state  # noqa: E402

CASES = [("conv1", (1, 28, 28), (6, 1, 5, 5), 0, 1, 1), ("conv2", (6, 12, 12), (16, 6, 5, 5), 0, 1, 1),
         ("pad1-stride2", (3, 17, 17), (8, 3, 3, 3), 1, 2, 1), ("pad2-dil2", (4, 15, 13), (5, 4, 3, 3), 2, 1, 2)]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def conv_errors(handle, n):
    import cupy
    F = torch.nn.functional
    rows = []
    for name, xs, wsh, pad, stride, dil in CASES:
        conv = D.ConvolutionDescriptor(pad=pad, stride=stride, dilation=dil)
        xd, wd = D.TensorDescriptor((n, *xs)), D.FilterDescriptor(wsh)
        yd = D.TensorDescriptor(conv.output_shape(xd, wd))
        rng = cupy.random.default_rng(0)
        x, w, dy = (rng.standard_normal(d.shape, dtype=cupy.float32) for d in (xd, wd, yd))
        y, dx, dw = (cupy.empty(d.shape, cupy.float32) for d in (yd, xd, wd))
        kw = dict(padding=pad, stride=stride, dilation=dil)
        refs = {}
        for dt in (torch.float32, torch.float64):
            tx, tw, tdy = (torch.as_tensor(a.get(), device="cuda", dtype=dt) for a in (x, w, dy))
            refs[dt] = (F.conv2d(tx, tw, **kw).cpu().numpy(),
                        torch.nn.grad.conv2d_input(tx.shape, tw, tdy, **kw).cpu().numpy(),
                        torch.nn.grad.conv2d_weight(tx, tw.shape, tdy, **kw).cpu().numpy())
        ws = D.Workspace()
        for i, (direction, descs, run, out) in enumerate([
            (Direction.FORWARD, (xd, wd, yd), lambda r: conv.forward(handle, xd, x, wd, w, yd, y, r, ws), y),
            (Direction.BACKWARD_DATA, (wd, yd, xd), lambda r: conv.backward_data(handle, wd, w, yd, dy, xd, dx, r, ws), dx),
            (Direction.BACKWARD_FILTER, (xd, yd, wd), lambda r: conv.backward_filter(handle, xd, x, yd, dy, wd, dw, r, ws), dw),
        ]):
            for r in D.supported_algorithms(handle, direction, conv, *descs):
                ws.reserve(r.workspace_bytes)
                run(r)
                handle.stream.synchronize()
                o = out.get()
                rows.append(dict(case=name, n=n, direction=str(direction), algo=r.name, math=r.math_type,
                                 vs_torch32=rel(o, refs[torch.float32][i]), vs_f64=rel(o, refs[torch.float64][i]),
                                 torch32_vs_f64=rel(refs[torch.float32][i], refs[torch.float64][i])))
    return rows


def model_errors(n):
    from lenet.model import LeNet
    model = LeNet(max_batch=n, seed=n)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((n, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, n).astype(np.int32)
    state = model.state_dict()
    refs = {}
    for dt in (torch.float32, torch.float64):
        m = from_state(state, dtype=dt)
        lg = m(torch.as_tensor(x, device="cuda", dtype=dt))
        torch.nn.functional.cross_entropy(lg, torch.as_tensor(y, device="cuda").long()).backward()
        refs[dt] = {"logits": lg.detach().cpu().numpy(), **{k: p.grad.cpu().numpy() for k, p in m.named_parameters()}}
    names = supported_names(model.planner, [s.spec for s in model.stages], n)
    rows = []
    model.load_batch(x, y)
    for combo in itertools.product(*(names[d] for d in Direction)):
        model.set_policy(Policy(*combo, engine="legacy", allow_winograd=True))
        model.forward(n)
        model.backward(n)
        ours = {"logits": model.logits(), **model.grad_dict()}
        worst32 = max(ours, key=lambda k: rel(ours[k], refs[torch.float32][k]))
        worst64 = max(ours, key=lambda k: rel(ours[k], refs[torch.float64][k]))
        rows.append(dict(n=n, combo="/".join(combo), worst_vs_torch32=rel(ours[worst32], refs[torch.float32][worst32]),
                         at32=worst32, worst_vs_f64=rel(ours[worst64], refs[torch.float64][worst64]), at64=worst64,
                         torch32_vs_f64=max(rel(refs[torch.float32][k], refs[torch.float64][k]) for k in ours)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="write all rows here")
    args = ap.parse_args()
    exact_float32()
    handle = D.Handle()
    conv_rows = [r for n in (1, 64, 256) for r in conv_errors(handle, n)]
    print(f"{'case':<13}{'n':>4} {'direction':<11}{'algorithm':<23}{'math':<6}{'vs torch32':>11}{'vs f64':>10}{'torch32 vs f64':>15}")
    for r in conv_rows:
        print(f"{r['case']:<13}{r['n']:>4} {r['direction']:<11}{r['algo']:<23}{r['math']:<6}{r['vs_torch32']:>11.2e}"
              f"{r['vs_f64']:>10.2e}{r['torch32_vs_f64']:>15.2e}")
    model_rows = [r for n in (1, 7, 64, 256) for r in model_errors(n)]
    print(f"\n{'n':>4} {'fwd/bwd-data/bwd-filter':<45}{'worst vs torch32':>17} {'(where)':<14}{'worst vs f64':>13} {'(where)':<14}{'torch32 vs f64':>15}")
    for r in model_rows:
        print(f"{r['n']:>4} {r['combo']:<45}{r['worst_vs_torch32']:>17.2e} {r['at32']:<14}{r['worst_vs_f64']:>13.2e} "
              f"{r['at64']:<14}{r['torch32_vs_f64']:>15.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"conv": conv_rows, "model": model_rows}, indent=1))


if __name__ == "__main__":
    main()
