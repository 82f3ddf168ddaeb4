"""A signal at chosen moments of a program's start, many times: how often it ends as it should.

    python scripts/signal_loop.py --offsets 0.09 0.15 0.3 0.6 1.0 2.0 --runs 20

For each program (lenet train, lenet sweep), signal (SIGINT, SIGTERM) and offset (seconds after the
process was started), RUNS runs on a small dataset of its own, each with a TMPDIR and --out of its own and
the caches warm (one unsignalled run first). A run ends well when, within 5 s of the signal, it printed
exactly one line, `...: interrupted by SIGINT`, exited 130 (SIGINT) or 143 (SIGTERM), and left nothing in
its TMPDIR or --out. The others are counted by what happened instead:

- ended first: the run ended by itself before the signal came (here, without a GPU, at its
  `error: no usable NVIDIA GPU` line once every check passed), with that one line and exit status 2;
- interpreter: the signal met the interpreter's own start, before the package's first line (the child
  had neither blocked nor caught SIGTERM when it was sent: /proc/PID/status), and Python answered it
  (a KeyboardInterrupt traceback through no file of ours, or death by the signal);
- bad: anything else (a traceback after our first line, a hang, a file left behind, another line).

Prints one row per (program, signal, offset) and the bare interpreter's start (`python -c pass`) here.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from signals import guarded  # noqa: E402 (the test's reading of a child's signals)


def dataset(root: Path, images: int) -> Path:
    """Fashion-MNIST's shape (``images`` training images, a sixth of that for test), gzipped: smooth images
    (a blurred gradient and noise), so that gzip has work as on the real files."""
    import numpy as np

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
    for split, n in (("train", images), ("test", max(20, images // 6))):
        pixels = (np.add.outer(np.arange(28), np.arange(28)) * 4)[None] + rng.integers(0, 8, (n, 1, 1))
        pixels = (pixels + rng.integers(0, 3, (n, 28, 28))).clip(0, 255).astype(np.uint8)
        for stem, a in zip(names[split], (pixels, rng.integers(0, 10, n, dtype=np.uint8))):
            raw = bytes([0, 0, 8, a.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in a.shape) + a.tobytes()
            (root / (stem + ".gz")).write_bytes(gzip.compress(raw, mtime=0))
    return root


def bare_start(python: str, env: dict) -> float:
    times = []
    for _ in range(10):
        t = time.monotonic()
        subprocess.run([python, "-c", "pass"], env=env, check=True)
        times.append(time.monotonic() - t)
    return statistics.median(times)


def one(python, program, sig, offset, work: Path, data: Path, env: dict, extra=()) -> str:
    tmp, out = work / "tmp", work / "out"
    shutil.rmtree(work, ignore_errors=True)
    tmp.mkdir(parents=True)
    cmd = [python, "-m", "lenet", program, "--quiet", "--data-dir", str(data), "--epochs", "1", "--out", str(out),
           *extra]
    p = subprocess.Popen(cmd, env={**env, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=work)
    time.sleep(max(0.0, offset - 0.003))
    early = p.poll() is None and not guarded(p.pid)
    p.send_signal(sig)
    try:
        so, se = p.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        return "bad"
    lines = [x for x in (so + se).splitlines() if x.strip()]
    left = list(tmp.iterdir()) + (list(out.iterdir()) if out.exists() else [])
    if p.returncode == 128 + sig and len(lines) == 1 and lines[0].endswith(f"interrupted by {sig.name}") and not left:
        return "good"
    if p.returncode == 2 and len(lines) == 1 and "no usable NVIDIA GPU" in lines[0] and not left:
        return "ended first"
    if early and p.returncode in (1, -sig, 128 + sig) and not left and f"lenet{os.sep}" not in so + se:
        return "interpreter"   # (a traceback through a file of ours is ours: bad)
    print(f"  bad: {program} {sig.name} at {offset:.3f} s: exit {p.returncode}, left {left[:3]}, output "
          f"{(so + se)[-600:]!r}", file=sys.stderr)
    return "bad"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--offsets", type=float, nargs="+", default=[0.09, 0.15, 0.3, 0.6, 1.0, 2.0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--programs", nargs="+", default=["train", "sweep"])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--images", type=int, default=60000, help="training images of the dataset (default: 60000)")
    ap.add_argument("--data-cache", action="store_true",
                    help="let the runs keep inflated copies (default: --no-data-cache, every run inflates)")
    args = ap.parse_args()
    extra = () if args.data_cache else ("--no-data-cache",)
    base = Path(tempfile.mkdtemp(prefix="lenet-signal-loop-"))
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("LENET_DATA", "LENET_DATA_CACHE")}
        env.update(PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(base / "cache"), HOME=str(base / "home"),
                   MPLCONFIGDIR=str(base / "mpl"), PYTHONDONTWRITEBYTECODE="1")   # the checkout stays as it is
        (base / "home").mkdir()
        data = dataset(base / "data", args.images)
        start = bare_start(args.python, env)
        print(f"python -c pass: {start * 1000:.0f} ms (median of 10); 1.5x: {1.5 * start * 1000:.0f} ms")
        for program in args.programs:   # warm: caches and bytecode as a second run has them
            for _ in range(2):
                t = time.monotonic()
                subprocess.run([args.python, "-m", "lenet", program, "--quiet", "--data-dir", str(data), "--epochs",
                                "1", *extra], env=env, capture_output=True, timeout=120, cwd=base)
            print(f"lenet {program} unsignalled: {time.monotonic() - t:.2f} s to its no-GPU line")
        print(f"{'program':<8} {'signal':<8} {'offset':>7}  good  ended-first  interpreter  bad")
        for program in args.programs:
            for sig in (signal.SIGINT, signal.SIGTERM):
                for offset in args.offsets:
                    counts: dict = {}
                    for i in range(args.runs):
                        r = one(args.python, program, sig, offset, base / "run", data, env, extra)
                        counts[r] = counts.get(r, 0) + 1
                    print(f"{program:<8} {sig.name:<8} {offset:7.3f}  {counts.get('good', 0):4}  "
                          f"{counts.get('ended first', 0):11}  {counts.get('interpreter', 0):11}  "
                          f"{counts.get('bad', 0):3}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
