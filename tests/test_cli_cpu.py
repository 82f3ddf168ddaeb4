"""The programs' flags and messages, without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args, hide_gpu=False):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def test_train_step_help_lists_every_flag():
    out = run("lenet.train_step", "--help")
    assert out.returncode == 0
    for flag in ("--batch-size", "--lr", "--steps", "--seed", "--algo", "--workspace-limit", "--deterministic",
                 "--json", "--dump", "--cuda-graph", "--data-dir", "--synthetic", "--warmup"):
        assert flag in out.stdout, flag
    assert "fwd=NAME,bwd-data=NAME,bwd-filter=NAME" in out.stdout


@pytest.mark.parametrize("args,msg", [
    (["--algo", "quantum"], "unknown algorithm 'quantum'"),
    (["--algo", "fwd=algo_0"], "unknown fwd algorithm 'algo_0'"),
    (["--batch-size", "0"], "--batch-size: invalid value '0'"),
    (["--batch-size", "many"], "--batch-size: invalid value 'many'"),
    (["--lr", "-1"], "--lr: invalid value '-1'"),
    (["--lr", "nan"], "--lr: invalid value 'nan'"),
    (["--steps", "0"], "--steps: invalid value '0'"),
    (["--workspace-limit", "lots"], "invalid size 'lots'"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--batchsize", "64"], "unrecognized arguments: --batchsize 64 (did you mean --batch-size?)"),
    (["--step", "3", "--synthtic"], "unrecognized arguments: --synthtic (did you mean --synthetic?)"),
    (["--engine", "ours", "--no-fused"], "--engine ours runs our fused stage kernels only"),
    (["--engine", "ours", "--chunk", "16"], "--chunk applies to cuDNN's engines only"),
    (["--engine", "ours", "--algo", "fft"], "engine ours runs no cuDNN convolution"),
    (["--engine", "cuda"], "argument --engine: invalid choice: 'cuda'"),
])
def test_bad_flags_exit_2_with_one_line(args, msg):
    out = run("lenet.train_step", *args)
    assert out.returncode == 2, out
    assert out.stderr.count("\n") == 1 and msg in out.stderr, out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize("module,args,words", [
    ("lenet.predict", ["--chekpoint", "x.npz", "img.png"], "none of this program's flags (did you mean --checkpoint?); "
                                                             "an input whose name starts with '-' is given as ./--chekpoint"),
    ("lenet.predict", ["--zz", "img.png"], "unrecognized argument '--zz': none of this program's flags; an input"),
    ("lenet", ["sweep", "--seed", "0-1"], "unrecognized arguments: --seed 0-1 (did you mean --seeds?)"),
])
def test_an_unknown_flag_names_the_nearest_of_ours(module, args, words):
    out = run(module, *args)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and words in out.stderr, out.stderr


def test_no_gpu_is_one_plain_sentence():
    out = run("lenet.train_step", "--synthetic", hide_gpu=True)
    assert out.returncode == 2
    assert out.stderr.startswith("python -m lenet.train_step: error: no usable NVIDIA GPU: ") \
        and out.stderr.count("\n") == 1, out.stderr
    assert "Traceback" not in out.stderr


def test_byte_sizes():
    from lenet.cli import byte_size
    assert byte_size("0") == 0 and byte_size("64M") == 64 << 20 and byte_size("1.5G") == 3 << 29
    assert byte_size("512k") == 512 << 10 and byte_size("8MiB") == 8 << 20


def test_the_lenet_command_runs_each_program_and_names_it_as_run():
    # `lenet train ...` as git and pip run their subcommands; usage lines and errors say the command
    # as it was typed; every program and the command itself answer --version.
    from lenet import __version__
    out = run("lenet", "train-step", "--batch-size", "0")
    assert out.returncode == 2 and out.stderr.startswith("lenet train-step: error: argument --batch-size"), out.stderr
    out = run("lenet", "export", "ck.npz", "--to", "m.txt")
    assert out.returncode == 2 and out.stderr.startswith("lenet export: error: --to must end in"), out.stderr
    for args in (["lenet", "--version"], ["lenet", "train", "--version"], ["lenet.predict", "--version"],
                 ["lenet.train_step", "--version"]):
        out = run(*args)
        assert out.returncode == 0 and f"lenet-cudnn {__version__}" in out.stdout, (args, out)
    out = run("lenet", "frob")
    assert out.returncode == 2 and out.stderr.startswith("lenet: error: unknown program 'frob'"), out.stderr
