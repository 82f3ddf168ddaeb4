"""How long NVRTC takes over each module of ours (lenet/kernels/*.cu), one after the other and
all at once on threads of their own, as a first run on a fresh machine compiles them (Note [first
run] in lenet/kernels/__init__.py). No GPU needed: the architecture is named.

    python3 scripts/probes/nvrtc_modules.py [--arch 90]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def compile_once(name: str, arch: str) -> float:
    from cupy_backends.cuda.libs import nvrtc

    from lenet import kernels

    t = time.perf_counter()
    prog = nvrtc.createProgram(kernels.source(name), f"{name}.cu", (), ())
    try:   # CuPy's own options beside ours (cupy.cuda.compiler)
        nvrtc.compileProgram(prog, [*kernels.options(name), f"-arch=sm_{arch}", "--device-as-default-execution-space"])
    finally:
        nvrtc.destroyProgram(prog)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="90", help="compute capability as NVRTC's sm_XX takes it (default: 90)")
    args = ap.parse_args()
    from cupy_backends.cuda.libs import nvrtc

    from lenet import kernels

    names = list(dict.fromkeys((*kernels.STAGE_MODULES, *kernels.COMMON_MODULES)))
    compile_once("sgd", args.arch)   # NVRTC's own first-use cost, apart
    print(f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))}, sm_{args.arch}")
    took = {}   # all at once first: a second compile of one source in a process came back far faster
    t = time.perf_counter()
    threads = [threading.Thread(target=lambda n=n: took.__setitem__(n, compile_once(n, args.arch))) for n in names]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    serial = {n: compile_once(n, args.arch) for n in names}
    for n, s in sorted(serial.items(), key=lambda kv: -kv[1]):
        print(f"{n:<26s} {s:6.2f} s alone, {took[n]:6.2f} s beside the others")
    print(f"{'sum (one after the other)':<26s} {sum(serial.values()):6.2f} s")
    print(f"{'all at once, on threads':<26s} {wall:6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
