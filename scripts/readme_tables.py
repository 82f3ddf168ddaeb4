"""The README's two measurement tables (speed, time to accuracy), rendered from the results files the
benchmarks write, so that what the README says is what was measured.

    python3 scripts/readme_tables.py            # rewrite README.md's tables from docs/results/*.json
    python3 scripts/readme_tables.py --check    # exit 1, naming the table, where README.md differs

The results files are written by the benchmarks' --record (docs/performance.md, "Measuring again"):

    python3 scripts/bench.py --batch 1 64 128 8192 65536 --algo heuristic --repeats 3 --no-epoch \\
        --record docs/results/speed.json
    python3 scripts/time_to_accuracy.py --recipe fast --warm --torch --record docs/results/time_to_accuracy.json

Each row carries where and when it was measured (date, GPU, cuDNN, commit, command): a run records the
rows it measured, replacing those of the same key (a batch size; a recipe, trainer and run), and keeps
the others. A file that is not what this script writes is refused with one line naming the file, the row
and the field.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SPEED = ROOT / "docs" / "results" / "speed.json"
TIME_TO_ACCURACY = ROOT / "docs" / "results" / "time_to_accuracy.json"


class ResultsError(ValueError):
    """A results file or README that cannot be rendered: one line saying which and why."""


# Every row names where and when it was measured.
PROVENANCE = {"measured": str, "gpu": str, "cudnn": str, "commit": str, "command": str}
NUMBER = (int, float)
KINDS = {
    "speed": {"key": ("batch",),
              "fields": {"batch": int, "ours_us": NUMBER, "torch_form": str, "torch_us": NUMBER, **PROVENANCE}},
    "time_to_accuracy": {"key": ("recipe", "trainer", "run"),
                         "fields": {"recipe": str, "trainer": str, "run": str, "seeds": list, "accuracy": list,
                                    "wall_s": list, **PROVENANCE}},
}
OPTIONAL = {"note": str}


def _positive(x) -> bool:
    return isinstance(x, NUMBER) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def check_row(kind: str, row, where: str) -> None:
    if not isinstance(row, dict):
        raise ResultsError(f"{where}: a row must be an object, got {type(row).__name__}")
    fields = KINDS[kind]["fields"]
    for name, typ in fields.items():
        if name not in row:
            raise ResultsError(f"{where}: missing {name!r}")
        v = row[name]
        if typ is NUMBER:
            if not _positive(v):
                raise ResultsError(f"{where}: {name!r} must be a positive number, got {v!r}")
        elif typ is int:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ResultsError(f"{where}: {name!r} must be a positive integer, got {v!r}")
        elif not isinstance(v, typ) or (typ is str and not v.strip()):
            raise ResultsError(f"{where}: {name!r} must be a non-empty {typ.__name__}, got {v!r}")
    for name in row:
        if name not in fields and name not in OPTIONAL:
            raise ResultsError(f"{where}: unknown field {name!r}")
    if "note" in row and not isinstance(row["note"], str):
        raise ResultsError(f"{where}: 'note' must be a string")
    try:
        datetime.date.fromisoformat(row["measured"])
    except ValueError:
        raise ResultsError(f"{where}: 'measured' must be a date YYYY-MM-DD, got {row['measured']!r}") from None
    if kind == "time_to_accuracy":
        n = len(row["seeds"])
        if n == 0 or len(row["accuracy"]) != n or len(row["wall_s"]) != n:
            raise ResultsError(f"{where}: 'seeds', 'accuracy' and 'wall_s' must be lists of one length (one "
                               f"entry a run), got {n}, {len(row['accuracy'])} and {len(row['wall_s'])}")
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in row["seeds"]):
            raise ResultsError(f"{where}: 'seeds' must be integers")
        if not all(a is None or (_positive(a) and a <= 100) for a in row["accuracy"]):
            raise ResultsError(f"{where}: 'accuracy' must be percentages (or null for a failed run)")
        if not all(_positive(w) for w in row["wall_s"]):
            raise ResultsError(f"{where}: 'wall_s' must be positive numbers of seconds")


def validate(results, kind: str, name: str) -> dict:
    if not isinstance(results, dict):
        raise ResultsError(f"{name}: must be a JSON object, got {type(results).__name__}")
    if results.get("kind") != kind:
        raise ResultsError(f"{name}: 'kind' must be {kind!r}, got {results.get('kind')!r}")
    rows = results.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ResultsError(f"{name}: 'rows' must be a non-empty list")
    seen = set()
    for i, row in enumerate(rows):
        check_row(kind, row, f"{name}: row {i + 1}")
        key = tuple(row[k] for k in KINDS[kind]["key"])
        if key in seen:
            raise ResultsError(f"{name}: row {i + 1}: a second row for {key}")
        seen.add(key)
    return results


def load(path: Path, kind: str) -> dict:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ResultsError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        results = json.loads(text)
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    return validate(results, kind, str(path))


# ------------------------------------------------------------------ rendering

def _range(values) -> str:
    values = sorted(set(values))
    return values[0] if len(values) == 1 else f"{values[0]} to {values[-1]}"


def _joined(values) -> str:
    return ", ".join(dict.fromkeys(values))


def _caption(rows: list[dict]) -> str:
    return (f"Measured {_range(r['measured'] for r in rows)} on {_joined(r['gpu'] for r in rows)} "
            f"(cuDNN {_joined(r['cudnn'] for r in rows)}; commit {_joined(r['commit'] for r in rows)}).")


def _notes(rows: list[dict]) -> list[str]:
    out = [f"`{c}`" for c in dict.fromkeys(r["command"] for r in rows)]
    out = ["Command: " + "; ".join(out) + "."]
    out += [n for n in dict.fromkeys(r["note"] for r in rows if r.get("note"))]
    return out


def render_speed(results: dict) -> str:
    rows = sorted(results["rows"], key=lambda r: r["batch"])
    lines = [_caption(rows), "",
             "| batch | ours, us a step | M images/s | PyTorch's fastest float32 form | its us a step | ours vs PyTorch |",
             "| ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['ours_us']:.1f} | {r['batch'] / r['ours_us']:.3g} | {r['torch_form']} | "
                     f"{r['torch_us']:.1f} | {r['torch_us'] / r['ours_us']:.2f}x |")
    return "\n".join(lines + [""] + _notes(rows))


def _fmt_acc(a) -> str:
    return "failed" if a is None else f"{a:.2f}"


def render_time_to_accuracy(results: dict) -> str:
    rows = results["rows"]
    lines = [_caption(rows), "",
             "| recipe | trainer | run | test accuracy per run (%) | lowest | seconds per run, command start to exit "
             "| median | measured |",
             "| --- | --- | --- | --- | ---: | --- | ---: | --- |"]
    for r in rows:
        ok = [a for a in r["accuracy"] if a is not None]
        walls = sorted(r["wall_s"])
        mid = len(walls) // 2
        median = walls[mid] if len(walls) % 2 else (walls[mid - 1] + walls[mid]) / 2
        lines.append(f"| {r['recipe']} | {r['trainer']} | {r['run']} | "
                     f"{' / '.join(_fmt_acc(a) for a in r['accuracy'])} | {min(ok):.2f} | "
                     f"{' / '.join(f'{w:.2f}' for w in r['wall_s'])} | {median:.2f} | {r['measured']} |"
                     if ok else
                     f"| {r['recipe']} | {r['trainer']} | {r['run']} | {' / '.join(_fmt_acc(a) for a in r['accuracy'])}"
                     f" | - | {' / '.join(f'{w:.2f}' for w in r['wall_s'])} | {median:.2f} | {r['measured']} |")
    return "\n".join(lines + [""] + _notes(rows))


TABLES = {"speed": (SPEED, render_speed), "time_to_accuracy": (TIME_TO_ACCURACY, render_time_to_accuracy)}


def markers(name: str) -> tuple[str, str]:
    path = TABLES[name][0].relative_to(ROOT)
    return (f"<!-- {name} table: rendered by scripts/readme_tables.py from {path}; edit that file, not this -->",
            f"<!-- end of {name} table -->")


def rendered(name: str, path: Path | None = None) -> str:
    default, render = TABLES[name]
    return render(load(path or default, name))


def rewrite(text: str, name: str, table: str) -> str:
    begin, end = markers(name)
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ResultsError(f"README.md: the {name} table's markers must each appear once, in order: {begin} ... {end}")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{table}\n{end}{tail}"


def rendered_readme(text: str, paths: dict | None = None) -> str:
    for name in TABLES:
        text = rewrite(text, name, rendered(name, (paths or {}).get(name)))
    return text


# ------------------------------------------------------------------ recording (the benchmarks' --record)

def provenance(command: str) -> dict:
    """Today's date and the checkout's commit (a tree with changes says so), for a row being recorded. The
    results files are not changes: a second --record in one checkout finds the first's rows there."""
    def git(*a):
        p = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs/results"):
        commit += " with changes"
    return {"measured": datetime.date.today().isoformat(), "commit": commit, "command": command}


def record(path: Path, kind: str, rows: list[dict]) -> dict:
    """Write ``rows`` into the results file at ``path``, replacing the rows of the same key and keeping the
    others (a file not there yet is made). Every row is checked before anything is written."""
    path = Path(path)
    key = KINDS[kind]["key"]
    old = load(path, kind)["rows"] if path.exists() else []
    new = {tuple(r[k] for k in key): r for r in rows}
    merged = [r for r in old if tuple(r[k] for k in key) not in new] + list(new.values())
    results = validate({"kind": kind, "rows": merged}, kind, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare README.md's tables with the rendering; change nothing")
    ap.add_argument("--readme", type=Path, default=README)
    args = ap.parse_args(argv)
    try:
        text = args.readme.read_text()
        new = rendered_readme(text)
    except (ResultsError, OSError) as e:
        print(f"readme_tables.py: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        stale = [n for n in TABLES if rewrite(text, n, rendered(n)) != text]
        if stale:
            print(f"readme_tables.py: {args.readme}: the {' and '.join(stale)} table(s) differ from their results "
                  f"files: run python3 scripts/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        args.readme.write_text(new)
        print(f"rewrote the tables of {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
