"""The recipe and the time-to-accuracy machinery without a GPU: flag checks, the warm-up, the
augmentation's draws and rule, the plan cache's keys, invalidation and bad files, stored
choices' round trip, checkpoints with a moving average, and the background writer."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from lenet import checkpoint as ckpt
from lenet import data
from lenet import params as P
from lenet.background import Background
from lenet.plancache import MAX_ENTRIES, PlanCache, environment
from lenet.schedule import Schedule
from test_safety_cpu import refused, run


@pytest.mark.parametrize("args,needle", [
    (["--shift", "14"], "--shift: invalid value '14': must be an integer from 0 to 13 pixels"),
    (["--shift", "-1"], "--shift: invalid value '-1': must be an integer from 0 to 13 pixels"),
    (["--cutout", "29"], "--cutout: invalid value '29': must be an integer from 0 to 28 pixels"),
    (["--cutout", "x"], "--cutout: invalid value 'x': must be an integer from 0 to 28 pixels"),
    (["--nesterov", "--momentum", "0"], "--nesterov needs --momentum > 0"),
    (["--label-smoothing", "1"], "--label-smoothing: invalid value '1': must be a number in [0, 1)"),
    (["--ema", "1"], "--ema: invalid value '1': must be a number in (0, 1)"),
    (["--ema", "0"], "--ema: invalid value '0': must be a number in (0, 1)"),
    (["--warmup-epochs", "-2"], "--warmup-epochs: invalid value '-2'"),
    (["--target-accuracy", "0"], "--target-accuracy: invalid accuracy '0'"),
    (["--target-accuracy", "101"], "--target-accuracy: invalid accuracy '101'"),
    (["--target-accuracy", "abc"], "--target-accuracy: invalid accuracy 'abc'"),
])
def test_recipe_flags_are_checked_before_anything_else(dataset, args, needle):
    refused(run("lenet.train", "--data-dir", str(dataset), *args), needle)


def test_accuracy_accepts_fractions_and_percentages():
    from lenet.cli import accuracy
    assert accuracy("0.915") == 0.915 and accuracy("91.5") == 0.915 and accuracy("91.5%") == 0.915
    assert accuracy("1") == 1.0


def test_warmup_ramps_linearly_in_front_of_any_schedule():
    for kind in ("constant", "cosine", "inv", "step"):
        plain, warm = Schedule(kind, 0.1), Schedule(kind, 0.1, warmup=10)
        for it in range(30):
            f = min(1.0, (it + 1) / 10)
            assert warm.at(it, 5, 30) == pytest.approx(plain.at(it, 5, 30) * f), (kind, it)
    assert Schedule("constant", 0.1, warmup=4).at(0, 10, 100) == pytest.approx(0.025)


def test_augmentation_draws_depend_only_on_seed_epoch_and_position():
    a = data.augment_params(3, 7, np.arange(1000), 2, True)
    b = data.augment_params(3, 7, np.arange(1000), 2, True)
    c = data.augment_params(3, 8, np.arange(1000), 2, True)
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    assert not all(np.array_equal(u, v) for u, v in zip(a, c)), "another epoch draws the same"
    dy, dx, mir = a
    assert set(np.unique(dy)) == set(np.unique(dx)) == set(range(-2, 3))
    assert 0.45 < mir.mean() < 0.55
    part = data.augment_params(3, 7, np.arange(500, 600), 2, True)   # a batch is its slice of the epoch
    assert all(np.array_equal(u[500:600], v) for u, v in zip(a, part))
    dy, dx, mir = data.augment_params(3, 7, np.arange(100), 0, False)
    assert not dy.any() and not dx.any() and not mir.any()
    assert not data.augment_params(3, 7, np.arange(100), 2, False)[2].any(), "mirrored without --flip"


def test_augmentation_rule_translates_with_a_zero_border_and_mirrors():
    img = np.zeros((1, 28, 28), np.uint8)
    img[0, 5, 7] = 200
    out = data.augment_images(img, [2], [-3], [False])
    assert out[0, 7, 4] == 200 and out.sum() == 200
    out = data.augment_images(img, [0], [0], [True])
    assert out[0, 5, 20] == 200 and out.sum() == 200
    edge = np.full((1, 28, 28), 9, np.uint8)
    out = data.augment_images(edge, [1], [1], [False])
    assert (out[0, 0] == 0).all() and (out[0, :, 0] == 0).all() and (out[0, 1:, 1:] == 9).all()


def test_augment_rejects_shifts_and_cutouts_beyond_the_image():
    from lenet.kernels import Augment
    with pytest.raises(ValueError, match="0..13"):
        Augment(14)
    with pytest.raises(ValueError, match="cutout must be an integer in 0..28"):
        Augment(cutout=29)
    assert not Augment().on and Augment(0, True).on and Augment(cutout=4).on


def test_cutout_draws_a_centre_anywhere_and_clears_its_square_clipped_to_the_image():
    top, left = data.cutout_params(3, 7, np.arange(20000), 8)
    assert set(np.unique(top + 4)) == set(np.unique(left + 4)) == set(range(28)), "a centre is uniform over 0..27"
    assert abs(np.corrcoef(top, left)[0, 1]) < 0.05
    again = data.cutout_params(3, 7, np.arange(500, 600), 8)   # a batch is its slice of the epoch
    assert np.array_equal(again[0], top[500:600]) and np.array_equal(again[1], left[500:600])
    assert not np.array_equal(data.cutout_params(3, 8, np.arange(100), 8)[0], top[:100]), "another epoch, same draws"
    # Independent of the shift's and flip's draws, which come from the same hash.
    dy = data.augment_params(3, 7, np.arange(20000), 13, True)[0]
    assert abs(np.corrcoef(top, dy)[0, 1]) < 0.05
    img = np.full((3, 28, 28), 7, np.uint8)
    out = data.cut_images(img, [0, -3, 25], [0, 10, 26], 5)
    assert (out[0, :5, :5] == 0).all() and out[0].sum() == 7 * (784 - 25)
    assert (out[1, :2, 10:15] == 0).all() and out[1].sum() == 7 * (784 - 10), "clipped at the top"
    assert (out[2, 25:, 26:] == 0).all() and out[2].sum() == 7 * (784 - 6), "clipped at the corner"
    assert np.array_equal(data.cut_images(img, [4], [4], 0)[:1], img[:1]), "side 0 cuts nothing"


ENV = environment("NVIDIA H100 80GB HBM3", 13000, "9.19.0", "1.28.0")
OP = {"spec": {"direction": "fwd", "n": 64}, "policy": ["auto", "heuristic"], "fused": True, "captured": True}


def test_plan_cache_round_trip_and_keys(tmp_path):
    path = tmp_path / "sub" / "plans.json"
    c = PlanCache(path, ENV)
    assert c.get(OP) is None and c.misses == 1
    c.put(OP, {"chunk": 64})
    c.flush()
    assert json.loads(path.read_text())["format"] == 2
    again = PlanCache(path, ENV)
    assert again.get(OP) == {"chunk": 64} and again.hits == 1
    assert again.get({**OP, "spec": {"direction": "fwd", "n": 65}}) is None, "another batch size matched"
    for changed in (environment("NVIDIA H200", 13000, "9.19.0", "1.28.0"), environment(ENV["gpu"], 12080, "9.19.0",
                    "1.28.0"), environment(ENV["gpu"], 13000, "9.20.0", "1.28.0"),
                    environment(ENV["gpu"], 13000, "9.19.0", None)):
        assert PlanCache(path, changed).get(OP) is None, f"an entry survived a change of {changed}"


def test_plan_cache_keeps_the_newest_entries(tmp_path):
    c = PlanCache(tmp_path / "p.json", ENV)
    for i in range(MAX_ENTRIES + 5):
        c.put({**OP, "i": i}, {"chunk": i})
    c.flush()
    d = PlanCache(tmp_path / "p.json", ENV)
    assert d.get({**OP, "i": 0}) is None and d.get({**OP, "i": MAX_ENTRIES + 4}) == {"chunk": MAX_ENTRIES + 4}


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'{"format": "two", "entries": {}}', b"\x00\xff" * 10, b""])
def test_a_bad_plan_cache_file_is_one_warning_then_a_search(tmp_path, content):
    path = tmp_path / "plans.json"
    path.write_bytes(content)
    said = []
    c = PlanCache(path, ENV, warn=said.append)
    assert c.get(OP) is None and c.get(OP) is None
    assert len(said) == 1 and str(path) in said[0] and "searching instead" in said[0], said
    c.put(OP, {"chunk": 1})
    c.flush()
    assert PlanCache(path, ENV).get(OP) == {"chunk": 1}, "the bad file was not replaced"


def test_an_unwritable_plan_cache_is_a_warning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    said = []
    c = PlanCache(blocker / "plans.json", ENV, warn=said.append)
    c.put(OP, {"chunk": 1})
    c.flush()
    assert len(said) == 1 and str(blocker) in said[0], said


def test_stored_choices_round_trip_and_refuse_what_does_not_fit():
    from descriptors.candidates import Candidate, ConvSpec
    from lenet.engines.base import Check, Decision, Trial
    from lenet.engines.cudnn import Chunk, Cudnn

    class Source:   # an engine that offers every candidate it is asked about
        def __init__(self, name):
            self.name = name

        def offers(self, spec, cand, planner):
            return cand.engine == self.name

    spec = ConvSpec("bwd-filter", 3000, (1, 28, 28), (6, 1, 5, 5))
    g = Candidate("graph", "eng0_k2=3", False, 4096, None, "fp32", (False, False, False, None))
    legacy = Candidate("legacy", "algo_1", False, 0, True, "fp32", (False,))
    pair = (Trial(g, 0.1, Check(1e-7)), Trial(legacy, 0.09, Check(2e-7)))
    stored = json.loads(json.dumps(Cudnn._encode(Decision([Trial(Chunk(1024), 0.29, Check(), pair)], {}))))
    engines = [Source("graph"), Source("legacy")]
    back = Cudnn._decode(None, spec, stored, engines)
    assert back.candidate == Chunk(1024) and back.ms == 0.29 and back.plan == pair
    with pytest.raises(ValueError):
        Cudnn._decode(None, spec.at(2048), stored, engines)   # no remainder at 2048
    with pytest.raises(ValueError, match="not offered now"):
        Cudnn._decode(None, spec, stored, engines[1:])         # the graph API is not allowed (or gone)


def test_checkpoints_keep_the_moving_average_and_export_uses_it(tmp_path):
    rng = np.random.default_rng(0)
    p, v, e = (rng.standard_normal(P.TOTAL).astype(np.float32) for _ in range(3))
    path = tmp_path / "checkpoint.npz"
    ckpt.save(path, p, v, {"epoch": 1, "iteration": 5, "config": {"mean": 0.1, "std": 0.3, "dataset": "x"},
                           "history": []}, e)
    params, velocity, meta = ckpt.load(path)
    assert np.array_equal(meta["ema"], e) and ckpt.weights(params, meta)[1] == "moving average"
    assert np.array_equal(ckpt.state_dict(path)["fc1.weight"], P.unpack(e)["fc1.weight"])
    out = run("lenet.export", str(path), "--to", str(tmp_path / "w.npz"))
    assert out.returncode == 0 and "(moving average)" in out.stdout, out.stderr
    z = np.load(tmp_path / "w.npz")
    assert np.array_equal(z["fc2.bias"], P.unpack(e)["fc2.bias"])
    ckpt.save(path, p, v, {"epoch": 1, "iteration": 5, "config": {}, "history": []})
    assert "ema" not in ckpt.load(path)[2] and ckpt.weights(p, ckpt.load(path)[2])[1] == "parameters"


def test_a_run_resumes_only_with_the_test_time_augmentation_it_was_scored_with(tmp_path, dataset):
    from lenet import train

    args = train.parser().parse_args(["--data-dir", str(dataset)])
    config = {**train.config_of(args, dataset, 40), "mean": 0.2, "std": 0.3}
    path = tmp_path / "checkpoint.npz"
    ckpt.save(path, P.pack(P.init_host(0)), np.zeros(P.TOTAL, np.float32),
              {"epoch": 1, "step": 0, "iteration": 1, "config": config, "history": []})
    refused(run("lenet.train", "--data-dir", str(dataset), "--tta", "--resume", str(path)),
            "was made with tta=False, this run has tta=True")
    old = {k: v for k, v in config.items() if k != "tta"}   # written before --tta existed: scored plainly
    ckpt.save(path, P.pack(P.init_host(0)), np.zeros(P.TOTAL, np.float32),
              {"epoch": 1, "step": 0, "iteration": 1, "config": old, "history": []})
    refused(run("lenet.train", "--data-dir", str(dataset), "--tta", "--resume", str(path)),
            "was made with tta=False, this run has tta=True")


def test_background_writer_runs_in_order_and_the_newest_of_a_kind_wins():
    done, gate = [], threading.Event()
    w = Background()
    w.submit("block", gate.wait)
    for i in range(5):
        w.submit("checkpoint", lambda i=i: done.append(("checkpoint", i)))
        w.submit(f"metrics {i}", lambda i=i: done.append(("metrics", i)))
    gate.set()
    assert w.wait(timeout=10)
    assert [d for d in done if d[0] == "metrics"] == [("metrics", i) for i in range(5)]
    assert [d for d in done if d[0] == "checkpoint"] == [("checkpoint", 4)], done
    assert w.close(timeout=10)


def test_background_writer_raises_a_job_error_on_the_callers_thread():
    w = Background()

    def fail():
        raise OSError(28, "No space left on device")
    w.submit("checkpoint", fail)
    with pytest.raises(OSError, match="No space left"):
        w.wait(timeout=10)
    w.submit("ok", lambda: time.sleep(0.01))
    assert w.close(timeout=10)


@pytest.mark.stack
def test_the_cublas_bindings_load_without_nvmaths_package_init_and_again_after_it():
    import subprocess
    import sys
    code = ("import sys; from lenet.blas import binding\n"
            "a = binding('cublas'); b = binding('cublasLt'); a2 = binding('cublas')\n"
            "assert a is a2 and 'nvmath' not in sys.modules, sorted(k for k in sys.modules if 'nvmath' in k)\n"
            "import nvmath\n"
            "assert nvmath.bindings.cublas is a and binding('cublasLt') is b and hasattr(nvmath, 'linalg')\n"
            "print('ok')")
    from test_safety_cpu import ROOT
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_a_packs_augmentation_rows_are_the_kernels_layout_and_another_is_refused():
    """One int32 row (shift, flip, seed, cutout) a model, the seed's 32 bits kept (data.cu's gather_pack_kernel);
    gather_pack refuses a table of another shape before it launches (a table of three columns once sent
    every model but the first another's numbers)."""
    from lenet.kernels import AUG_FIELDS, aug_rows, gather_pack

    rows = aug_rows([(1, 1, 2**32 - 1, 10), (0, 2, 7, 0)])
    assert rows.dtype == np.int32 and rows.shape == (2, AUG_FIELDS) == (2, 4)
    assert rows.tolist() == [[1, 1, -1, 10], [0, 2, 7, 0]] and rows.view(np.uint32)[0, 2] == 2**32 - 1
    orders = np.zeros((2, 10), np.int32)
    for bad in (np.zeros((2, 3), np.int32), np.zeros((3, 4), np.int32), np.zeros((2, 4), np.int64)):
        with pytest.raises(ValueError, match=r"one int32 row \(shift, flip, seed, cutout\) a model: \(2, 4\)"):
            gather_pack(None, None, orders, 0, 5, 0.0, 1.0, None, None, bad, None, None, None, 0, None)
