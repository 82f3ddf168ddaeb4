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
from lenet.engines import Policy
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
    assert all((c.epochs, c.batch_size, c.schedule, c.nesterov, c.flip) == (16, 150, "cosine", True, True)
               for c in configs)


def test_seed_specs_and_repeated_values():
    assert sweep.seeds("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    args = parse("--lr", 0.1, 0.1, "--seeds", "0-1", "1-2")
    assert [c.seed for c in sweep.grid(args)] == [0, 1, 2]   # each configuration once


def test_the_fast_recipes_train_flags_are_the_sweeps_defaults_as_given():
    """lenet train's switches (--nesterov, --flip) alone mean on here too, so the README's fast recipe, pasted
    as lenet train takes it, is a sweep of one model: the defaults."""
    import shlex
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import time_to_accuracy as tta
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    args = parse(*shlex.split(tta.RECIPES["fast"]))
    assert sweep.grid(args) == [Config()] and args.tta
    assert [c.flip for c in sweep.grid(parse("--flip", "on", "off"))] == [True, False]
    assert {c.nesterov for c in sweep.grid(parse("--nesterov", "--lr", 0.1))} == {True}


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
                      ({"cutout": 29}, "cutout 29: must be an integer from 0 to 28"),
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
        return sweep.default_algo(args, run, policy_from(args, Policy)).choice("fwd")

    assert algo("--seeds", "0-2") == algo("--seeds", "0-3", "--batch-size", "128") == "heuristic"   # 450, 512 images
    assert algo("--seeds", "0-3") == algo("--seeds", "0-15") == "exhaustive"                  # 600, 2400 images
    assert algo("--seeds", "0-7", "--batch-size", "64") == "heuristic"                       # 8 of 64
    assert algo("--seeds", "0-15", "--pack-size", "3") == "heuristic"                         # packs of 3
    assert algo("--seeds", "0-2", "--algo", "exhaustive") == "exhaustive"                     # given: kept
    assert algo("--seeds", "0-15", "--deterministic") == "heuristic"
    assert "every pack holds at most 4 images per SM, heuristic" in " ".join(sweep.parser().format_help().split())


def test_train_flags_name_the_lone_run():
    flags = " ".join(Config(lr=0.2, seed=3, ema=0.999, shift=2, cutout=6).train_flags(tta=True))
    for part in ("--lr 0.2", "--seed 3", "--ema 0.999", "--shift 2", "--cutout 6", "--nesterov", "--label-smoothing 0.05",
                 "--warmup-epochs 1", "--flip", "--tta", "--schedule cosine", "--epochs 16", "--batch-size 150"):
        assert part in flags
    assert "--ema" not in " ".join(Config().train_flags()) and "--cutout" not in " ".join(Config().train_flags())
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
    (["--ema", "off", "1.5"], "invalid value '1.5': must be a number in (0, 1), or off"),
    (["--search", "optuna", "--trials", "4", "--storage", "/no/such/folder/study.log", "--lr", "0.1", "0.2"],
     "does not exist"),
    (["--search", "optuna", "--trials", "4", "--storage", "sqlite:////no/such/folder/study.db", "--lr", "0.1", "0.2"],
     "does not exist"),
    (["--search", "optuna", "--trials", "4"], "nothing to choose"),
    (["--search", "optuna", "--trials", "4", "--lr", "0.1", "0.2", "--epochs", "2", "4"], "one value"),
    (["--lr", "0.1", "0.2", "--validation", "0"], "say so with --rank-on-test"),
    (["--rank-on-test", "--validation", "5"], "give one"),
    (["--rank-on-test", "--test-every-model"], "every model is evaluated on the test split already"),
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


# ------------------------------------------------------------------ the ranked split (Note [the ranked split])

def test_a_sweep_of_several_models_holds_out_a_validation_split_by_default(dataset):
    """The last sixth of the training images, out of training, the pixel statistics of the rest; one
    model holds nothing out; the test split is ranked on only with --rank-on-test."""
    from lenet import data

    run = sweep.prepare(parse("--data-dir", dataset, "--lr", 0.1, 0.2))
    (tx, ty), (vx, vy), (sx, _) = run["train"], run["evals"], run["test"]
    assert len(vx) == 40 // sweep.VALIDATION_SHARE == run["settings"]["validation"] and len(tx) == 40 - len(vx)
    assert run["train_size"] == len(tx) and run["settings"]["train_size"] == len(tx)
    whole = data.load_split(dataset, "train")
    assert np.array_equal(vx, whole[0][-len(vx):]) and np.array_equal(vy, whole[1][-len(vx):])
    assert np.array_equal(tx, whole[0][:-len(vx)]) and (run["mean"], run["std"]) == data.pixel_stats(tx)
    assert not np.array_equal(vx[: len(sx)], sx[: len(vx)])
    one = sweep.prepare(parse("--data-dir", dataset))                          # one model: nothing ranked
    assert one["settings"]["validation"] == 0 and one["evals"][0] is one["test"][0]
    told = sweep.prepare(parse("--data-dir", dataset, "--lr", 0.1, 0.2, "--rank-on-test"))
    assert told["settings"]["validation"] == 0 and told["evals"][0] is told["test"][0] and len(told["train"][0]) == 40
    given = sweep.prepare(parse("--data-dir", dataset, "--lr", 0.1, 0.2, "--validation", 10))
    assert len(given["evals"][0]) == 10 and len(given["train"][0]) == 30
    study = sweep.prepare(parse("--data-dir", dataset, "--search", "optuna", "--trials", 3, "--lr", 0.1, 0.2)) \
        if _has_optuna() else None
    assert study is None or study["settings"]["validation"] == 40 // sweep.VALIDATION_SHARE
    with pytest.raises(ValueError, match="too few to hold out"):
        sweep.validation_size(parse("--lr", 0.1, 0.2), 5, 2)


def _has_optuna() -> bool:
    try:
        import optuna  # noqa: F401
    except ImportError:
        return False
    return True


# Each configuration's accuracy on a split: the validation split prefers lr 0.1, the test split lr 0.2, so
# a sweep that ranked on the test split would crown another winner.
SCORES = {"validation": {0.05: 0.80, 0.1: 0.90, 0.2: 0.85}, "test": {0.05: 0.70, 0.1: 0.75, 0.2: 0.95}}


class _FakePack:
    """lenet.pack.Pack's surface as GridSweep and StudySweep drive it, without a GPU: every epoch each model
    scores SCORES on the split it was handed (``which`` names it), its weights its learning rate."""

    made: list = []   # the split each pack was handed to evaluate on

    def __init__(self, configs, train, evals, *, models=None, which=None, **_):
        self.evals, self.which, self.steps = evals, which, 1
        self.split = which(evals)
        _FakePack.made.append(self.split)
        self.slots, self.results = [], []
        for k, c in enumerate(configs):
            self.assign(k, c)

    def assign(self, k, config, tag=None, fresh=True):
        from lenet.pack import Result

        r = Result(config, k, tag=tag)
        self.slots += [None] * (k + 1 - len(self.slots))
        self.slots[k] = r
        self.results.append(r)
        return r

    @property
    def active(self):
        return [k for k, r in enumerate(self.slots) if r is not None and not r.done]

    def release(self, k):
        self.slots[k] = None

    def begin_epoch(self):
        return None

    def steps_of(self, orders, first=0, stop=None):
        return self.steps

    def end_epoch(self, seconds):
        done = []
        for r in self.slots:
            if r is None or r.done:
                continue
            r.accuracy.append(SCORES[self.split][r.config.lr] - 0.01 * (r.config.epochs - len(r.accuracy) - 1))
            r.loss.append(0.5)
            r.train_loss.append(0.5)
            if r.done:
                r.weights = r.params = np.full(4, r.config.lr, np.float32)
                r.velocity = np.zeros(4, np.float32)
                done.append(r)
        return done

    def close(self):
        pass


def _no_gpu_sweep(monkeypatch, run):
    """The seams a sweep reads its splits through, without a GPU: Sweep.datasets hands the host arrays to
    the (fake) pack, Sweep.evaluate_on_test is counted. Returns the list of weights the test split saw."""
    from lenet import pack as pack_module
    from lenet import study as study_module
    from lenet.sweep_results import Sweep

    def which(split):
        for name, ref in (("test", run["test"]), ("validation", run["evals"] if run["settings"]["validation"] else None),
                          ("train", run["train"])):
            if ref is not None and len(split[0]) == len(ref[0]) and np.array_equal(split[0], ref[0]):
                return name
        return "?"

    tested = []

    def on_test(self, weights, policy):
        tested.append(float(weights[0]))
        return SCORES["test"][round(float(weights[0]), 4)], 0.3

    _FakePack.made = []
    for module in (pack_module, study_module):   # a grid imports it when it runs a pack, the study at its import
        monkeypatch.setattr(module, "Pack", lambda *a, **kw: _FakePack(*a, which=which, **kw))
    monkeypatch.setattr(Sweep, "datasets", lambda self: (self.run_info["train"], self.run_info["evals"]))
    monkeypatch.setattr(Sweep, "evaluate_on_test", on_test)
    return tested


def test_the_default_ranks_on_held_out_images_and_the_test_split_is_read_once_by_the_winner(dataset, monkeypatch,
                                                                                            capsys):
    from lenet import cli

    args = parse("--data-dir", dataset, "--lr", 0.05, 0.1, 0.2, "--epochs", 2, "--quiet")
    run = sweep.prepare(args)
    tested = _no_gpu_sweep(monkeypatch, run)
    grid = sweep.GridSweep(args, run, cli.policy_from(args, Policy), None, run["configs"])
    assert grid.run() == 0
    assert _FakePack.made == ["validation"]                  # every model evaluated on held-out training images
    assert [round(w, 4) for w in tested] == [0.1]            # the test split read once, by the validation winner
    out = capsys.readouterr().out
    assert "ranked on the validation split" in out and "best 90.00% on the validation split" in out
    assert "the winner on the test split (seen now, once, by it alone): 75.00%" in out


def test_every_model_on_the_test_split_is_reported_apart_and_never_ranked_on(dataset, monkeypatch, capsys, tmp_path):
    from lenet import cli

    args = parse("--data-dir", dataset, "--lr", 0.05, 0.1, 0.2, "--epochs", 2, "--quiet", "--test-every-model",
                 "--out", tmp_path / "out")
    run = sweep.prepare(args)
    sweep.open_out(run["out"], False, run["settings"], False)
    tested = _no_gpu_sweep(monkeypatch, run)
    grid = sweep.GridSweep(args, run, cli.policy_from(args, Policy), None, run["configs"])
    monkeypatch.setattr(grid, "save_best", lambda row, r: None)   # the checkpoint's export: not this test's
    assert grid.run() == 0
    assert sorted(round(w, 4) for w in tested) == [0.05, 0.1, 0.2]   # once each, the winner's reused
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["best"]["config"]["lr"] == 0.1 and summary["test_accuracy"] == 0.75   # not lr 0.2's 0.95
    rows = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert {r["config"]["lr"]: r["test_accuracy"] for r in rows} == SCORES["test"]
    assert all(r["split"] == "validation" for r in rows)
    assert (tmp_path / "out" / "results.csv").read_text().splitlines()[0].endswith(",test_accuracy")
    assert "(test 95.00%, not ranked on)" in capsys.readouterr().out


def test_ranking_on_the_test_split_is_said_on_every_line_that_names_a_best(dataset, monkeypatch, capsys):
    from lenet import cli

    args = parse("--data-dir", dataset, "--lr", 0.05, 0.1, 0.2, "--seeds", "0-1", "--epochs", 2, "--quiet",
                 "--rank-on-test")
    run = sweep.prepare(args)
    tested = _no_gpu_sweep(monkeypatch, run)
    assert sweep.GridSweep(args, run, cli.policy_from(args, Policy), None, run["configs"]).run() == 0
    assert _FakePack.made == ["test"] and tested == []
    out = capsys.readouterr().out
    bests = [x for x in out.splitlines() if "best" in x or "winner" in x or "ranked" in x]
    assert bests and all("test split" in x or x.startswith("the winner alone") for x in bests), bests
    assert "no estimate for unseen images" in out


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
    assert r.returncode == 2 and "was made with --lr=[0.1, 0.2], this one has [0.1, 0.3]" in one_line(r)
    assert sorted(p.name for p in out.iterdir()) == ["results.jsonl", "sweep.json"]


def test_a_sweep_made_before_an_axis_existed_resumes_with_that_axis_at_its_old_value(dataset, tmp_path):
    """sweep.json and results.jsonl written before --cutout: the sweep continues (its models trained without
    cutout, the default), each row read with cutout 0; --cutout 6 is another sweep, named as that flag."""
    from lenet import cli, data

    out = tmp_path / "out"
    out.mkdir()
    args = parse("--data-dir", dataset, "--out", out, "--lr", 0.1, 0.2, "--rank-on-test")
    root, (tx, _), (vx, _), cache, _ = cli.run_splits(args)
    args.validation = 0
    settings = sweep.settings_of(args, data.fingerprint(root, cache), len(tx), len(vx))
    del settings["grid"]["cutout"]
    (out / "sweep.json").write_text(json.dumps(settings))
    config = {k: v for k, v in Config(lr=0.1).as_dict().items() if k != "cutout"}
    row = {"trial": None, "status": "complete", "config": config, "split": "test", "accuracy": [0.5], "loss": [1.0],
           "train_loss": [1.2], "final": 0.5, "epochs_run": 1, "seconds": 0.1}
    (out / "results.jsonl").write_text(json.dumps(row) + "\n")
    resumed = sweep.prepare(parse("--data-dir", dataset, "--out", out, "--lr", 0.1, 0.2, "--rank-on-test", "--resume"))
    assert [r["config"]["cutout"] for r in resumed["done_rows"]] == [0]
    done = {json.dumps(r["config"], sort_keys=True) for r in resumed["done_rows"]}   # how GridSweep skips a model
    assert [c.lr for c in resumed["configs"] if json.dumps(c.as_dict(), sort_keys=True) not in done] == [0.2]
    r = run("--data-dir", dataset, "--out", out, "--lr", 0.1, 0.2, "--rank-on-test", "--resume", "--cutout", 6)
    assert r.returncode == 2 and "was made with --cutout=[0], this one has [6]" in one_line(r)


def test_a_broken_pack_state_is_one_line_on_resume(dataset, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    args = parse("--data-dir", dataset, "--out", out)
    from lenet import cli, data   # sweep.json as prepare() writes it, so that only pack.npz is wrong

    root, (tx, _), (vx, _), cache, _ = cli.run_splits(args)
    args.validation = sweep.validation_size(args, len(tx), 1)   # one model: nothing held out
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


def test_a_spent_budget_asks_for_no_trial_and_one_asked_beyond_it_is_no_failure(tmp_path, monkeypatch, capsys):
    """Note [trial budget]: once the budget's trials are there a worker asks for none; a trial another worker's
    ask pushed beyond it (a race near the end) is told FAIL with "beyond the budget", never trained, and the
    finished study reports it as that, not as a failure."""
    from lenet import study
    from lenet.study import StudySweep

    args = _args(tmp_path)
    s = study.open_study(args, sweep.settings_of(args, "abc", 50000, 10000))
    worker = StudySweep.__new__(StudySweep)   # its ask() and finish() alone: no pack, no GPU
    worker.study, worker.args, worker.worker, worker.exhausted = s, args, "here:1", False
    worker.dists, worker.fixed = study.space(args)
    worker.rows, worker.bar, worker.out, worker.split = [], None, None, "validation"
    for _ in range(args.trials - 1):
        trial, _ = worker.ask()
        s.tell(trial, 0.5)
    other = s.ask(worker.dists)                 # another worker's ask, admitted: the budget's last trial
    assert study.admitted(s, other, args.trials)
    monkeypatch.setattr(study, "spent", lambda *a: False)   # this worker checked before the other asked
    assert worker.ask() is None and worker.exhausted
    monkeypatch.undo()
    late = s.get_trials(deepcopy=False)[-1]
    assert late.number == args.trials and late.state == optuna.trial.TrialState.FAIL
    assert late.user_attrs["lenet"] == study.BEYOND and study.outcome(late) == "asked beyond the budget (never trained)"
    s.tell(other, 0.6)
    made = len(s.get_trials(deepcopy=False))
    worker.exhausted = False
    assert worker.ask() is None and len(s.get_trials(deepcopy=False)) == made   # spent: no trial made to be failed
    assert worker.finish(None) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert "5 complete" in line and "1 asked beyond the budget (never trained)" in line and "fail" not in line, line


def test_a_waiting_trial_enqueued_again_is_admitted_where_the_budget_is_otherwise_spent(tmp_path):
    """An interrupted trial (FAIL, its parameters enqueued again) leaves its place to the waiting one: the
    budget counts it as spent for a new trial, not for the waiting one."""
    from lenet import study

    args = _args(tmp_path)
    s = study.open_study(args, sweep.settings_of(args, "abc", 50000, 10000))
    dists, _ = study.space(args)
    trials = [s.ask(dists) for _ in range(args.trials)]
    for i, t in enumerate(trials):
        if i == 2:   # a worker stopped while it trained this one (StudySweep.interrupted)
            t.set_user_attr("lenet", "interrupted")
            s.tell(t, state=optuna.trial.TrialState.FAIL)
            s.enqueue_trial(t.params, skip_if_exists=False)
        else:
            s.tell(t, 0.5)
    assert not study.spent(s, args.trials)
    again = s.ask(dists)
    assert again.params == s.trials[2].params and study.admitted(s, again, args.trials)
    s.tell(again, 0.7)
    assert study.spent(s, args.trials)
    assert study.outcome(s.trials[2]) == "interrupted (enqueued again)"


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



def test_a_study_made_before_an_axis_existed_is_continued(tmp_path):
    """A study whose stored flags predate --cutout is the same study at cutout 0 (its trials trained so), and
    another with --cutout 6."""
    from lenet import study

    args = _args(tmp_path)
    older = sweep.settings_of(args, "abc", 50000, 10000)
    del older["grid"]["cutout"]
    st = study.open_study(args, older)   # stored as an older lenet stored it
    assert "cutout" not in st.user_attrs["lenet"]["grid"]
    study.open_study(args, sweep.settings_of(args, "abc", 50000, 10000))
    other = _args(tmp_path, "--cutout", 6)
    with pytest.raises(ValueError, match=r"--cutout \[0\] there, \[6\] here"):
        study.open_study(other, sweep.settings_of(other, "abc", 50000, 10000))


def test_space_is_categorical_lists_and_float_ranges():
    from lenet import study

    args = parse("--search", "optuna", "--trials", 4, "--lr", "0.01:0.5", "--label-smoothing", 0, 0.1,
                 "--ema", "off", "0.999", "--shift", "0:2", "--cutout", "4:12")
    dists, fixed = study.space(args)
    assert dists["lr"].log and (dists["lr"].low, dists["lr"].high) == (0.01, 0.5)
    assert dists["label_smoothing"].choices == (0.0, 0.1) and dists["ema"].choices == (None, 0.999)
    assert (dists["shift"].low, dists["shift"].high) == (0, 2)
    assert (dists["cutout"].low, dists["cutout"].high, dists["cutout"].step) == (4, 12, 1)
    assert fixed["seed"] == 0 and fixed["epochs"] == 16 and "lr" not in fixed


# ------------------------------------------------------------------ one worker per GPU (lenet sweep --gpus)

def test_gpus_names_all_or_indices_each_worker_pinned_to_one():
    from lenet.workers import choose, parse_gpus

    assert parse_gpus("all") == "all" and parse_gpus(" 0, 2") == "0,2"
    for bad, why in (("0,0", "named twice"), ("x", "give all"), ("-1", "give all"), ("", "give all")):
        with pytest.raises(ValueError, match=why):
            parse_gpus(bad)
    assert choose("all", 4, None) == ["0", "1", "2", "3"] and choose("1,3", 4, None) == ["1", "3"]
    assert choose("all", 2, "5,7") == ["5", "7"] and choose("1", 2, "5,7") == ["7"]   # its own visible GPUs
    with pytest.raises(ValueError, match="--gpus 0,2: GPU 2 does not exist; this machine has 2"):
        choose("0,2", 2, None)
    from descriptors.errors import NoGpuError
    with pytest.raises(NoGpuError, match="no usable NVIDIA GPU"):
        choose("all", 0, None)


def test_a_worker_gets_the_sweeps_flags_with_the_study_and_its_own_folder(tmp_path):
    from lenet.workers import worker_argv

    argv = ["--gpus", "all", "--search", "optuna", "--trials", "8", "--out=o", "--lr", "0.1", "0.2", "--overwrite",
            "--storage", "s.log", "--quiet", "--resume", "--gpus=0"]
    assert worker_argv(argv, "st.log", tmp_path / "o" / "gpu1") == [
        "--search", "optuna", "--trials", "8", "--lr", "0.1", "0.2", "--storage", "st.log", "--out",
        str(tmp_path / "o" / "gpu1"), "--quiet"]


@pytest.mark.parametrize("flags,words", [
    (["--lr", "0.1", "0.2"], "--gpus spreads one Optuna study over the GPUs: add --search optuna"),
    (["--search", "optuna", "--trials", "4", "--lr", "0.1", "0.2", "--no-out"], "--gpus needs --out DIR"),
    (["--search", "optuna", "--trials", "4", "--lr", "0.1", "0.2", "--gpus", "0,0"], "a GPU is named twice"),
    (["--search", "optuna", "--trials", "4", "--lr", "0.1", "0.2", "--resume"], "holds no sweep over GPUs"),
])
def test_gpus_refusals_are_one_line_and_write_nothing(flags, words, dataset, tmp_path):
    out = tmp_path / "o"
    flags = [f for f in flags if f != "--no-out"] + ([] if "--no-out" in flags else ["--out", out])
    r = run("--gpus", "all", "--data-dir", dataset, *flags)
    line = one_line(r)
    assert r.returncode == 2 and words in line, line
    assert not out.exists()


def test_gpus_on_a_machine_without_one_is_one_line_after_every_other_check(dataset, tmp_path):
    r = run("--gpus", "all", "--search", "optuna", "--trials", "4", "--lr", "0.1", "0.2", "--data-dir", dataset,
            "--out", tmp_path / "o", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and "no usable NVIDIA GPU" in one_line(r)
    assert not (tmp_path / "o").exists()
    r = run("--gpus", "all", "--search", "optuna", "--trials", "4", "--lr", "0.1", "0.2", "--data-dir", tmp_path / "x",
            "--out", tmp_path / "o")
    assert r.returncode == 2 and "--data-dir" in one_line(r) and "no such folder" in one_line(r)


def test_the_workers_results_merge_into_one(tmp_path):
    """What the workers wrote (each its rows and its winner) becomes one result: every row, ranked together, the
    winner's checkpoint from the worker that trained it, its test accuracy where that worker evaluated it."""
    from lenet.workers import Workers

    args = parse("--search", "optuna", "--trials", 4, "--lr", 0.1, 0.2, "--gpus", "all", "--out", tmp_path / "o")
    w = Workers(args, [])
    w.procs = [("0", None, None), ("1", None, None)]
    rows = {0: [_row(0, 0.90, lr=0.1), _row(3, 0.91, lr=0.2)], 1: [_row(1, 0.95, lr=0.2), _row(2, 0.5, status="pruned")]}
    for i, rs in rows.items():
        folder = tmp_path / "o" / f"gpu{i}"
        (folder / "best").mkdir(parents=True)
        (folder / "best" / "checkpoint.npz").write_bytes(f"worker {i}".encode())
        (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs) + '{"cut by a ki')
        best = max((r for r in rs if r["status"] == "complete"), key=lambda r: r["final"])
        (folder / "summary.json").write_text(json.dumps({"best": best, "test_accuracy": 0.9 + i / 100}))
    summary = w.merge()
    assert summary["models"] == 4 and summary["best"]["trial"] == 1 and summary["test_accuracy"] == 0.91
    assert (tmp_path / "o" / "best" / "checkpoint.npz").read_bytes() == b"worker 1"
    merged = [json.loads(x) for x in (tmp_path / "o" / "results.jsonl").read_text().splitlines()]
    assert [r["trial"] for r in merged] == [0, 1, 2, 3] and [r["worker"] for r in merged] == [0, 1, 1, 0]
    assert len((tmp_path / "o" / "results.csv").read_text().splitlines()) == 5
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["gpus"] == ["0", "1"]


def test_optunas_objective_and_pruner_see_the_validation_split_alone(dataset, monkeypatch, capsys):
    """Every value a trial reports (what the median pruner reads) and tells (the objective) is its accuracy
    on the held-out images; the study's best is the validation winner, and the test split is read once,
    by it."""
    from lenet import cli
    from lenet.study import StudySweep, open_study

    args = parse("--data-dir", dataset, "--search", "optuna", "--trials", 3, "--sampler", "grid", "--lr", 0.05, 0.1,
                 0.2, "--epochs", 2, "--pack-size", 2, "--quiet")
    run = sweep.prepare(args)
    run["study"] = open_study(args, run["settings"])   # as main() does, once the GPU is there
    tested = _no_gpu_sweep(monkeypatch, run)
    assert StudySweep(args, run, cli.policy_from(args, Policy), None).run() == 0
    assert _FakePack.made == ["validation"]
    trials = [t for t in run["study"].get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(trials) == 3
    for t in trials:
        val = SCORES["validation"][t.params["lr"]]
        assert t.value == pytest.approx(val) and t.intermediate_values == {1: pytest.approx(val - 0.01),
                                                                           2: pytest.approx(val)}
    assert run["study"].best_trial.params["lr"] == 0.1 and [round(w, 4) for w in tested] == [0.1]
    assert "on the validation split" in capsys.readouterr().out


@pytest.mark.parametrize("other", ["running", "better", "worse"])
def test_a_study_reads_the_test_split_only_for_its_winner_once_it_is_known(dataset, monkeypatch, capsys, other):
    """Two workers of one study: another worker's trial still running (the winner not known yet), or done
    better than every trial of this worker (the winner is the other's): this worker reads no test split.
    Done worse: this worker trained the study's winner, and reads the test split once, by it."""
    from lenet import cli
    from lenet.study import StudySweep, open_study

    args = parse("--data-dir", dataset, "--search", "optuna", "--trials", 4, "--sampler", "grid", "--lr", 0.05, 0.1,
                 0.2, "--epochs", 2, "--pack-size", 2, "--quiet")
    run = sweep.prepare(args)
    run["study"] = open_study(args, run["settings"])   # as main() does, once the GPU is there
    tested = _no_gpu_sweep(monkeypatch, run)
    theirs = run["study"].ask()                 # the other worker's trial
    theirs.set_user_attr("out", "/elsewhere")
    if other != "running":
        run["study"].tell(theirs, 0.99 if other == "better" else 0.5)
    worker = StudySweep(args, run, cli.policy_from(args, Policy), None)
    assert worker.run() == 0
    out = capsys.readouterr().out
    mine = max((r for r in worker.rows), key=lambda r: r["final"])
    if other == "running":
        assert tested == [] and "trials of the study still run elsewhere" in out
    elif other == "better":
        assert tested == [] and f"the study's winner is trial {theirs.number}" in out and "/elsewhere/best" in out
    else:
        assert [round(w, 4) for w in tested] == [mine["config"]["lr"]] and "seen now, once, by it alone" in out


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

def _row(trial, final, loss=0.3, status="complete", **kw):   # noqa: F811 (used above too)
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


WORKER = """import json, os, signal, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
gpu = os.environ["CUDA_VISIBLE_DEVICES"]
os.makedirs(out, exist_ok=True)
if gpu == "{dies}":
    print("error: the worker fell over"); sys.exit(3)
stop = []
signal.signal(signal.SIGINT, lambda s, f: stop.append(s))
for i in range(200):
    if stop:
        print("stopped by SIGINT"); sys.exit(130)
    time.sleep(0.01 * {slow})
row = {{"trial": int(gpu), "status": "complete", "config": {config}, "split": "test", "accuracy": [0.9],
       "loss": [0.3], "train_loss": [0.5], "final": 0.9 + int(gpu) / 100, "epochs_run": 1, "seconds": 1.0}}
open(os.path.join(out, "results.jsonl"), "w").write(json.dumps(row) + "\\n")
"""


def _workers(tmp_path, monkeypatch, dies="", slow=1):
    from lenet.pack import Config
    from lenet.workers import Workers

    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(dies=dies, slow=slow, config=json.dumps(Config().as_dict()).replace("null", "None")
                                    .replace("true", "True").replace("false", "False")))
    monkeypatch.setattr(Workers, "command", (sys.executable, str(script)))
    args = parse("--search", "optuna", "--trials", 4, "--lr", 0.1, 0.2, "--gpus", "all", "--out", tmp_path / "o")
    return Workers(args, ["--gpus", "all", "--out", str(tmp_path / "o")])


def test_the_workers_each_get_their_gpu_and_a_dying_one_is_named(tmp_path, monkeypatch, capsys):
    w = _workers(tmp_path, monkeypatch, dies="3")
    w.check()
    w.start(["2", "3", "5"])
    failed = w.wait()
    assert failed == [("3", 3, "error: the worker fell over")]
    summary = w.merge()
    assert summary["models"] == 2 and summary["best"]["trial"] == 5 and summary["gpus"] == ["2", "3", "5"]
    assert json.loads((tmp_path / "o" / "workers.json").read_text())["storage"] == str(tmp_path / "o" / "study.log")
    assert "worker 1 on GPU 3" in capsys.readouterr().out


def test_a_signal_reaches_every_worker_once(tmp_path, monkeypatch):
    """Note [stopping the workers]: a program's signal handling (lenet/interrupt.py, cli.run) hands the first
    SIGINT to the workers' parent, which passes it on to each worker once and ends with one line, 130."""
    import signal

    w = _workers(tmp_path, monkeypatch, slow=300)
    script = tmp_path / "parent.py"
    script.write_text(f"""import sys
sys.path.insert(0, {str(ROOT)!r})
from lenet import cli, sweep, workers
workers.Workers.command = {w.command!r}
workers.gpu_count = lambda: 2
args = sweep.parser().parse_args(["--search", "optuna", "--trials", "4", "--lr", "0.1", "0.2", "--gpus", "all",
                                  "--out", {str(tmp_path / 'o')!r}])
cli.run(lambda: workers.run(args, ["--gpus", "all"]), "lenet sweep")
""")
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    import time
    for _ in range(100):   # both workers started
        if all((tmp_path / "o" / f"gpu{i}.log").exists() for i in (0, 1)):
            break
        time.sleep(0.1)
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    lines = [x for x in err.splitlines() if x.strip()]
    assert p.returncode == 130 and len(lines) == 1 and lines[0].startswith("stopped by SIGINT: 2 workers"), err
    logs = [(tmp_path / "o" / f"gpu{i}.log").read_text() for i in (0, 1)]
    assert all(log.count("stopped by SIGINT") == 1 for log in logs), logs


def test_the_workers_get_cupys_cache_folder_as_the_user_had_it(tmp_path):
    """Note [CuPy's cache folder after the checks] in lenet/files.py: a first run's lenet sweep --gpus parent
    names the temporary folder in CUPY_CACHE_DIR while its writes are held, and its own checks never pass (its
    workers check); its workers get the variable as the user had it (here unset), not the temporary folder."""
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text("import os\nprint('CUPY_CACHE_DIR=' + repr(os.environ.get('CUPY_CACHE_DIR')))\n")
    script = tmp_path / "parent.py"
    script.write_text(f"""import os, sys
sys.path.insert(0, {str(ROOT)!r})
from lenet import files
files.hold_writes()   # as lenet.startup.begin does first
files.library_caches()
print("parent", os.environ.get("CUPY_CACHE_DIR"), flush=True)
from lenet import cli, sweep, workers
workers.Workers.command = ({sys.executable!r}, {str(worker)!r})
workers.gpu_count = lambda: 2
args = sweep.parser().parse_args(["--search", "optuna", "--trials", "4", "--lr", "0.1", "0.2", "--gpus", "all",
                                  "--out", {str(tmp_path / 'o')!r}])
cli.run(lambda: workers.run(args, ["--gpus", "all"]), "lenet sweep")
""")
    env = {k: v for k, v in os.environ.items() if k not in ("CUPY_CACHE_DIR", "XDG_CACHE_HOME")}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env={**env, "HOME": str(home), "TMPDIR": str(tmp), "CUDA_VISIBLE_DEVICES": ""})
    assert f"parent {tmp}" in p.stdout, (p.stdout, p.stderr)   # set aside in the parent
    logs = [(tmp_path / "o" / f"gpu{i}.log").read_text() for i in (0, 1)]
    assert all("CUPY_CACHE_DIR=None" in log for log in logs), (logs, p.stderr)
