"""The benchmarks run on the GPU (their CPU side: tests/test_bench_cpu.py): bench.py times PyTorch's forms
(eager, captured, compiled and captured, inductor's own graphs) beside ours, writes every time to its
results file and renders the tables from it; sweep_bench.py times both of PyTorch's ensembles and its plain
step; torch_train.py trains an epoch both ways. Briefly: these check that the programs run and record,
not their numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_gpu import dataset  # noqa: F401 - the synthetic dataset fixture

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def script(name, *args, timeout=900):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_bench_times_every_form_asked_for_and_records_them(torch_ref, tmp_path):
    out = tmp_path / "bench.json"
    forms = ["eager/nobench/foreach", "graph/bench/fused", "compile+graph/bench/fused", "reduce-overhead/bench/fused"]
    r = script("bench.py", "--batch", 64, "--repeats", 2, "--torch-forms", *forms, "--variants", "ours auto",
               "--json", out)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())["results"]
    at64 = got["64"]
    for key in forms:
        mode, bench, opt = key.split("/")
        row = at64[f"torch {mode} {bench} {opt}"]
        assert "us_per_step" in row and row["us_per_step"] > 0, (key, row)
    assert at64["ours auto"]["arithmetic"].startswith("float32")
    s = at64["summary"]
    assert s["fastest_torch_fp32"].startswith("torch ") and s["interleaved"]["speedup"] > 0 and s["tf32"]["speedup"] > 0
    assert got["epoch"]["torch_form"] == s["fastest_torch_fp32"] and got["epoch"]["torch_s"] > 0
    assert "vs the fastest PyTorch float32 form, TF32 off" in r.stdout and "with TF32 on both sides (apart)" in r.stdout
    table = script("bench.py", "--table", out, timeout=120)
    assert table.returncode == 0 and f"| 64 | {at64['ours auto']['us_per_step']:.1f} |" in table.stdout, table.stdout


def test_sweep_bench_times_both_ensembles_and_the_plain_step(torch_ref, dataset, tmp_path):  # noqa: F811
    out = tmp_path / "sweep.json"
    r = script("sweep_bench.py", "--models", 1, 2, "--data-dir", dataset, "--algo", "heuristic", "--json", out)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["models"] for row in rows] == [1, 2]
    assert set(rows[0]["torch"]) == {"plain", "func", "grouped"} and set(rows[1]["torch"]) == {"func", "grouped"}
    for row in rows:
        assert all("s_per_step" in v for v in row["torch"].values()), row["torch"]
        assert row["speedup"] > 0 and row["fastest_torch"] in row["torch"]


@pytest.mark.parametrize("graph", [False, True], ids=["loop", "cuda-graph"])
def test_the_pytorch_trainer_trains_an_epoch(torch_ref, dataset, graph):  # noqa: F811
    r = script("torch_train.py", "--data-dir", dataset, "--epochs", 2, "--batch-size", 128, "--lr", 0.05,
               *(["--cuda-graph"] if graph else []), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    final = [x for x in r.stdout.splitlines() if x.startswith("torch final")]
    assert final and float(final[0].split("test accuracy ")[1].split("%")[0]) > 20, r.stdout   # it learns: chance is 10%
