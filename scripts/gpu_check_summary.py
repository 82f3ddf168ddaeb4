"""The one line of `bash scripts/gpu_check.sh spread`: each part's own summary line, then the whole's.

    python3 scripts/gpu_check_summary.py OUT "PART PART ..."

Reads OUT/PART/summary.txt of the parts this run ran (not older folders in OUT), and OUT/PART/seconds, the
part's wall clock, into its line. The whole passes where every
part passed and, where a test part ran, some test passed: a check that ran no test never passes, while a run of
sanitizer or program parts alone (GPU_CHECK_PARTS) has no test to count. Exit status 0 on a pass, else 1."""

from __future__ import annotations

import re
import sys
from pathlib import Path

WHOLE = 12   # the spread queue's parts


def summary(out: Path, ran: list[str]) -> tuple[list[str], bool]:
    lines, ok, counts = [], True, [0, 0, 0, 0]
    gpus = []
    for name in ran:
        f = out / name / "summary.txt"
        s = f.read_text().strip() if f.exists() else f"gpu-check ({name}): FAIL | no summary"
        took = out / name / "seconds"   # the part's wall clock, where the spread wrote it
        lines.append(f"{name}: {s}" + (f" | {took.read_text().strip()} s" if took.exists() else ""))
        ok &= " PASS " in s
        m = re.search(r"(\d+) passed, (\d+) failed, (\d+) skipped, (\d+) errors", s)
        counts = [a + int(b) for a, b in zip(counts, m.groups())] if m else counts
        gpus += re.findall(r"\| GPU (?!tests not run)([^|]*(?:\| cuDNN [^|]*)?)$", s)   # not "GPU tests not run"
    tests = any(name.startswith("tests") for name in ran)
    passed = ok and (counts[0] > 0 or not tests)
    what = ("programs, memcheck + leak check, racecheck, synccheck, initcheck, over one model and a pack"
            if len(ran) == WHOLE else f"only the parts {', '.join(ran)} (not the whole check)")
    lines.append(f"gpu-check (spread): {'PASS' if passed else 'FAIL'} | {counts[0]} passed, {counts[1]} failed, "
                 f"{counts[2]} skipped, {counts[3]} errors | {what}: {'all clean' if ok else 'see the parts'} | "
                 f"GPU {gpus[0].strip() if gpus else 'unknown'}")
    return lines, passed


def main(argv: list[str]) -> int:
    lines, passed = summary(Path(argv[1]), sorted(argv[2].split()))
    print("\n".join(lines), flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
