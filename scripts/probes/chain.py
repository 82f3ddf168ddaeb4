"""Probe (GPU): where a small step's time goes along its chain of kernels, measured on the captured step
itself rather than kernel by kernel (ncu serializes kernels and so misses what programmatic launch
overlaps). Each variant rebuilds our kernels from their sources with one change and times the step of a
LeNet of ``--engine ours`` under the heuristic:

    base              the kernels as they are
    empty             every kernel of ours returns right after griddep_entry(): the chain's floor
                      (launches, programmatic-launch hand-offs, the side stream's join)
    empty:MODULE      that module's kernels return right after griddep_entry() (its share of the chain)
    empty:MODULE:K    only kernel K of that module
    late, late:MODULE[:K]  the kernels' entry waits for the kernel before without letting the next one be
                      scheduled first (griddepcontrol.launch_dependents dropped): the next kernel's blocks start
                      as this one's end, not resident beside it while it runs (sm_90 only)
    FILE=PATH         the package's FILE.cu (a module's own file or one it uses) replaced by PATH's text
                      in every module that compiles it: a kernel's new form timed beside the old
    A+B               both (empty:head_split+empty:head_weights: the head's share of the step)

The step's numbers are wrong in every empty variant (the check against cuDNN is switched off there; a FILE
variant keeps it, so a wrong kernel is refused as in a real plan). Each variant runs in a process of its own
(the kernel cache keys binaries by source, so each variant compiles once).

    python3 scripts/probes/chain.py --batch 1 64 --variants base empty empty:head_split
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CALL = "griddep_entry();"
EMPTY = "{ griddep_entry(); return; }"
LATE = 'asm volatile("griddepcontrol.wait;" ::: "memory");'   # no early trigger: the next kernel starts at the end
ENTRIES = {"empty": EMPTY, "late": LATE}


def patch(variant: str, module: str, text: str) -> str:
    """The source of ``module`` under ``variant`` (variants joined by + apply one after another)."""
    if "+" in variant:
        for v in variant.split("+"):
            text = patch(v, module, text)
        return text
    base = module.removesuffix("__pack")
    if "=" in variant:
        name, path = variant.split("=", 1)
        from lenet.kernels import FOLDER

        return text.replace((FOLDER / f"{name}.cu").read_text(), Path(path).read_text())
    parts = variant.split(":")
    if parts[0] not in ENTRIES or (len(parts) > 1 and parts[1] != base):
        return text
    entry = ENTRIES[parts[0]]
    if len(parts) <= 2:
        return text.replace(CALL, entry)
    at = text.index(parts[2] + "(")
    i = text.index(CALL, at)
    return text[:i] + entry + text[i + len(CALL):]


def child(variant: str, batches: list[int], steps: int) -> None:
    import lenet.kernels as K
    from lenet.engines.base import Check
    from lenet.engines.ours import Ours

    for v in variant.split("+"):
        name, eq, path = v.partition("=")
        if eq and not ((K.FOLDER / f"{name}.cu").is_file() and Path(path).is_file()):
            raise SystemExit(f"variant {v!r}: FILE=PATH needs lenet/kernels/FILE.cu and PATH to be files")
    source = K.source
    K.source = lambda name: patch(variant, name, source(name))
    if "empty" in variant:   # an emptied kernel's outputs are wrong: only its time means anything
        Ours.check_stage = lambda self, *a, **k: Check(0.0, 0)
    print_steps(variant, batches, steps)


def print_steps(variant: str, batches: list[int], steps: int) -> None:
    """A child's lines: heuristic_rows.ours_steps at each batch, one JSON line each."""
    import numpy as np

    from heuristic_rows import ours_steps

    for n, ahead, waited, host, plan in ours_steps(batches, steps):
        print(json.dumps({"variant": variant, "n": n, "ahead": ahead, "waited": float(np.median(waited)),
                          "host": host, "plan": plan}), flush=True)


def parser(doc: str, batches: list[int], variants: list[str], repeat: int) -> argparse.ArgumentParser:
    """The command line of a probe whose variants each run in a child (this one's and head_weights.py's)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=batches)
    ap.add_argument("--variants", nargs="+", default=variants)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=repeat, help="runs of the variant list, one after another")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap


def run_variants(script: str, args) -> None:
    """Each variant in a process of its own (``script --child VARIANT``), ``args.repeat`` times over the list.
    The children's models keep no plan cache (LeNet's default), so no choice outlives its variant."""
    plans = {}   # a batch's first plan is printed, and a later variant's where it differs
    for _ in range(args.repeat):
        for v in args.variants:
            r = subprocess.run([sys.executable, script, "--child", v, "--steps", str(args.steps), "--batch",
                                *map(str, args.batch)], capture_output=True, text=True)
            got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
            if r.returncode != 0 or not got:
                print(f"{v}: failed (rc {r.returncode}): {r.stderr.strip().splitlines()[-1:]}", flush=True)
            for g in got:
                print(f"n={g['n']:<5} {v:<40} back-to-back {g['ahead']:6.1f} us  waited {g['waited']:6.1f} us  "
                      f"host {g['host']:6.1f} us", flush=True)
                if g["n"] not in plans or plans[g["n"]] != g["plan"]:
                    print(f"      its plan: {g['plan']}", flush=True)
                plans.setdefault(g["n"], g["plan"])


def probe_main(script: str, doc: str, child_fn, batches: list[int], variants: list[str], repeat: int) -> int:
    """A variant probe's main: as a child, ``child_fn(variant, batches, steps)``; else every variant's child."""
    args = parser(doc, batches, variants, repeat).parse_args()
    if args.child:
        child_fn(args.child, args.batch, args.steps)
    else:
        run_variants(script, args)
    return 0


def main() -> int:
    return probe_main(__file__, __doc__, child, [1, 64], ["base", "empty"], 1)


if __name__ == "__main__":
    sys.exit(main())
