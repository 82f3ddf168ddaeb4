"""scripts/gpu_check.sh's `spread` part, on a machine without a GPU: its queue holds every GPU test file once,
and a run over two stand-in GPUs runs each part once, in its own copy of the checkout, and adds the parts'
counts into its one line (every part fails here, so the whole fails)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
PARTS = {"tests-parity", "tests-model", "tests-stages", "tests-torch", "tests-train", "programs", "racecheck",
         "synccheck", "initcheck", "packs-racecheck", "packs-synccheck", "packs-initcheck"}


def _queue() -> dict[str, str]:
    text = SCRIPT.read_text()
    block = text[text.index("printf '%s\\n' \"tests-parity"):text.index('> "$queue"')]
    return dict(line.split("|", 1) for line in re.findall(r'"([^"]*\|[^"]*)"', block))


def test_the_spread_queue_holds_every_gpu_test_file_and_every_part():
    queue = _queue()
    assert set(queue) == PARTS, sorted(queue)
    named = re.findall(r"tests/(test_\w+\.py)", " ".join(queue.values()))
    marked = sorted(p.name for p in (ROOT / "tests").glob("test_*.py")
                    if p.name != Path(__file__).name and "pytest.mark.gpu" in p.read_text())
    assert len(marked) >= 14 and all(f in named for f in marked), sorted(set(marked) - set(named))


def test_spread_runs_each_part_once_and_adds_their_counts(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: stand-in"\necho "GPU 1: stand-in"\n')
    (fake / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "GPU_CHECK_WHEELS_IN": "1"}
    out = subprocess.run(["bash", str(SCRIPT), "spread"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    lines = out.stdout.strip().splitlines() or [out.stderr]
    parts = [line.split(":", 1)[0] for line in lines if re.match(r"^[a-z-]+: gpu-check", line)]
    assert sorted(parts) == sorted(PARTS), (lines, out.stderr[-2000:])
    whole = lines[-1]
    assert out.returncode == 1 and whole.startswith("gpu-check (spread): FAIL"), whole
    sums = [0, 0, 0, 0]
    for line in lines[:-1]:
        m = re.search(r"(\d+) passed, (\d+) failed, (\d+) skipped, (\d+) errors", line)
        if m:
            sums = [a + int(b) for a, b in zip(sums, m.groups())]
    assert f"{sums[0]} passed, {sums[1]} failed, {sums[2]} skipped, {sums[3]} errors" in whole, whole
    assert sum(sums) > 200, sums   # every GPU test was collected by some part (and none ran: no GPU here)
    assert not list((tmp_path / "out").glob("*/.git")), "a copy of the checkout was left in the logs"
    # each worker on its share of the CPUs (two workers: half each), where NumPy's and PyTorch's threads count
    cpus = len(os.sched_getaffinity(0))
    shares = {p.parent.name: int(p.read_text()) for p in (tmp_path / "out").glob("*/cpus.txt")}
    assert sorted(shares) == sorted(PARTS), sorted(shares)
    assert set(shares.values()) == {cpus // 2 if cpus >= 2 else cpus}, (cpus, shares)
    part_lines = [line for line in lines if re.match(r"^[a-z-]+: gpu-check", line)]
    assert part_lines and all(re.search(r" \| \d+ s$", line) for line in part_lines), lines   # each one's wall clock


def test_a_part_it_does_not_have_is_one_line_and_runs_nothing(tmp_path):
    """A misspelt part (`test` for `tests`) would run no check and pass: it is refused, before anything."""
    out = subprocess.run(["bash", str(SCRIPT), "test"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout.count("\n") == 1 and "no part test: all, tests," in out.stdout, out
    assert not list(tmp_path.iterdir())


def _stand_ins(tmp_path, **env):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: stand-in"\necho "GPU 1: stand-in"\n')
    (fake / "nvidia-smi").chmod(0o755)
    return {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
            "GPU_CHECK_WHEELS_IN": "1", **env}


def test_spread_runs_only_the_parts_named_and_says_it_is_not_the_whole_check(tmp_path):
    """...and counts only those: an earlier run's folder in the logs (a passing part) is not in its line."""
    env = _stand_ins(tmp_path, GPU_CHECK_PARTS="tests-stages tests-torch")
    old = tmp_path / "out" / "tests-model"
    old.mkdir(parents=True)
    (old / "summary.txt").write_text("gpu-check (tests): PASS | 76 passed, 0 failed, 0 skipped, 0 errors | GPU old\n")
    out = subprocess.run(["bash", str(SCRIPT), "spread"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    lines = out.stdout.strip().splitlines() or [out.stderr]
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()) == ["tests-model", "tests-stages",
                                                                                   "tests-torch"], lines
    assert "only the parts tests-stages, tests-torch (not the whole check)" in lines[-1], lines[-1]
    assert not any(line.startswith("tests-model") for line in lines) and "76 passed" not in lines[-1], lines


def test_spread_refuses_a_part_its_queue_does_not_have_in_one_line(tmp_path):
    env = _stand_ins(tmp_path, GPU_CHECK_PARTS="tests-stages tests-stage")
    out = subprocess.run(["bash", str(SCRIPT), "spread"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    last = out.stdout.strip().splitlines()[-1]   # after the GPUs' listing every part starts with
    assert out.returncode == 2 and last.startswith("gpu-check (spread): no part tests-stage in the queue: tests-parity "), out
    assert not (tmp_path / "out").exists() or not any(p.is_dir() for p in (tmp_path / "out").iterdir())


def test_spread_runs_several_workers_a_gpu_each_part_once(tmp_path):
    """GPU_CHECK_SLOTS=2 on two stand-in GPUs: four workers share the queue, worker w on GPU w mod 2, each part
    once; the parts run side by side on each GPU (the stand-in nvidia-smi, which every part runs first, logs its
    GPU and its span). A value that is not a whole number >= 1 is refused in one line, before any part runs."""
    env = _stand_ins(tmp_path, GPU_CHECK_PARTS="tests-stages tests-torch tests-train programs", GPU_CHECK_GPUS="2",
                     GPU_CHECK_SLOTS="2")
    log = tmp_path / "spans"
    # each part held 5 s at its start: a loaded machine started a GPU's two parts 2.1 s apart
    (tmp_path / "bin" / "nvidia-smi").write_text(
        '#!/bin/sh\nif [ -n "$CUDA_VISIBLE_DEVICES" ]; then s=$(date +%s.%N); sleep 5; '
        f'echo "$CUDA_VISIBLE_DEVICES $s $(date +%s.%N)" >> {log}; fi\n'
        'echo "GPU 0: stand-in"\necho "GPU 1: stand-in"\n')
    out = subprocess.run(["bash", str(SCRIPT), "spread"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    lines = out.stdout.strip().splitlines() or [out.stderr]
    parts = [line.split(":", 1)[0] for line in lines if re.match(r"^[a-z-]+: gpu-check", line)]
    assert sorted(parts) == ["programs", "tests-stages", "tests-torch", "tests-train"], (lines, out.stderr[-2000:])
    assert "only the parts programs, tests-stages, tests-torch, tests-train (not" in lines[-1], lines[-1]
    spans = [line.split() for line in log.read_text().splitlines()]
    by_gpu = {g: sorted((float(a), float(b)) for gg, a, b in spans if gg == g) for g in ("0", "1")}
    assert sorted(by_gpu) == ["0", "1"] and all(by_gpu.values()), spans
    assert all(len(s) >= 2 and s[1][0] < s[0][1] for s in by_gpu.values()), f"no two parts at once on a GPU: {spans}"
    for bad in ("0", "two", "-1", "08", "1.5"):
        (tmp_path / bad).mkdir()
        env = _stand_ins(tmp_path / bad, GPU_CHECK_SLOTS=bad)
        out = subprocess.run(["bash", str(SCRIPT), "spread"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=60)
        last = out.stdout.strip().splitlines()[-1]
        assert out.returncode == 2 and f"GPU_CHECK_SLOTS must be a whole number >= 1, not '{bad}'" in last, out
        assert not any(p.is_dir() for p in (tmp_path / bad / "out").iterdir()), bad   # the GPUs' listing only
        (tmp_path / f"gpus-{bad}").mkdir()
        env = _stand_ins(tmp_path / f"gpus-{bad}", GPU_CHECK_GPUS=bad)
        out = subprocess.run(["bash", str(SCRIPT), "spread"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=60)
        last = out.stdout.strip().splitlines()[-1]
        assert out.returncode == 2 and f"GPU_CHECK_GPUS must be a whole number >= 1, not '{bad}'" in last, out


def _summarize(tmp_path, parts: dict[str, str]):
    for name, line in parts.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.txt").write_text(line + "\n")
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_summary.py"), str(tmp_path), " ".join(parts)],
                          capture_output=True, text=True, timeout=60)


SAN = "gpu-check ({0}): PASS | GPU tests not run in this part | programs ok (not run) | {0} clean | GPU H | cuDNN 9"
TESTS = "gpu-check (tests): {0} | {1} passed, {2} failed, 0 skipped, 0 errors | sanitizers not run | GPU H | cuDNN 9"


def test_the_spread_line_passes_sanitizer_parts_alone_and_never_test_parts_that_ran_no_test(tmp_path):
    """The whole's line: the sanitizer parts alone (GPU_CHECK_PARTS) pass with no test to count, its GPU named
    once (a part's "GPU tests not run" is not the GPU); a test part that ran no test, or a failed part, fails."""
    (tmp_path / "a").mkdir()
    out = _summarize(tmp_path / "a", {"racecheck": SAN.format("racecheck"), "packs-racecheck": SAN.format("packs")})
    whole = out.stdout.strip().splitlines()[-1]
    assert out.returncode == 0 and whole.startswith("gpu-check (spread): PASS | 0 passed"), whole
    assert whole.endswith("all clean | GPU H | cuDNN 9") and whole.count("GPU") == 1, whole
    (tmp_path / "b").mkdir()
    out = _summarize(tmp_path / "b", {"racecheck": SAN.format("racecheck"), "tests-model": TESTS.format("PASS", 0, 0)})
    assert out.returncode == 1 and out.stdout.strip().splitlines()[-1].startswith("gpu-check (spread): FAIL"), out.stdout
    (tmp_path / "c").mkdir()
    out = _summarize(tmp_path / "c", {"tests-model": TESTS.format("PASS", 70, 0), "tests-torch": TESTS.format("FAIL", 5, 1)})
    assert out.returncode == 1 and "75 passed, 1 failed" in out.stdout and "see the parts" in out.stdout, out.stdout
    (tmp_path / "d").mkdir()
    out = _summarize(tmp_path / "d", {"tests-model": TESTS.format("PASS", 70, 0), "synccheck": SAN.format("synccheck")})
    assert out.returncode == 0 and "gpu-check (spread): PASS | 70 passed" in out.stdout, out.stdout
