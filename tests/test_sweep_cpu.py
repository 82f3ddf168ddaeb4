"""lenet sweep without a GPU: the grid and its packs, the configurations, every bad input refused in one line
before the GPU with nothing written, the study's storage and its trial bookkeeping (Note [trial budget] in
lenet/study.py), and the resume checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lenet import sweep
from lenet.pack import Config, config_from, packs
from lenet.schedule import SCHEDULES, Schedule

ROOT = Path(__file__).resolve().parents[1]


def parse(*argv):
    return sweep.parser().parse_args([str(a) for a in argv])


def run(*args, env=None, cwd=None):
    e = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    return subprocess.run([sys.executable, "-m", "lenet", "sweep", *map(str, args)], env=e, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def one_line(out) -> str:
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr
    return lines[0]


# ------------------------------------------------------------------ the grid

def test_grid_is_every_combination_seeds_innermost():
    args = parse("--lr", 0.05, 0.1, 0.2, 0.4, "--label-smoothing", 0, 0.1, "--weight-decay", 0, 5e-4,
                 "--seeds", "0-3")
    configs = sweep.grid(args)
    assert len(configs) == 64 and len(set(configs)) == 64
    assert [c.seed for c in configs[:5]] == [0, 1, 2, 3, 0]
    assert {c.lr for c in configs} == {0.05, 0.1, 0.2, 0.4}
    # the defaults are the fast recipe
    assert all((c.epochs, c.batch_size, c.schedule, c.nesterov, c.flip) == (16, 128, "cosine", True, True)
               for c in configs)


def test_seed_specs_and_repeated_values():
    assert sweep.seeds("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    args = parse("--lr", 0.1, 0.1, "--seeds", "0-1", "1-2")
    assert [c.seed for c in sweep.grid(args)] == [0, 1, 2]   # each configuration once


def test_nesterov_without_momentum_is_left_out_of_the_grid():
    args = parse("--momentum", 0, 0.9, "--nesterov", "on", "off")
    assert {(c.momentum, c.nesterov) for c in sweep.grid(args)} == {(0.0, False), (0.9, True), (0.9, False)}


def test_packs_group_by_batch_and_epochs_and_cut_at_the_pack_size():
    configs = [Config(seed=s, batch_size=b, epochs=e) for b in (64, 128) for e in (2, 4) for s in range(5)]
    got = packs(configs, 3)
    assert [len(p) for p in got] == [3, 2] * 4
    for p in got:
        assert len({(c.batch_size, c.epochs) for c in p}) == 1
    assert [len(p) for p in packs(configs)] == [5] * 4
    with pytest.raises(ValueError):
        packs(configs, 0)


def test_config_refuses_what_cannot_train_in_one_line():
    for kw, words in (({"lr": float("nan")}, "lr"), ({"lr": -0.1}, "lr"), ({"momentum": 1.0}, "momentum"),
                      ({"nesterov": True, "momentum": 0.0}, "nesterov"), ({"ema": 1.0}, "ema"),
                      ({"schedule": "linear"}, "schedule"), ({"shift": 14}, "shift"), ({"seed": -1}, "seed"),
                      ({"warmup_epochs": 20, "epochs": 16}, "warmup")):
        with pytest.raises(ValueError, match=words):
            Config(**kw)
    c = Config(lr=0.2, seed=7, ema=0.999)
    assert config_from(c.as_dict()) == c
    with pytest.raises(ValueError, match="unknown settings"):
        config_from({**c.as_dict(), "dropout": 0.5})


def test_algo_defaults_to_exhaustive_and_to_the_rule_under_deterministic():
    """A sweep searches a pack's plan once (exhaustive); with --deterministic timing decides nothing
    (heuristic), so each model is its lone `lenet train --deterministic` run; a given --algo stays."""
    from lenet import sweep

    assert sweep.parser().parse_args([]).algo == "exhaustive"
    assert sweep.parser().parse_args(["--deterministic"]).algo == "heuristic"
    assert sweep.parser().parse_args(["--deterministic", "--algo", "exhaustive"]).algo == "exhaustive"
    assert "with --deterministic, heuristic" in " ".join(sweep.parser().format_help().split())


def test_small_packs_take_the_heuristic_so_each_model_chooses_as_its_lone_run(monkeypatch):
    """--algo's default once the GPU is known (sweep.default_algo): the heuristic where every pack sums as its
    lone runs (at most 4 images per SM: Note [a pack and a lone run] in lenet/pack.py), a search otherwise;
    a given --algo, and --deterministic, stay."""
    from lenet import kernels
    from lenet.cli import policy_from

    monkeypatch.setattr(kernels, "sm_count", lambda: 132)

    def algo(*argv):
        args = parse(*argv)
        run = {"configs": sweep.grid(args)}
        return sweep.default_algo(args, run, policy_from(args)).choice("fwd")

    assert algo("--seeds", "0-2") == algo("--seeds", "0-3") == "heuristic"                    # 3 or 4 of 128
    assert algo("--seeds", "0-4") == algo("--seeds", "0-15") == "exhaustive"                  # 640, 2048 images
    assert algo("--seeds", "0-7", "--batch-size", "64") == "heuristic"                       # 8 of 64
    assert algo("--seeds", "0-15", "--pack-size", "4") == "heuristic"                         # packs of 4
    assert algo("--seeds", "0-2", "--algo", "exhaustive") == "exhaustive"                     # given: kept
    assert algo("--seeds", "0-15", "--deterministic") == "heuristic"
    assert "every pack holds at most 4 images per SM, heuristic" in " ".join(sweep.parser().format_help().split())


def test_train_flags_name_the_lone_run():
    flags = " ".join(Config(lr=0.2, seed=3, ema=0.999, shift=2).train_flags(tta=True))
    for part in ("--lr 0.2", "--seed 3", "--ema 0.999", "--shift 2", "--nesterov", "--label-smoothing 0.05",
                 "--warmup-epochs 1", "--flip", "--tta", "--schedule cosine", "--epochs 16", "--batch-size 128"):
        assert part in flags
    assert "--ema" not in " ".join(Config().train_flags())
    # an Optuna trial's value reads back as itself, not rounded to six digits
    flags = Config(lr=0.0712345678901, weight_decay=3.3e-4).train_flags()
    assert "--lr 0.0712345678901" in flags and "--weight-decay 0.00033" in flags


@pytest.mark.parametrize("kind", SCHEDULES)
def test_schedule_table_is_the_schedule_step_by_step(kind):
    s = Schedule(kind, 0.1, warmup=300)
    table = s.table(469, 469 * 16).astype(np.float32)
    ref = np.array([s.at(i, 469, 469 * 16) for i in range(469 * 16)], np.float32)
    assert np.array_equal(table, ref)


# ------------------------------------------------------------------ bad input: one line, before the GPU, nothing written

@pytest.mark.parametrize("flags,words", [
    (["--seeds", "5-2"], "seed range '5-2'"),
    (["--lr", "0.1", "nan"], "invalid value 'nan'"),
    (["--lr", "-0.1"], "invalid value '-0.1'"),
    (["--trials", "0", "--search", "optuna"], "invalid value '0'"),
    (["--momentum", "0", "--nesterov", "on"], "the grid is empty"),
    (["--lr"], "expected at least one argument"),
    (["--trials", "8"], "--trials is for --search optuna"),
    (["--search", "optuna"], "needs --trials"),
    (["--lr", "0.01:0.5"], "ranges are for --search optuna"),
    (["--no-fused"], "a pack of 2 models"),
    (["--schedule", "linear"], "use one of"),
    (["--search", "optuna", "--trials", "4", "--storage", "/no/such/folder/study.log", "--lr", "0.1", "0.2"],
     "does not exist"),
    (["--search", "optuna", "--trials", "4", "--storage", "sqlite:////no/such/folder/study.db", "--lr", "0.1", "0.2"],
     "does not exist"),
    (["--search", "optuna", "--trials", "4"], "nothing to choose"),
    (["--search", "optuna", "--trials", "4", "--lr", "0.1", "0.2", "--epochs", "2", "4"], "one value"),
])
def test_bad_input_is_one_line_before_the_gpu_and_writes_nothing(flags, words, dataset, tmp_path):
    out = tmp_path / "out"
    r = run("--data-dir", dataset, "--out", out, *flags)
    assert r.returncode == 2
    line = one_line(r)
    assert line.startswith("lenet sweep: error:") and words in line, line
    assert not out.exists()


def test_optuna_missing_names_the_command_that_installs_it(dataset, tmp_path):
    fake = tmp_path / "site"
    (fake / "optuna").mkdir(parents=True)
    (fake / "optuna" / "__init__.py").write_text("raise ImportError('No module named optuna')\n")
    r = run("--data-dir", dataset, "--search", "optuna", "--trials", "4", "--lr", "0.1", "0.2",
            env={"PYTHONPATH": f"{fake}{os.pathsep}{ROOT}"})
    assert r.returncode == 2 and "pip install '.[sweep]'" in one_line(r)


def test_validation_larger_than_the_split_is_refused(dataset, tmp_path):
    r = run("--data-dir", dataset, "--validation", 40, "--out", tmp_path / "out")
    assert r.returncode == 2 and "leaves no training image" in one_line(r)
    assert not (tmp_path / "out").exists()


def test_an_earlier_sweep_is_kept_unless_resumed_or_overwritten(dataset, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text("")
    r = run("--data-dir", dataset, "--out", out)
    assert r.returncode == 2 and "holds an earlier sweep" in one_line(r)
    r = run("--data-dir", dataset, "--out", out, "--resume")
    assert r.returncode == 2 and "holds no sweep" in one_line(r)
    args = parse("--data-dir", dataset, "--out", out, "--lr", 0.1, 0.2)
    settings = sweep.settings_of(args, "abc", 40, 20)
    (out / "sweep.json").write_text(json.dumps(settings))
    r = run("--data-dir", dataset, "--out", out, "--resume", "--lr", 0.1, 0.3)
    assert r.returncode == 2 and "was made with grid=" in one_line(r)
    assert sorted(p.name for p in out.iterdir()) == ["results.jsonl", "sweep.json"]


def test_a_broken_pack_state_is_one_line_on_resume(dataset, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    args = parse("--data-dir", dataset, "--out", out)
    from lenet import cli, data   # sweep.json as prepare() writes it, so that only pack.npz is wrong

    root, (tx, _), (vx, _), cache, _ = cli.run_splits(args)
    (out / "sweep.json").write_text(json.dumps(sweep.settings_of(args, data.fingerprint(root, cache), len(tx), len(vx))))
    (out / "pack.npz").write_bytes(b"not an npz")
    before = sorted(p.name for p in out.iterdir())
    r = run("--data-dir", dataset, "--out", out, "--resume")
    assert r.returncode == 2 and "is not the state of a pack in flight" in one_line(r), r.stderr
    assert sorted(p.name for p in out.iterdir()) == before


def test_more_models_than_fit_names_how_many_fit():
    from lenet.engines import Policy
    from lenet.model import bytes_per_image, check_memory, models_that_fit

    per = 128 * bytes_per_image(Policy(), 2)
    free = 10 << 30
    fit = models_that_fit(128, free)
    assert fit * per <= 0.9 * free - (256 << 20) < (fit + 1) * per
    check_memory(128, free, 80 << 30, Policy(), fit)
    with pytest.raises(ValueError, match=f"{fit} such models fit"):
        check_memory(128, free, 80 << 30, Policy(), fit + 1)


# ------------------------------------------------------------------ the study's storage and bookkeeping

optuna = pytest.importorskip("optuna", reason="the optional extra .[sweep]")


def _args(tmp_path, *extra):
    return parse("--search", "optuna", "--trials", 5, "--lr", "0.01:0.5", "--seeds", "0-3",
                 "--storage", tmp_path / "study.log", *extra)


def test_two_workers_share_one_journal_and_the_budget(tmp_path):
    from lenet import study

    args = _args(tmp_path)
    settings = sweep.settings_of(args, "abc", 50000, 10000)
    a, b = study.open_study(args, settings), study.open_study(args, settings)   # two workers, one file
    dists, _ = study.space(args)
    admitted = []
    for worker in [a, b, b, a, a, b, a, b]:
        t = worker.ask(dists)
        if study.admitted(worker, t, args.trials):
            admitted.append(t.number)
            worker.tell(t, 0.5 + 0.01 * t.number)
        else:
            worker.tell(t, state=optuna.trial.TrialState.FAIL)
    assert admitted == [0, 1, 2, 3, 4]   # each number once, in order, and no more than the budget
    trials = study.open_study(args, settings).get_trials(deepcopy=False)
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 5 and len({t.number for t in done}) == 5
    assert study.open_study(args, settings).best_trial.number == 4


def test_a_failed_trial_leaves_its_place_in_the_budget(tmp_path):
    from lenet import study

    args = _args(tmp_path)
    s = study.open_study(args, sweep.settings_of(args, "abc", 50000, 10000))
    dists, _ = study.space(args)
    t0 = s.ask(dists)
    s.tell(t0, state=optuna.trial.TrialState.FAIL)   # interrupted
    numbers = []
    for _ in range(7):
        t = s.ask(dists)
        if study.admitted(s, t, args.trials):
            numbers.append(t.number)
            s.tell(t, 0.1)
    assert numbers == [1, 2, 3, 4, 5]


def test_a_study_made_with_other_flags_is_refused(tmp_path):
    from lenet import study

    args = _args(tmp_path)
    study.open_study(args, sweep.settings_of(args, "abc", 50000, 10000))
    other = _args(tmp_path, "--validation", 10000)
    with pytest.raises(ValueError, match="was made with other flags"):
        study.open_study(other, sweep.settings_of(other, "abc", 50000, 10000))
    # another pack size is the same study: a worker per GPU may pack differently
    same = _args(tmp_path, "--pack-size", 8)
    study.open_study(same, sweep.settings_of(same, "abc", 50000, 10000))


def test_space_is_categorical_lists_and_float_ranges():
    from lenet import study

    args = parse("--search", "optuna", "--trials", 4, "--lr", "0.01:0.5", "--label-smoothing", 0, 0.1,
                 "--ema", "off", "0.999", "--shift", "0:2")
    dists, fixed = study.space(args)
    assert dists["lr"].log and (dists["lr"].low, dists["lr"].high) == (0.01, 0.5)
    assert dists["label_smoothing"].choices == (0.0, 0.1) and dists["ema"].choices == (None, 0.999)
    assert (dists["shift"].low, dists["shift"].high) == (0, 2)
    assert fixed["seed"] == 0 and fixed["epochs"] == 16 and "lr" not in fixed


# ------------------------------------------------------------------ one worker per GPU (scripts/sweep_workers.sh)

def _fake_bin(tmp_path, gpus: str):
    """nvidia-smi listing ``gpus`` and a python3 that records each worker's GPU and flags."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{gpus}'\n")
    (bin_ / "python3").write_text(f"#!/bin/sh\necho \"$CUDA_VISIBLE_DEVICES $*\" >> {tmp_path}/calls\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"}


def test_workers_one_per_gpu_each_pinned_all_on_one_storage(tmp_path):
    env = _fake_bin(tmp_path, "0\\n1\\n2\\n3\\n")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "sweep_workers.sh"), "sqlite:///s.db", str(tmp_path / "o"),
                        "--trials", "256", "--sampler", "grid"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = sorted((tmp_path / "calls").read_text().splitlines())
    assert [c.split()[0] for c in calls] == ["0", "1", "2", "3"]
    for c in calls:
        g = c.split()[0]
        assert f"-m lenet sweep --search optuna --storage sqlite:///s.db --out {tmp_path}/o/gpu{g}" in c
        assert c.endswith("--trials 256 --sampler grid")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "sweep_workers.sh"), "s.log", str(tmp_path / "p")],
                       env={**env, "GPUS": "2"}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and (tmp_path / "calls").read_text().splitlines()[-1].startswith("2 ")


@pytest.mark.parametrize("argv,words", [([], "usage"), (["s.log", "o", "--storage", "x"], "first two arguments"),
                                        (["s.log", "o"], "no GPU found")])
def test_workers_refusals(tmp_path, argv, words):
    env = _fake_bin(tmp_path, "")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "sweep_workers.sh"), *argv], env=env, capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    said = r.stdout + r.stderr + ("usage" if "STORAGE OUT [lenet sweep flags" in r.stdout else "")
    assert r.returncode == 2 and words in said, said


@pytest.mark.parametrize("extra,keeps", [([], False), (["--ema", "off", "0.999"], True), (["--ema", "0.999"], True),
                                         (["--ema", "off"], False)])
def test_a_study_whose_trials_may_average_makes_packs_that_keep_the_buffer(extra, keeps):
    """A slot that takes a later trial with --ema needs the pack's moving-average buffer, whatever the first
    trials drew (lenet.pack.Pack(keep_average=...))."""
    from lenet.study import StudySweep, space

    args = parse("--search", "optuna", "--trials", 4, "--lr", 0.1, 0.2, *extra)
    worker = StudySweep.__new__(StudySweep)   # the space alone: no storage, no GPU
    worker.dists, worker.fixed = space(args)
    assert worker.may_average() is keeps


# ------------------------------------------------------------------ rows, ranking, the table

def _row(trial, final, loss=0.3, status="complete", **kw):
    from lenet.sweep_results import row_of
    from lenet.pack import Result

    r = Result(Config(**kw), 0, accuracy=[final - 0.01, final], loss=[loss + 0.1, loss], train_loss=[0.9, 0.8])
    row = row_of(r, trial, "validation")
    row["status"] = status if status != "complete" else row["status"]
    return row


def test_rows_rank_complete_models_and_recipes_by_their_mean_over_seeds():
    from lenet.sweep_results import best_of, label_of, recipes

    rows = [_row(0, 0.90, lr=0.1, seed=0), _row(1, 0.94, lr=0.1, seed=1), _row(2, 0.93, lr=0.2, seed=0),
            _row(3, 0.93, lr=0.2, seed=1), _row(4, 0.99, lr=0.4, seed=0, status="pruned")]
    assert best_of(rows)["trial"] == 1                      # the best complete model, not the pruned one
    ranked = recipes(rows)
    assert [g["config"]["lr"] for g in ranked] == [0.2, 0.1, 0.4]   # means 0.93, 0.92, and the pruned one's 0
    assert ranked[0]["seeds"] == [0, 1] and abs(ranked[0]["mean"] - 0.93) < 1e-12
    assert ranked[-1]["finals"] == [0.0]                   # a pruned model counts as 0 in its recipe's mean
    assert label_of(rows[2]["config"]) == "lr=0.2 seed=0" and label_of(rows[2]["config"], seed=False) == "lr=0.2"
    tie = [_row(0, 0.92, loss=0.31, seed=0), _row(1, 0.92, loss=0.30, seed=1)]
    assert best_of(tie)["trial"] == 1                        # a tie goes to the lower final loss


def test_a_diverged_model_is_no_winner_and_the_table_says_so(tmp_path):
    from lenet.pack import Result
    from lenet.sweep_results import best_of, row_of, write_csv

    bad = row_of(Result(Config(lr=5.0), 0, accuracy=[0.1], loss=[float("nan")], train_loss=[float("nan")]), 0, "test")
    good = _row(1, 0.9, ema=0.999)
    assert bad["status"] == "diverged" and best_of([bad, good]) is good
    write_csv(tmp_path / "results.csv", [bad, good])
    lines = (tmp_path / "results.csv").read_text().splitlines()
    assert lines[0].startswith("trial,status,lr,") and lines[1].startswith("0,diverged,5.0,")
    assert ",off," in lines[1] and ",0.999," in lines[2] and len(lines) == 3
