"""A PyTorch training step (forward, cross-entropy, backward, optimizer.step()) with our module
(lenet.torch.LeNet) and with PyTorch's own LeNet (tests/torch_lenet.py), each eager and captured
in a CUDA graph (torch.cuda.graphs), at several batch sizes, in one run; microseconds per step.

    python3 scripts/torch_bench.py [--batch 64 1024 8192] [--engine auto] [--repeats 5] [--steps 200]

Each form is warmed up first (our module plans each batch size there, PyTorch's cuDNN picks its
algorithms: torch.backends.cudnn.benchmark on, TF32 off as in every comparison of ours), then timed
with CUDA events over --steps steps, --repeats times; the median is printed. The optimizer is
torch.optim.SGD with momentum 0.9, its fused kernel (--sgd foreach for the other), the same for both
modules. scripts/bench.py times PyTorch's LeNet in every form, torch.compile's included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))   # the PyTorch reference: tests/torch_lenet.py


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 1024, 8192])
    ap.add_argument("--engine", default="auto", choices=("auto", "legacy", "graph", "ours"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sgd", choices=("fused", "foreach"), default="fused",
                    help="torch.optim.SGD's implementation for both modules (default: fused)")
    ap.add_argument("--json")
    ap.add_argument("--check", type=int, metavar="STEPS",
                    help="no timing: STEPS eager steps of our module at each batch size, printing each loss "
                         "(what scripts/gpu_check.sh runs under compute-sanitizer)")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch_lenet import TorchLeNet, exact_float32

    import lenet.torch as lt

    exact_float32()
    if args.check:
        for n in args.batch:
            x, y = torch.randn(n, 1, 28, 28, device="cuda"), torch.randint(0, 10, (n,), device="cuda")
            model = lt.LeNet(engine=args.engine).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            for _ in range(args.check):
                opt.zero_grad()
                loss = F.mse_loss(model(x), F.one_hot(y, 10).float())   # a loss of torch's: dlogits given
                loss.backward()
                opt.step()
                print(f"batch {n} loss {loss.item():.6f}", flush=True)
        return 0
    torch.backends.cudnn.benchmark = True
    rows = []
    print(f"{'batch':>6} | {'module':<14} | {'form':<10} | {'us/step':>9} | {'M img/s':>8}")
    for n in args.batch:
        g = torch.Generator(device="cuda").manual_seed(n)
        x = torch.randn(n, 1, 28, 28, device="cuda", generator=g)
        y = torch.randint(0, 10, (n,), device="cuda", generator=g)
        result = {}
        for name, make in (("torch LeNet", lambda: TorchLeNet().cuda()),
                           (f"ours ({args.engine})", lambda: lt.LeNet(engine=args.engine).cuda())):
            for form in ("eager", "cuda graph"):
                model = make()
                opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, **{args.sgd: True})

                def step():
                    opt.zero_grad(set_to_none=False)
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    opt.step()

                run = step
                if form == "eager":
                    for _ in range(5):
                        step()
                else:   # PyTorch's recipe: warm up on a side stream, then capture
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        for _ in range(5):
                            step()
                    torch.cuda.current_stream().wait_stream(s)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                    run = graph.replay
                times = []
                for _ in range(args.repeats):
                    run()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(args.steps):
                        run()
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b) * 1e3 / args.steps)
                us = statistics.median(times)
                result[(name, form)] = us
                rows.append({"batch": n, "module": name, "form": form, "sgd": args.sgd, "us": us})
                print(f"{n:>6} | {name:<14} | {form:<10} | {us:9.1f} | {n / us:8.2f}", flush=True)
        for form in ("eager", "cuda graph"):
            ratio = result[("torch LeNet", form)] / result[(f"ours ({args.engine})", form)]
            print(f"{n:>6} | ours vs torch LeNet, {form}: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
