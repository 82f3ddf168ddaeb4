"""The programs' start-up threads (lenet/startup.py): each runs its whole sequence on a GPU, and
without one nothing fails before the program's own one-line error. Each case runs in a fresh
process: the threads start once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Starts the threads as python -m lenet.train does, lets them finish, prints what they marked.
_SEQUENCE = """
import json, sys
from lenet import startup
startup.start_gpu()
with startup.starting(sys.argv[1]):
    pass
print(json.dumps([label for label, _ in startup.MARKS]))
"""


def _run(code: str, *args: str, hide_gpu: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_warm_cudnn_without_a_gpu_says_false():
    out = _run("from descriptors import _lib\nfrom lenet.startup import warm_cudnn\n"
               "print(warm_cudnn(_lib.library_path()))", hide_gpu=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_threads_without_a_gpu_end_quietly():
    out = _run(_SEQUENCE, "auto", hide_gpu=True)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    marks = json.loads(out.stdout)
    assert "preload thread: CuPy, cuBLAS bindings imported" in marks
    assert not any("context" in m or "cuDNN" in m for m in marks), marks


@pytest.mark.gpu
def test_warm_cudnn_runs_its_query():
    out = _run("from descriptors import _lib\nfrom lenet.startup import start_context, warm_cudnn\n"
               "print(start_context(), warm_cudnn(_lib.library_path()))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.gpu
@pytest.mark.parametrize("engine,graph", [("auto", True), ("legacy", False)])
def test_threads_run_every_phase_on_a_gpu(engine, graph):
    out = _run(_SEQUENCE, engine)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    marks = json.loads(out.stdout)
    for m in ("driver thread: cuInit + primary context done", "driver thread: cuDNN's one-time set-up done",
              "preload thread: CUDA runtime started", "preload thread: descriptors, lenet.model imported"):
        assert m in marks, (m, marks)
    assert ("preload thread: first cuDNN graph built" in marks) == graph, marks
