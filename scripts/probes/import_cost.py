"""What a training program's imports cost when nothing else runs: the modules python -m lenet.train
and its start-up threads import, one after another on one thread, with their bytecode cached; the
largest self times (python -X importtime), the largest Python-level costs (cProfile), and the
shared libraries the process maps with the time a ctypes load of each takes in a fresh process
(ctypes holds the GIL through dlopen).

    python3 scripts/probes/import_cost.py [--top 30]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPORTS = ("import lenet.train, lenet.model, cupy, descriptors, descriptors.graph; "
           "from lenet import blas; blas.binding('cublas'); blas.binding('cublasLt')")


def env() -> dict:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    e.pop("PYTHONDONTWRITEBYTECODE", None)
    e["PYTHONPYCACHEPREFIX"] = str(Path(tempfile.gettempdir()) / "lenet-import-cost-pyc")
    return e


def py(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, env=env())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    py(IMPORTS)   # the bytecode written
    for _ in range(2):
        p = py(f"import time; t = time.perf_counter(); {IMPORTS}; print(f'{{time.perf_counter() - t:.3f}}')")
        print(f"every import, one thread: {p.stdout.strip()} s {p.stderr[-300:]}")
    p = py(IMPORTS, "-X", "importtime")
    rows = []
    for line in p.stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "self" not in line:
            s, c, name = line[len("import time:"):].split("|")
            rows.append((int(s), int(c), name.rstrip()))
    print(f"\n{len(rows)} modules, self times add to {sum(r[0] for r in rows) / 1e3:.1f} ms; the largest:")
    for s, c, name in sorted(rows, reverse=True)[: args.top]:
        print(f"{s / 1e3:8.1f} ms self {c / 1e3:8.1f} ms in all  {name}")
    prof = ("import cProfile, pstats, io; pr = cProfile.Profile(); pr.enable(); " + IMPORTS +
            "; pr.disable(); b = io.StringIO(); pstats.Stats(pr, stream=b).sort_stats('tottime')"
            f".print_stats({args.top}); print(b.getvalue())")
    print(py(prof).stdout[-6000:])
    maps = py(IMPORTS + "; import ctypes\ntry: ctypes.CDLL('libcuda.so.1')\nexcept OSError: pass\n"
              "import lenet.kernels.nvrtc as n\ntry: n.nvrtc()\nexcept Exception: pass\n"
              "print('\\n'.join(sorted({l.split()[5] for l in open('/proc/self/maps') if len(l.split()) > 5 "
              "and '.so' in l.split()[5]})))").stdout.split()
    sized = sorted(((os.path.getsize(m), m) for m in maps if os.path.exists(m)), reverse=True)
    print(f"{len(sized)} shared objects mapped, {sum(s for s, _ in sized) / 1e6:.0f} MB; a ctypes load of each "
          f"of the largest in a fresh process (ms, three processes):")
    for size, path in sized[:14]:
        code = (f"import ctypes, time; t = time.perf_counter(); ctypes.CDLL({path!r}); "
                f"print(f'{{(time.perf_counter() - t) * 1e3:.1f}}')")
        times = [py(code).stdout.strip() or "failed" for _ in range(3)]
        print(f"{size / 1e6:8.1f} MB  {' / '.join(times):>22s}  {path}")


if __name__ == "__main__":
    main()
