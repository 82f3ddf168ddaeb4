"""How long NVRTC takes over the modules of ours (lenet/kernels/*.cu) as a first run on a fresh
machine compiles them (Note [first run] in lenet/kernels/nvrtc.py): each alone, then all at once on
threads of one process, then all at once in processes of their own; each measurement in a fresh
process (NVRTC answered a second compile of one source in a process from memory). No GPU needed:
the architecture is named.

    python3 scripts/probes/nvrtc_modules.py [--arch 90] [--only head stage2_backward_split4 ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def compile_once(name: str, arch: str) -> float:
    """Seconds of one compile as the programs run it (lenet.kernels.nvrtc), without the cache."""
    from lenet.kernels import nvrtc as modules

    from lenet import kernels

    nv = modules.nvrtc()
    t = time.perf_counter()
    nv.compile(kernels.source(name), f"{name}.cu",
               ("--device-as-default-execution-space", *nv.minimal, *kernels.options(name), f"-arch=sm_{arch}"))
    return time.perf_counter() - t


def child(mode: str, names: list[str], arch: str) -> dict:
    """Seconds per module, and the wall clock of them all, compiled ``mode``: one after the other
    (serial), or all at once on threads (threads)."""
    from lenet.kernels import nvrtc as modules

    modules.nvrtc()   # loaded before the clock starts
    took, t = {}, time.perf_counter()
    if mode == "serial":
        for n in names:
            took[n] = compile_once(n, arch)
    else:
        threads = [threading.Thread(target=lambda n=n: took.__setitem__(n, compile_once(n, arch))) for n in names]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    return {"took": took, "wall": time.perf_counter() - t}


def run_child(mode: str, names: list[str], arch: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--arch", arch, "--only", *names],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="90", help="compute capability as NVRTC's sm_XX takes it (default: 90)")
    ap.add_argument("--only", nargs="+", help="these modules (default: every module of ours)")
    ap.add_argument("--child", choices=("serial", "threads"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    from lenet import kernels

    names = args.only or list(dict.fromkeys((*kernels.STAGE_MODULES, *kernels.COMMON_MODULES)))
    if args.child:
        print(json.dumps(child(args.child, names, args.arch)))
        return 0
    from lenet.kernels import nvrtc as modules

    print(f"NVRTC {'.'.join(map(str, modules.nvrtc().version))}, sm_{args.arch}, {len(names)} modules")
    alone = {n: run_child("serial", [n], args.arch)["took"][n] for n in names}
    threads = run_child("threads", names, args.arch)
    t = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--child", "serial", "--arch", args.arch, "--only", n],
                              stdout=subprocess.PIPE, text=True) for n in names]
    in_procs = {n: json.loads(p.communicate()[0].strip().splitlines()[-1])["took"][n] for n, p in zip(names, procs)}
    procs_wall = time.perf_counter() - t
    print(f"{'module':<26s} {'alone':>7s} {'threads':>8s} {'processes':>10s}  (seconds)")
    for n in sorted(names, key=lambda n: -alone[n]):
        print(f"{n:<26s} {alone[n]:7.2f} {threads['took'][n]:8.2f} {in_procs[n]:10.2f}")
    print(f"{'sum alone':<26s} {sum(alone.values()):7.2f}")
    print(f"{'wall, all at once':<26s} {'':7s} {threads['wall']:8.2f} {procs_wall:10.2f}  (processes: with their start-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
