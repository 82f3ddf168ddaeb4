"""Probe: LeNet's convolutions on both cuDNN engines, timed the same way (lenet.timing).

    python3 scripts/probes/conv_engines.py --out probe.json

For each convolution direction of LeNet (and the fused variants): how many graph-API plans
cuDNN lists and builds, how long building takes, each plan's time and error at batch 64 and
8192, the descriptor API's algorithms beside them; then the best per-image cost of each at
chunk sizes 1024..65536 for a batch of 65536; and the floor of a CUDA graph of tiny kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402

import descriptors as D  # noqa: E402
from descriptors.algorithms import Direction, supported_algorithms  # noqa: E402
from descriptors.graph import ConvGraph, frontend  # noqa: E402
from lenet.timing import time_launcher  # noqa: E402

OPS = {   # name: (direction, x shape without N, w shape, fuse)
    "conv1.fwd": ("fwd", (1, 28, 28), (6, 1, 5, 5), ""),
    "conv1.fwd+bias_relu": ("fwd", (1, 28, 28), (6, 1, 5, 5), "bias_relu"),
    "conv1.wgrad": ("bwd-filter", (1, 28, 28), (6, 1, 5, 5), ""),
    "conv2.fwd": ("fwd", (6, 12, 12), (16, 6, 5, 5), ""),
    "conv2.fwd+bias_relu": ("fwd", (6, 12, 12), (16, 6, 5, 5), "bias_relu"),
    "conv2.dgrad": ("bwd-data", (6, 12, 12), (16, 6, 5, 5), ""),
    "conv2.dgrad+drelu": ("bwd-data", (6, 12, 12), (16, 6, 5, 5), "drelu"),
    "conv2.wgrad": ("bwd-filter", (6, 12, 12), (16, 6, 5, 5), ""),
}
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def arrays_for(g: ConvGraph, rng):
    out = {r: rng.standard_normal(g.shapes[r], dtype=cupy.float32) for r in g.roles}
    cupy.cuda.Device().synchronize()   # made on the default stream; the runs use the handle's
    return out


def reference(h, g: ConvGraph, arr, ws):
    """The descriptor API's answer (implicit GEMM family, FMA float32: ~1e-6 of float64)."""
    conv = D.ConvolutionDescriptor(pad=g.pad, stride=g.stride, dilation=g.dilation)
    xd, wd, yd = D.TensorDescriptor(g.x_shape), D.FilterDescriptor(g.w_shape), D.TensorDescriptor(g.y_shape)
    operands = {"fwd": (0, (xd, wd, yd)), "bwd-data": (1, (wd, yd, xd)), "bwd-filter": (1, (xd, yd, wd))}
    algo, ops = operands[g.direction]
    ws.reserve(D.algorithms.workspace_size(h, g.direction, conv, *ops, algo))
    with h.stream:
        if g.direction == "fwd":
            out = cupy.empty(g.y_shape, cupy.float32)
            conv.forward(h, xd, arr["x"], wd, arr["w"], yd, out, 0, ws)
            if g.fuse:
                out = cupy.maximum(out + arr["b"], 0)
        elif g.direction == "bwd-data":
            out = cupy.empty(g.x_shape, cupy.float32)
            conv.backward_data(h, wd, arr["w"], yd, arr["dy"], xd, out, 1, ws)
            if g.fuse:
                out = out * (arr["act"] > 0)
        else:
            out = cupy.empty(g.w_shape, cupy.float32)
            conv.backward_filter(h, xd, arr["x"], yd, arr["dy"], wd, out, 1, ws)
    h.stream.synchronize()
    return out


def legacy_times(h, name, n, ws, rng):
    direction, xs, wsh, fuse = OPS[name]
    d = Direction(direction)
    conv = D.ConvolutionDescriptor()
    xd, wd = D.TensorDescriptor((n, *xs)), D.FilterDescriptor(wsh)
    yd = D.TensorDescriptor(conv.output_shape(xd, wd))
    x = rng.standard_normal(xd.shape, dtype=cupy.float32)
    w = rng.standard_normal(wd.shape, dtype=cupy.float32)
    y = rng.standard_normal(yd.shape, dtype=cupy.float32)
    b = rng.standard_normal((1, wsh[0], 1, 1), dtype=cupy.float32)
    bd = D.TensorDescriptor(b.shape)
    cupy.cuda.Device().synchronize()
    relu = D.ActivationDescriptor("relu")
    operands = {Direction.FORWARD: (xd, wd, yd), Direction.BACKWARD_DATA: (wd, yd, xd),
                Direction.BACKWARD_FILTER: (xd, yd, wd)}[d]
    out = {}
    for r in supported_algorithms(h, d, conv, *operands):
        ws.reserve(r.workspace_bytes)
        if d == Direction.FORWARD and fuse:
            def fn(r=r):
                conv.bias_activation_forward(h, xd, x, wd, w, bd, b, relu, yd, y, r, ws)
            def plain(r=r):
                conv.forward(h, xd, x, wd, w, yd, y, r, ws)
                D.add_tensor(h, bd, b, yd, y)
                relu.forward(h, yd, y, yd, y)
            try:
                out[r.name + " fused"] = time_launcher(fn, h.stream)
            except D.CudnnError as e:
                out[r.name + " fused"] = f"{e.status_name}"
            out[r.name + " +bias+relu"] = time_launcher(plain, h.stream)
            continue
        if d == Direction.FORWARD:
            fn = lambda r=r: conv.forward(h, xd, x, wd, w, yd, y, r, ws)  # noqa: E731
        elif d == Direction.BACKWARD_DATA:
            fn = lambda r=r: conv.backward_data(h, wd, w, yd, y, xd, x, r, ws)  # noqa: E731
            if fuse:
                fn0 = fn
                def fn(fn0=fn0):
                    fn0()
                    relu.backward(h, xd, x, xd, x, xd, x, xd, x)
        else:
            dw = cupy.empty(wd.shape, cupy.float32)
            fn = lambda r=r, dw=dw: conv.backward_filter(h, xd, x, yd, y, wd, dw, r, ws)  # noqa: E731
        try:
            out[r.name] = time_launcher(fn, h.stream)
        except D.CudnnError as e:
            out[r.name] = e.status_name
    return out


def graph_times(h, name, n, ws, rng, top=None, check=False):
    direction, xs, wsh, fuse = OPS[name]
    t = time.time()
    g = ConvGraph(h, direction, (n, *xs), wsh, fuse=fuse)
    build_s = time.time() - t
    rec = {"listed": len(g.plans) + len(g.rejected), "built": len(g.plans), "build_s": build_s,
           "rejected": dict(list(g.rejected.items())[:6]), "plans": {}}
    if not g.plans:
        return rec
    arr = arrays_for(g, rng)
    if check:
        ref = reference(h, g, arr, ws).get().astype(np.float64)
    plans = g.plans[:top] if top else g.plans
    for p in plans:
        ws.reserve(p.workspace_bytes)
        pack = g.pack(arr, h.device_id)
        try:
            ms = time_launcher(lambda p=p: g.run_packed(p, pack, ws, h), h.stream)
        except Exception as e:  # noqa: BLE001 - a probe records what failed
            rec["plans"][p.name] = {"error": str(e)[:200]}
            continue
        entry = {"us": ms * 1000, "ws": p.workspace_bytes}
        if check:
            out = arr[g.roles[-1]].get().astype(np.float64)
            entry["rel_err"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        rec["plans"][p.name] = entry
    g.close()
    return rec


def best(d: dict) -> tuple[str, float]:
    items = [(k, v["us"] if isinstance(v, dict) else v * 1000) for k, v in d.items()
             if (isinstance(v, dict) and "us" in v) or isinstance(v, float)]
    return min(items, key=lambda kv: kv[1]) if items else ("-", float("nan"))


def launch_floor(stream, kernels=30):
    k = cupy.ElementwiseKernel("float32 x", "float32 y", "y = x + 1", "tiny")
    a = cupy.zeros(64, cupy.float32)
    def fn():
        for _ in range(kernels):
            k(a, a)
    with stream:
        return time_launcher(fn, stream) * 1000 / kernels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe.json")
    ap.add_argument("--deadline", type=float, default=480, help="seconds; later parts are skipped after it")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 65536])
    args = ap.parse_args()
    t = time.time()
    cudnn = frontend()
    res = {"frontend": cudnn.__version__, "cudnn": D.version_string(), "import_s": time.time() - t}
    h = D.Handle()
    ws = D.Workspace(1 << 20)
    rng = cupy.random.default_rng(0)
    res["launch_floor_us"] = launch_floor(h.stream)
    log("launch floor per tiny kernel in a CUDA graph:", f"{res['launch_floor_us']:.2f} us")
    res["batches"] = {}
    for n in (64, 8192):
        res["batches"][n] = {}
        for name in OPS:
            g = graph_times(h, name, n, ws, rng, check=(n == 64))
            lg = legacy_times(h, name, n, ws, rng)
            res["batches"][n][name] = {"graph": g, "legacy": lg}
            gb, lb = best(g["plans"]), best(lg)
            errs = [v.get("rel_err") for v in g["plans"].values() if isinstance(v, dict) and "rel_err" in v]
            log(f"n={n:<5} {name:<20} graph {g['built']:>2}/{g['listed']:<2} built in {g['build_s']:.2f}s "
                f"best {gb[1]:8.1f} us ({gb[0]}) max err {max(errs) if errs else float('nan'):.1e} | "
                f"legacy best {lb[1]:8.1f} us ({lb[0]})")
            if time.time() - T0 > args.deadline:
                break
    res["chunks"] = {}
    for name in ("conv1.fwd+bias_relu", "conv1.wgrad", "conv2.fwd+bias_relu", "conv2.dgrad", "conv2.wgrad"):
        res["chunks"][name] = {}
        for c in args.chunks:
            if time.time() - T0 > args.deadline:
                log("deadline: skipping the rest")
                break
            g = graph_times(h, name, c, ws, rng, top=6)
            lg = legacy_times(h, name, c, ws, rng)
            gb, lb = best(g["plans"]), best(lg)
            res["chunks"][name][c] = {"graph_best": gb, "legacy_best": lb, "graph_build_s": g["build_s"]}
            log(f"chunk {c:>6} {name:<20} graph {gb[1] * 1000 / c:7.1f} ns/img ({gb[0]}) | legacy "
                f"{lb[1] * 1000 / c:7.1f} ns/img ({lb[0]}) | build {g['build_s']:.2f}s")
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    log("wrote", args.out)


if __name__ == "__main__":
    main()
