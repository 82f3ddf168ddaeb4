"""lenet sweep on the GPU: a grid's outputs and its winner, a sweep stopped by a signal and resumed ending as an
uninterrupted one did, and two Optuna workers on one GPU sharing one storage file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_gpu import dataset  # noqa: F401 - the synthetic dataset fixture

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
# Two epochs of the synthetic set: no mirror (its templates are not symmetric), no warm-up, batch 64.
SMALL = ["--epochs", "2", "--train-size", "2000", "--quiet", "--algo", "heuristic", "--deterministic", "--flip", "off",
         "--warmup-epochs", "0", "--batch-size", "64", "--no-tta"]


def sweep(*args, timeout=300, background=False):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "lenet", "sweep", *map(str, args)]
    if background:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]


def test_grid_writes_every_model_and_the_winner(dataset, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    r = sweep("--data-dir", dataset, "--lr", 0.05, 0.1, "--seeds", "0-1", "--validation", 500, *SMALL, "--out", out)
    assert r.returncode == 0, r.stderr
    got = rows(out)
    assert len(got) == 4 and {(g["config"]["lr"], g["config"]["seed"]) for g in got} == \
        {(a, s) for a in (0.05, 0.1) for s in (0, 1)}
    assert all(len(g["accuracy"]) == 2 and g["split"] == "validation" for g in got)
    assert max(g["final"] for g in got) > 0.5
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best"]["final"] == max(g["final"] for g in got) and 0.5 < summary["test_accuracy"] <= 1.0
    assert "the winner on the test split (seen now, once, by it alone)" in r.stdout
    assert (out / "curves.png").stat().st_size > 1000 and (out / "results.csv").read_text().count("\n") == 5
    from lenet import checkpoint as ckpt

    params, _, meta = ckpt.load(out / "best" / "checkpoint.npz")
    assert meta["config"]["lr"] == summary["best"]["config"]["lr"]
    assert any((out / "best" / n).exists() for n in ("model.safetensors", "model.npz"))
    # the winner's checkpoint is one `lenet predict` reads (on the CPU: no GPU needed for it)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "lenet", "predict", "--checkpoint", str(out / "best" / "checkpoint.npz"),
                        str(dataset / "t10k-images-idx3-ubyte.gz"), "--labels", str(dataset / "t10k-labels-idx1-ubyte"),
                        "--device", "cpu", "--show", "0"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    import re

    cpu = float(re.search(r"accuracy ([\d.]+)%", p.stdout).group(1))
    assert abs(cpu - 100 * summary["test_accuracy"]) <= 0.2, p.stdout   # the same weights (a near tie may flip)


def test_a_deterministic_sweep_trains_each_model_as_lenet_train_does(dataset, tmp_path):  # noqa: F811
    """Note [a pack and a lone run] in lenet/pack.py: with --deterministic each model of a sweep is its lone
    `lenet train` run, bit for bit, through the whole program (the gather, the schedule, a last partial
    batch, evaluation): the same test loss and accuracy after every epoch, and the winner's checkpoint
    holds the lone run's weights."""
    import numpy as np

    from lenet import checkpoint as ckpt
    from lenet.pack import config_from

    out = tmp_path / "sweep"
    small = [a for a in SMALL if a not in ("--flip", "off")] + ["--flip", "on"]   # 2000 = 31 x 64 + 16
    r = sweep("--data-dir", dataset, "--seeds", "0-2", "--lr", 0.07, *small, "--rank-on-test", "--out", out)
    assert r.returncode == 0, r.stderr
    got = {g["config"]["seed"]: g for g in rows(out)}
    winner = json.loads((out / "summary.json").read_text())["best"]["config"]["seed"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for seed, g in sorted(got.items()):
        lone = tmp_path / f"lone{seed}"
        flags = " ".join(config_from(g["config"]).train_flags()).split()
        p = subprocess.run([sys.executable, "-m", "lenet", "train", "--data-dir", str(dataset), "--train-size", "2000",
                            "--quiet", "--algo", "heuristic", "--deterministic", *flags, "--out", str(lone)],
                           env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        params, _, meta = ckpt.load(lone / "checkpoint.npz")
        history = [(h["test_accuracy"], h["test_loss"]) for h in meta["history"]]
        assert history == list(zip(g["accuracy"], g["loss"])), (seed, history, g["accuracy"], g["loss"])
        if seed == winner:
            best, _, _ = ckpt.load(out / "best" / "checkpoint.npz")
            assert np.array_equal(np.asarray(best), np.asarray(params)), f"seed {seed}: the winner's weights differ"


def test_by_default_a_sweep_ranks_on_held_out_images_and_reads_the_test_split_once_by_the_winner(
        dataset, tmp_path, monkeypatch):  # noqa: F811
    """Note [the ranked split] in lenet/sweep.py on a real sweep: no --validation, yet every row is ranked on
    held-out training images, the test split is read once (Sweep.evaluate_on_test, counted), by the winner's
    weights, and its number is what the winner's own weights score there."""
    import numpy as np

    from lenet import checkpoint as ckpt
    from lenet import sweep as program
    from lenet.sweep_results import Sweep

    seen, original = [], Sweep.evaluate_on_test

    def counted(self, weights, policy):
        seen.append(np.array(weights, copy=True))
        return original(self, weights, policy)
    monkeypatch.setattr(Sweep, "evaluate_on_test", counted)
    out = tmp_path / "out"
    assert program.main(["--data-dir", str(dataset), "--lr", "0.05", "0.1", "--seeds", "0-1", *SMALL,
                         "--out", str(out)]) == 0
    got = rows(out)
    assert len(got) == 4 and all(g["split"] == "validation" for g in got)
    settings = json.loads((out / "sweep.json").read_text())
    assert settings["validation"] == 2000 // program.VALIDATION_SHARE and settings["train_size"] == 2000 - 333
    summary = json.loads((out / "summary.json").read_text())
    assert summary["split"] == "validation" and summary["best"]["final"] == max(g["final"] for g in got)
    assert len(seen) == 1, f"the test split was read {len(seen)} times"
    params, _, meta = ckpt.load(out / "best" / "checkpoint.npz")
    assert meta["sweep_row"] == summary["best"]["trial"]
    assert np.array_equal(seen[0], ckpt.weights(params, meta)[0])   # the winner's weights, and only them
    assert 0.5 < summary["test_accuracy"] <= 1.0
    # --test-every-model: each model once, apart; the ranking and the winner the same
    seen.clear()
    every = tmp_path / "every"
    assert program.main(["--data-dir", str(dataset), "--lr", "0.05", "0.1", "--seeds", "0-1", *SMALL,
                         "--test-every-model", "--out", str(every)]) == 0
    assert len(seen) == 4 and all("test_accuracy" in g for g in rows(every))
    again = json.loads((every / "summary.json").read_text())
    assert again["best"]["config"] == summary["best"]["config"]   # --deterministic: the same sweep, ranked alike
    assert abs(again["test_accuracy"] - summary["test_accuracy"]) <= 0.002   # the same weights (a near tie may flip)


def test_a_sweep_stopped_by_a_signal_resumes_to_what_an_uninterrupted_one_gives(dataset, tmp_path, monkeypatch):  # noqa: F811
    from lenet import sweep as program
    from lenet.pack import Pack

    flags = ["--data-dir", str(dataset), "--lr", "0.05", "0.1", "--seeds", "0-1", *SMALL, "--epochs", "3"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert program.main([*flags, "--out", str(whole)]) == 0
    original, calls = Pack.steps_of, {"n": 0}

    def interrupted(self, orders, first=0, stop=None):
        calls["n"] += 1
        if calls["n"] != 2:
            return original(self, orders, first, stop)
        seen = {"steps": 0}

        def stop_after_five():   # SIGINT in the second epoch, five steps in
            seen["steps"] += 1
            if seen["steps"] == 5:
                os.kill(os.getpid(), signal.SIGINT)
            return stop()
        return original(self, orders, first, stop_after_five)
    monkeypatch.setattr(Pack, "steps_of", interrupted)
    assert program.main([*flags, "--out", str(parts)]) == 130
    assert (parts / "pack.npz").exists()
    monkeypatch.setattr(Pack, "steps_of", original)
    assert program.main([*flags, "--out", str(parts), "--resume"]) == 0
    assert not (parts / "pack.npz").exists()

    def by_config(out):
        return {json.dumps(r["config"], sort_keys=True): (r["accuracy"], r["loss"], r["train_loss"]) for r in rows(out)}
    assert by_config(parts) == by_config(whole)   # bit-identical under --deterministic


def test_two_workers_on_one_gpu_share_one_study(dataset, tmp_path):  # noqa: F811
    pytest.importorskip("optuna", reason="the optional extra .[sweep]")
    import optuna

    flags = ["--data-dir", dataset, "--search", "optuna", "--sampler", "grid", "--no-prune", "--trials", 8,
             "--lr", 0.05, 0.1, "--label-smoothing", 0, 0.1, "--seeds", "0-1", "--pack-size", 2, "--validation", 500,
             *SMALL]
    both = tmp_path / "both.log"
    workers = [sweep(*flags, "--storage", both, "--out", tmp_path / f"w{i}", background=True) for i in range(2)]
    for w in workers:
        _, err = w.communicate(timeout=400)
        assert w.returncode == 0, err
    alone = sweep(*flags, "--storage", tmp_path / "alone.log", "--out", tmp_path / "alone")
    assert alone.returncode == 0, alone.stderr

    def study(path):
        from optuna.storages.journal import JournalFileBackend

        return optuna.load_study(study_name="lenet-sweep",
                                 storage=optuna.storages.JournalStorage(JournalFileBackend(str(path))))
    shared = study(both)
    complete = [t for t in shared.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    assert sorted(t.number for t in complete) == list(range(8))   # the study complete
    ran = [r["trial"] for i in range(2) for r in rows(tmp_path / f"w{i}")]
    assert sorted(ran) == list(range(8))                           # each trial run once, by one worker
    assert all(rows(tmp_path / f"w{i}") for i in range(2))         # both workers trained
    configs = [json.dumps(r["config"], sort_keys=True) for i in range(2) for r in rows(tmp_path / f"w{i}")]
    assert len(set(configs)) == 8                                  # the grid, no configuration twice
    one = study(tmp_path / "alone.log")
    assert shared.best_trial.params == one.best_trial.params and shared.best_value == one.best_value
