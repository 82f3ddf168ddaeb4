"""Side-by-side benchmark: a full LeNet training step (forward, backward, momentum SGD), ours and
PyTorch's at its fastest, in one process on one GPU.

    python3 scripts/bench.py                       # batch sizes 1 64 128 1024 8192 65536, the quick forms
    python3 scripts/bench.py --batch 64 --torch-forms all --json bench.json
    python3 scripts/bench.py --table bench.json    # every variant's table from a results file (no GPU)
    python3 scripts/bench.py --table b1.json b64.json b65536-a.json b65536-b.json   # runs split, rendered as one
    python3 scripts/bench.py --batch 1 64 128 8192 65536 --algo heuristic --repeats 3 --no-epoch \
        --record docs/results/speed.json           # the README's speed table's rows (scripts/readme_tables.py)

PyTorch: every form of scripts/torch_forms.py that --torch-forms selects (default "quick": eager and the
whole step in a CUDA graph, plain and compiled (torch.compile, the step captured), each with
cudnn.benchmark off and on and SGD foreach and fused; "all" adds torch.compile's eager, reduce-overhead,
max-autotune and max-autotune-no-cudagraphs forms), float32 with TF32 off, and above 8192 images each also
as gradient accumulation over 8192-image micro-batches. The fastest of them is the yardstick. Ours, as
CUDA graphs: --engine legacy, graph, ours and auto, and auto with --allow-tf32; and auto eager
(--variants picks some). Ours is float32 to float32's accuracy: plain float32 FMA, but where conv2's backward takes one of
our versions 6 to 8, whose weight gradient runs on the tensor cores as three TF32 products per float32
product (3xTF32, Note [three tf32 products] in lenet/kernels/tf32.cu); each row of ours names the
arithmetic it took.

Each variant is built (compile, search and capture excluded from the timing, its build seconds reported),
warmed up, and timed alone: --repeats runs of steps with CUDA events, the median. Then the fastest
PyTorch float32 form and ours auto are built again and timed interleaved, repeat by repeat (the ratio the
summary line gives), beside the same PyTorch form with TF32 on and ours with --allow-tf32 (reported
apart). Also times one epoch of 60,000 GPU-resident images at batch 64, ours against the fastest PyTorch
form at batch 64. Every time is printed and written to --json, after each variant.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # the PyTorch reference: tests/torch_lenet.py

from lenet.engines import Policy  # noqa: E402
from lenet import data  # noqa: E402
from lenet.model import LeNet  # noqa: E402
from torch_lenet import exact_float32  # noqa: E402
from torch_forms import (LR, MICRO, Form, TorchStep, at_batch, fastest, release, select,  # noqa: E402
                         set_flags, time_steps)
import readme_tables  # noqa: E402

# conv2's backward versions of ours whose weight gradient runs as three TF32 products on the tensor cores
# (lenet/engines/ours.py's docstring, Note [three tf32 products] in lenet/kernels/tf32.cu)
TENSOR_CORE_BACKWARD = (6, 7, 8)


def steps_for(batch: int) -> int:
    """Steps per timed run: enough for ~20 ms of work, at least 5."""
    return int(max(5, min(200, 2_000_000 // (batch * 100))))


def lt_workspace(model) -> int:
    """Bytes of the model's cuBLASLt workspace, where its head made one."""
    lazy = model.planner.state("cublaslt").get("lt")
    return lazy.made.workspace_bytes if lazy is not None and lazy.made is not None else 0


def arithmetic(rows: list[dict], allow_tf32: bool) -> str:
    """How a step of ours computes, from its operations' rows (LeNet.describe): float32, TF32 where
    allowed, and each backward of ours that runs 3xTF32 on the tensor cores, named."""
    from lenet.kernels.stages import Backward, parse_name

    three = []
    for r in rows:
        cand = parse_name(r.get("algo", "")) if r.get("engine") == "ours" else None
        if isinstance(cand, Backward) and cand.version + 1 in TENSOR_CORE_BACKWARD:
            three.append(f"{r['layer']} {r['algo']}")
    base = "TF32 allowed (cuDNN, cuBLAS)" if allow_tf32 else "float32"
    if three:
        return f"{base}; 3xTF32 on the tensor cores, float32 accuracy: the weight gradient of {', '.join(three)}"
    return base


class Ours:
    def __init__(self, batch, graph, policy, fused=True):
        """policy: a lenet.engines.Policy (engine, TF32 and the rest)."""
        import gc

        import cupy
        t0 = time.perf_counter()
        self.cupy = cupy
        pool = cupy.get_default_memory_pool()
        gc.collect()
        pool.free_all_blocks()
        base = pool.used_bytes()
        self.m = LeNet(max_batch=batch, policy=policy, seed=0, cuda_graph=graph, fused=fused, momentum=0.9)
        rng = np.random.default_rng(0)
        self.m.load_batch(rng.standard_normal((batch, 1, 28, 28)).astype(np.float32),
                          rng.integers(0, 10, batch).astype(np.int32))
        self.batch = batch
        self.m.plan(batch)
        pool.free_all_blocks()   # the search's temporaries
        self.step()
        self.m.stream.synchronize()
        self.rows = self.m.describe(batch)
        self.arithmetic = arithmetic(self.rows, policy.allow_tf32)
        # A step allocates nothing: what is in use after one is its peak (search temporaries excluded).
        self.peak = pool.used_bytes() - base
        # What the step needs: activations and their gradients, parameters, gradients, momentum,
        # the cuDNN and cuBLAS workspaces.
        self.tensor_bytes = (sum(a.nbytes for a in self.m.buf.values()) + 3 * self.m.params.nbytes
                             + self.m.workspace.size + self.m.blas.workspace_bytes
                             + lt_workspace(self.m))
        self.stream = self.m.stream
        self.build_s = time.perf_counter() - t0   # the plan's search included

    def step(self):
        self.m.step(self.batch, LR)

    def close(self):
        self.m.close()
        del self.m
        self.cupy.get_default_memory_pool().free_all_blocks()


def time_run(v, k: int) -> float:
    """Microseconds per step over k steps, CUDA events on the variant's stream."""
    if isinstance(v, Ours):
        import cupy
        s, e = cupy.cuda.Event(), cupy.cuda.Event()
        s.record(v.stream)
        for _ in range(k):
            v.step()
        e.record(v.stream)
        e.synchronize()
        return cupy.cuda.get_elapsed_time(s, e) * 1000 / k
    return time_steps(v, k)


OURS = ("ours legacy", "ours graph", "ours ours", "ours auto")   # the float32 engines the summary compares


def ours_makers(batch, algo) -> dict:
    ours = lambda engine, graph=True, tf32=False: (lambda: Ours(  # noqa: E731
        batch, graph, Policy.parse(algo, engine=engine, allow_tf32=tf32)))
    return {"ours eager auto": ours("auto", graph=False), "ours legacy": ours("legacy"), "ours graph": ours("graph"),
            "ours ours": ours("ours"), "ours auto": ours("auto"), "ours auto tf32": ours("auto", tf32=True)}


def row_of(v, times: list[float], batch: int) -> dict:
    us = statistics.median(times)
    row = {"us_per_step": us, "m_img_per_s": batch / us, "peak_bytes": int(v.peak),
           "spread_pct": 100 * (max(times) - min(times)) / us, "times_us": times, "build_s": v.build_s}
    if isinstance(v, Ours):
        row.update(tensor_bytes=int(v.tensor_bytes), operations=v.rows, arithmetic=v.arithmetic)
    else:
        row.update(form=v.form.key, micro=v.form.micro, arithmetic=v.form.arithmetic)
    return row


def error_of(e: Exception) -> dict:
    return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]}


def measure_alone(make, batch: int, k: int, repeats: int) -> dict:
    """One variant built, warmed up, timed ``repeats`` times over k steps, and closed; a variant that cannot
    be built or run is reported, not fatal."""
    try:
        v = make()
    except Exception as e:  # noqa: BLE001
        release()
        return error_of(e)
    try:
        time_run(v, max(2, k // 4))   # warm-up
        return row_of(v, [time_run(v, k) for _ in range(repeats)], batch)
    except Exception as e:  # noqa: BLE001
        return error_of(e)
    finally:
        v.close()


def measure_together(makers: dict, batch: int, k: int, repeats: int) -> dict:
    """The variants built together and timed interleaved, repeat by repeat."""
    built, out = {}, {}
    for name, make in makers.items():
        try:
            built[name] = make()
        except Exception as e:  # noqa: BLE001
            out[name] = error_of(e)
    times = {n: [] for n in built}
    for v in built.values():
        time_run(v, max(2, k // 4))
    for _ in range(repeats):
        for n, v in built.items():
            times[n].append(time_run(v, k))
    for n, v in built.items():
        out[n] = row_of(v, times[n], batch)
        v.close()
    return out


def bench_batch(batch, repeats, algo, forms: list[Form], only=None, tf32: bool = True, out=None,
                saved=lambda: None) -> dict:
    """Every selected PyTorch form and variant of ours at ``batch``, each alone; then the fastest PyTorch
    float32 form against ours auto interleaved (and both with TF32, reported apart). Fills ``out`` and
    calls ``saved()`` after each variant (a run cut short keeps what it timed)."""
    k = steps_for(batch)
    out, torch_fp32 = ({} if out is None else out), []
    for f in at_batch(forms, batch, MICRO):
        print(f"{batch:>6} | {f.name} ...", end="\r", flush=True)
        out[f.name] = measure_alone(lambda f=f: TorchStep(f, batch), batch, k, repeats)
        torch_fp32.append(f.name)
        report(batch, f.name, out[f.name])
        saved()
    for name, make in ours_makers(batch, algo).items():
        if (only and name not in only) or name == "ours auto tf32" and not tf32:
            continue
        out[name] = measure_alone(make, batch, k, repeats)
        report(batch, name, out[name])
        saved()
    best = fastest(out, torch_fp32)
    out["fastest_torch_fp32"] = best
    if best is not None and "us_per_step" in out.get("ours auto", {}):
        form = next(f for f in at_batch(forms, batch, MICRO) if f.name == best)
        pair = {best: lambda: TorchStep(form, batch), "ours auto": ours_makers(batch, algo)["ours auto"]}
        if tf32:
            t = Form(form.mode, form.benchmark, form.optimizer, True, form.micro)
            pair |= {t.name: lambda: TorchStep(t, batch), "ours auto tf32": ours_makers(batch, algo)["ours auto tf32"]}
        out["head_to_head"] = measure_together(pair, batch, k, repeats)
    out["summary"] = summarize(out)
    return out


def summarize(r: dict) -> dict:
    """The speedups of a batch's results: each float32 engine of ours against the fastest PyTorch float32
    form, timed alone; ours auto against it interleaved; and with TF32 on both sides (reported apart)."""
    best = r.get("fastest_torch_fp32")
    if best is None:
        return {}
    base = r[best]["us_per_step"]
    out = {"fastest_torch_fp32": best, "torch_us": base,
           "alone": {o: base / r[o]["us_per_step"] for o in OURS if "us_per_step" in r.get(o, {})}}
    h = r.get("head_to_head", {})
    if "us_per_step" in h.get(best, {}) and "us_per_step" in h.get("ours auto", {}):
        out["interleaved"] = {"torch_us": h[best]["us_per_step"], "ours_us": h["ours auto"]["us_per_step"],
                              "speedup": h[best]["us_per_step"] / h["ours auto"]["us_per_step"]}
    tf = [n for n in h if n.startswith("torch ") and " tf32" in n]
    if tf and "us_per_step" in h[tf[0]] and "us_per_step" in h.get("ours auto tf32", {}):
        out["tf32"] = {"torch": tf[0], "torch_us": h[tf[0]]["us_per_step"],
                       "ours_us": h["ours auto tf32"]["us_per_step"],
                       "speedup": h[tf[0]]["us_per_step"] / h["ours auto tf32"]["us_per_step"]}
    return out


def report(batch: int, name: str, v: dict) -> None:
    if "error" in v:
        print(f"{batch:>6} | {name:<40} | {v['error']}", flush=True)
        return
    build = f"{v['build_s']:7.1f} s" if v.get("build_s") is not None else " " * 9
    print(f"{batch:>6} | {name:<40} | {v['us_per_step']:>10.1f} | {v['m_img_per_s']:>8.3f} | "
          f"{v['peak_bytes'] / 2**20:>8.1f} | {v['spread_pct']:>5.1f}% | {build} | {v['arithmetic']}", flush=True)


def summary_lines(batch: int, s: dict) -> list[str]:
    if not s:
        return [f"{batch:>6} | no PyTorch float32 form ran"]
    alone = ", ".join(f"{k[5:]} {v:.2f}x" for k, v in s["alone"].items())
    lines = [f"{batch:>6} | vs the fastest PyTorch float32 form, TF32 off ({s['fastest_torch_fp32']}, "
             f"{s['torch_us']:.1f} us), each timed alone: {alone}"]
    if "interleaved" in s:
        i = s["interleaved"]
        lines.append(f"{batch:>6} | ours auto vs {s['fastest_torch_fp32']}, interleaved: {i['ours_us']:.1f} vs "
                     f"{i['torch_us']:.1f} us, {i['speedup']:.2f}x")
    if "tf32" in s:
        t = s["tf32"]
        lines.append(f"{batch:>6} | with TF32 on both sides (apart): ours auto tf32 {t['ours_us']:.1f} us vs "
                     f"{t['torch']} {t['torch_us']:.1f} us, {t['speedup']:.2f}x")
    return lines


def bench_epoch(policy, form: Form) -> dict:
    """One epoch of 60,000 GPU-resident images at batch 64, momentum SGD with weight decay: ours (gather +
    graph replay) against PyTorch in ``form`` (the fastest at batch 64), its step gathering and normalizing
    the batch from a device index buffer (captured with the rest where the form captures), the index
    buffer refilled from the epoch's order before each step, the last shorter batch run uncaptured. The
    second of two epochs is timed."""
    root = data.find_dataset()
    if root is not None:
        x, y = data.load_split(root, "train")
    else:
        rng = np.random.default_rng(0)
        x, y = rng.integers(0, 256, (60000, 28, 28), dtype=np.uint8), rng.integers(0, 10, 60000).astype(np.uint8)
    mean, std = data.pixel_stats(x)
    B, N = 64, len(x)
    steps = -(-N // B)
    rest = N - (steps - 1) * B
    res = {"source": str(root) if root else "random uint8", "torch_form": form.name, "torch_arithmetic": form.arithmetic}
    m = LeNet(max_batch=B, policy=policy, cuda_graph=True, momentum=0.9, weight_decay=5e-4)
    ds = data.GpuDataset(x, y, mean, std, m.stream)
    for sz in {B, rest}:
        m.plan(sz)
    for epoch in range(2):   # the first epoch captures the graphs
        order = ds.order(0, epoch)
        m.stream.synchronize()
        t = time.perf_counter()
        for s in range(steps):
            n = min(B, N - s * B)
            m.load_from(ds, order, s * B, n, lr=LR)
            m.step(n)
        m.stream.synchronize()
        res["ours_s"] = time.perf_counter() - t
    m.close()
    timg, tlab = torch.as_tensor(x, device="cuda"), torch.as_tensor(y, device="cuda").long()
    idx = torch.zeros(B, dtype=torch.long, device="cuda")
    part = {"n": B}

    def inputs():
        i = idx[: part["n"]]
        return timg[i].float().div(255).sub(mean).div(std).unsqueeze(1), tlab[i]
    v = TorchStep(form, B, inputs=inputs, weight_decay=5e-4)
    set_flags(form)
    for epoch in range(2):
        order = torch.as_tensor(data.epoch_order(0, epoch, N).astype(np.int64), device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.cuda.stream(v.stream):
            for s in range(steps - 1):
                idx.copy_(order[s * B:(s + 1) * B])
                v.step()
            part["n"] = rest   # the shorter last batch, uncaptured
            idx[:rest].copy_(order[(steps - 1) * B:])
            v._step()
            part["n"] = B
        torch.cuda.synchronize()
        res["torch_s"] = time.perf_counter() - t
    v.close()
    return res


def _us(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def render_table(results: dict) -> str:
    """The tables of a results file (--json), as docs/performance.md quotes them: per batch size ours against PyTorch's fastest
    float32 form (alone and interleaved) and with TF32 on both sides; then every variant's us per step."""
    batches = [b for b in results["results"] if b != "epoch"]
    lines = ["| batch | ours auto us/step | fastest PyTorch float32 form (TF32 off) | its us/step | ours / PyTorch "
             "(alone) | interleaved: ours vs PyTorch us | TF32 on both sides: ours vs PyTorch us |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for b in batches:
        r = results["results"][b]
        s = r.get("summary") or {}
        alone = s.get("alone", {}).get("ours auto")
        i, t = s.get("interleaved"), s.get("tf32")
        lines.append(" | ".join([
            f"| {b}", _us(r.get("ours auto", {}).get("us_per_step")), s.get("fastest_torch_fp32", "-"),
            _us(s.get("torch_us")), "-" if alone is None else f"{alone:.2f}x",
            "-" if i is None else f"{i['ours_us']:.1f} vs {i['torch_us']:.1f}: {i['speedup']:.2f}x",
            "-" if t is None else f"{t['ours_us']:.1f} vs {t['torch_us']:.1f}: {t['speedup']:.2f}x"]) + " |")
    names = []
    for b in batches:
        for n, v in results["results"][b].items():
            if isinstance(v, dict) and ("us_per_step" in v or "error" in v) and n not in names:
                names.append(n)
    lines += ["", "| variant, us per step | " + " | ".join(batches) + " |", "| --- |" + " --- |" * len(batches)]
    for n in names:
        cells = []
        for b in batches:
            v = results["results"][b].get(n)
            cells.append("-" if v is None else "failed" if "error" in v else f"{v['us_per_step']:.1f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    e = results["results"].get("epoch")
    if e:
        lines += ["", f"Epoch of 60,000 images at batch 64 ({e['source']}): ours {e['ours_s']:.3f} s, "
                      f"{e['torch_form']} ({e['torch_arithmetic']}) {e['torch_s']:.3f} s: "
                      f"{e['torch_s'] / e['ours_s']:.1f}x"]
    return "\n".join(lines)


def merged(files: list[dict]) -> dict:
    """Results files as one: their batch sizes in order, a batch size timed in several files (its forms
    split over runs) the union of their variants, its yardstick the fastest PyTorch float32 form of them
    all with the interleaved pair of the run that timed it; the last file's epoch that has one."""
    out, epoch = {**files[0], "results": {}}, None
    for f in files:
        for k, v in f["results"].items():
            if k == "epoch":
                epoch = v
                continue
            have = out["results"].get(k)
            if have is None:
                out["results"][k] = dict(v)
                continue
            pair = min((have, v), key=lambda r: (r.get("summary") or {}).get("torch_us", float("inf")))
            both = {**have, **{n: r for n, r in v.items() if isinstance(r, dict) and ("us_per_step" in r or "error" in r)}}
            both["head_to_head"] = pair.get("head_to_head", {})
            both["fastest_torch_fp32"] = fastest(both, [n for n in both if n.startswith("torch ")])
            both["summary"] = summarize(both)
            out["results"][k] = both
    if epoch is not None:
        out["results"]["epoch"] = epoch
    return out


def recorded_command(argv) -> str:
    """The command a recorded row names: this run's, less --json (where its results file went, a path of
    the machine it ran on, not part of what was measured)."""
    given = list(argv)
    while "--json" in given:
        i = given.index("--json")
        del given[i:i + 2]
    return shlex.join(["python3", "scripts/bench.py", *(a for a in given if not a.startswith("--json="))])


def record_rows(out: dict, command: str) -> list[dict]:
    """The README's speed rows of a run (scripts/readme_tables.py): per batch size, ours auto against the
    fastest PyTorch float32 form, each timed alone; a batch size without both is left out."""
    rows = []
    for b, r in out["results"].items():
        s = (r.get("summary") or {}) if b != "epoch" else {}
        ours = r.get("ours auto", {}).get("us_per_step")
        if ours is None or not s:
            continue
        rows.append({"batch": int(b), "ours_us": round(ours, 2), "torch_form": s["fastest_torch_fp32"],
                     "torch_us": round(s["torch_us"], 2), "gpu": out["gpu"], "cudnn": out["cudnn"],
                     **readme_tables.provenance(command)})
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 128, 1024, 8192, 65536])
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per variant (median; default 7)")
    ap.add_argument("--algo", default="exhaustive", help="our algorithm policy (default: exhaustive)")
    ap.add_argument("--torch-forms", nargs="+", default=["quick"], metavar="FORM",
                    help="PyTorch's forms to time: presets quick (default: eager, graph, compile+graph), nocompile, none, "
                         "compile, all, or patterns over MODE/BENCH/OPT such as 'graph/bench/*' "
                         "(scripts/torch_forms.py)")
    ap.add_argument("--no-tf32", dest="tf32", action="store_false",
                    help="leave out the pair with TF32 on (the fastest PyTorch form and ours --allow-tf32)")
    ap.add_argument("--no-epoch", action="store_true", help="skip the epoch timing")
    ap.add_argument("--variants", nargs="+", default=None, help="only these variants of ours (names as printed)")
    ap.add_argument("--json", default="bench.json", help="write every result here (default: bench.json)")
    ap.add_argument("--record", metavar="PATH",
                    help="also write the README's speed rows (ours auto against the fastest PyTorch float32 form, "
                         "with the date, GPU, cuDNN and commit) into this results file, replacing those of the batch "
                         "sizes timed: docs/results/speed.json, then python3 scripts/readme_tables.py")
    ap.add_argument("--table", metavar="JSON", nargs="+",
                    help="print the tables of results files (several: their batch sizes together) and "
                         "exit (no GPU)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.table:
        print(render_table(merged([json.loads(Path(f).read_text()) for f in args.table])))
        return 0
    forms = select(args.torch_forms)   # a pattern that matches nothing: one line before the GPU
    if args.record and Path(args.record).exists():
        readme_tables.load(Path(args.record), "speed")   # a results file it cannot add to: refused before the GPU
    exact_float32()
    import descriptors
    from descriptors.graph import available
    gpu = torch.cuda.get_device_name()
    print(f"GPU {gpu} | cuDNN {descriptors.version_string()} | graph API {available()[1]} | torch "
          f"{torch.__version__} (cuDNN {torch.backends.cudnn.version()}) | ours: --algo {args.algo}, fused, "
          f"CUDA graph unless eager | momentum SGD | PyTorch forms: {', '.join(f.key for f in forms)}")
    results = {}
    hdr = (f"{'batch':>6} | {'variant':<40} | {'us/step':>10} | {'M img/s':>8} | {'peak MB':>8} | {'spread':>6} | "
           f"{'build':>9} | arithmetic")
    print(hdr)
    print("-" * len(hdr))
    out = {"gpu": gpu, "torch": torch.__version__, "cudnn": descriptors.version_string(), "algo": args.algo,
           "torch_forms": [f.key for f in forms], "results": results}
    def saved():   # after each variant: a run cut short keeps what it timed
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    for b in args.batch:
        results[str(b)] = r = {}
        bench_batch(b, args.repeats, args.algo, forms, args.variants, args.tf32, r, saved)
        for line in summary_lines(b, r["summary"]):
            print(line, flush=True)
        saved()
    if not args.no_epoch:
        at64 = results.get("64", {}).get("fastest_torch_fp32")
        form = next((f for f in at_batch(forms, 64) if f.name == at64), Form("graph", True, "fused"))
        e = bench_epoch(Policy.parse(args.algo), form)
        results["epoch"] = e
        print(f"epoch of 60,000 GPU-resident images at batch 64 ({e['source']}): ours {e['ours_s']:.3f} s | "
              f"PyTorch {form.name} ({form.arithmetic}) {e['torch_s']:.3f} s | {e['torch_s'] / e['ours_s']:.1f}x")
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    if args.record:
        rows = record_rows(out, recorded_command(sys.argv[1:] if argv is None else argv))
        if not rows:
            print(f"--record {args.record}: no batch size has both ours auto and a PyTorch float32 form; nothing "
                  f"recorded", file=sys.stderr)
            return 1
        readme_tables.record(Path(args.record), "speed", rows)
        print(f"recorded {len(rows)} rows in {args.record}: python3 scripts/readme_tables.py renders the README's table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
