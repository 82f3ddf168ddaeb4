"""The benchmarks' CPU side (scripts/bench.py, scripts/torch_forms.py): PyTorch's forms and their selection,
the arithmetic each row of ours names, the summary of a batch's results, and the README's tables rendered
from a results file. Their timing runs on the GPU machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

# The scripts this file tests, imported as modules (the tests' own helpers are in tests/, on the path already).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench  # noqa: E402
import torch_forms as tf  # noqa: E402


def test_every_form_is_a_mode_benchmark_and_optimizer_and_the_presets_name_them():
    forms = tf.every_form()
    assert len(forms) == len(tf.MODES) * 2 * 2 and len({f.key for f in forms}) == len(forms)
    assert len({f.name for f in forms}) == len(forms)
    quick = tf.select(["quick"])
    assert {f.mode for f in quick} == {"eager", "graph", "compile+graph"} and len(quick) == 12
    assert {(f.benchmark, f.optimizer) for f in quick} == {(b, o) for b in (False, True) for o in ("foreach", "fused")}
    assert tf.select(["all"]) == forms
    assert tf.select(["none"]) == []   # ours alone: two trees of ours compared
    assert {f.mode for f in tf.select(["compile"])} == {"compile", "compile+graph", "reduce-overhead", "max-autotune",
                                                        "max-autotune+graph"}
    assert [f.key for f in tf.select(["graph/bench/fused", "eager/*/foreach"])] == \
        ["eager/nobench/foreach", "eager/bench/foreach", "graph/bench/fused"]
    assert tf.select(["graph/bench/fused"], tf32=True) == [tf.Form("graph", True, "fused", True)]
    assert tf.Form("graph", True, "fused", True).name == "torch graph bench fused tf32"
    with pytest.raises(ValueError, match="matches no form") as e:
        tf.select(["grph/*/*"])
    assert "\n" not in str(e.value)


def test_compile_modes_and_who_captures_the_step():
    assert tf.Form("compile+graph", True, "fused").compile_mode == "default"
    assert tf.Form("max-autotune+graph", True, "fused").compile_mode == "max-autotune-no-cudagraphs"
    assert tf.Form("reduce-overhead", True, "fused").compile_mode == "reduce-overhead"
    assert tf.Form("graph", False, "foreach").compile_mode is None
    assert [m for m in tf.MODES if tf.Form(m, True, "fused").captured] == ["graph", "compile+graph",
                                                                          "max-autotune+graph"]
    # inductor's own graphs (reduce-overhead, max-autotune) are not captured again, nor accumulated over
    for m in ("reduce-overhead", "max-autotune"):
        assert not tf.Form(m, True, "fused").captured
        with pytest.raises(ValueError, match="no accumulation"):
            tf.Form(m, True, "fused", micro=8192)


def test_above_8192_images_each_form_that_may_also_accumulates_micro_batches():
    forms = tf.select(["graph/bench/fused", "max-autotune/bench/fused"])
    assert tf.at_batch(forms, 8192) == forms
    big = tf.at_batch(forms, 65536)
    assert [f.name for f in big] == ["torch graph bench fused", "torch max-autotune bench fused",
                                     "torch graph bench fused accum8192"]


def _rows(*algos):
    return [{"layer": layer, "op": op, "engine": engine, "algo": algo}
            for layer, op, engine, algo in algos]


def test_each_row_of_ours_names_its_arithmetic():
    """conv2's backward versions 6 to 8 run its weight gradient as three TF32 products on the tensor cores
    (3xTF32, float32's accuracy): the row says so, where it used to say exact float32."""
    plain = _rows(("conv1", "bwd+filter+bias", "ours", "fused-bwd-v2-g4"),
                  ("conv2", "bwd+data+filter+bias", "ours", "fused-bwd-v5-g4"))
    assert bench.arithmetic(plain, False) == "float32"
    for v in (6, 7, 8):
        rows = _rows(("conv1", "bwd+filter+bias", "ours", "fused-bwd-v2-g4"),
                     ("conv2", "bwd+data+filter+bias", "ours", f"fused-bwd-v{v}-g4"))
        said = bench.arithmetic(rows, False)
        assert "3xTF32 on the tensor cores, float32 accuracy" in said and f"conv2 fused-bwd-v{v}-g4" in said, said
    cudnn = _rows(("conv2", "bwd-filter", "legacy", "ALGO_1"))
    assert bench.arithmetic(cudnn, False) == "float32" and bench.arithmetic(cudnn, True).startswith("TF32 allowed")
    assert "exact float32" not in bench.__doc__


def _result(us, **extra):
    return {"us_per_step": us, "m_img_per_s": 64 / us, "peak_bytes": 1 << 20, "spread_pct": 1.0, "build_s": 1.0,
            "arithmetic": "float32", **extra}


def _batch_results():
    r = {"torch eager nobench foreach": _result(400.0), "torch graph bench fused": _result(200.0),
         "torch compile+graph bench fused": _result(150.0), "torch max-autotune bench fused": {"error": "X: y"},
         "ours legacy": _result(80.0), "ours auto": _result(30.0), "ours ours": _result(29.0)}
    r["fastest_torch_fp32"] = tf.fastest(r, [n for n in r if n.startswith("torch")])
    r["head_to_head"] = {"torch compile+graph bench fused": _result(152.0), "ours auto": _result(30.4),
                         "torch compile+graph bench fused tf32": _result(140.0), "ours auto tf32": _result(28.0)}
    r["summary"] = bench.summarize(r)
    return r


def test_the_yardstick_is_the_fastest_pytorch_float32_form_and_tf32_stands_apart():
    r = _batch_results()
    s = r["summary"]
    assert s["fastest_torch_fp32"] == "torch compile+graph bench fused" and s["torch_us"] == 150.0
    assert s["alone"] == {"ours legacy": 150 / 80, "ours ours": 150 / 29, "ours auto": 5.0}
    assert s["interleaved"]["speedup"] == pytest.approx(152 / 30.4)
    assert s["tf32"]["torch"] == "torch compile+graph bench fused tf32" and s["tf32"]["speedup"] == 5.0
    lines = bench.summary_lines(64, s)
    assert "TF32 off (torch compile+graph bench fused, 150.0 us)" in lines[0] and "auto 5.00x" in lines[0]
    assert "interleaved: 30.4 vs 152.0 us, 5.00x" in lines[1] and "with TF32 on both sides (apart)" in lines[2]
    assert bench.summarize({"fastest_torch_fp32": None}) == {}


def test_the_readme_tables_render_from_a_results_file(tmp_path, capsys):
    results = {"gpu": "H100", "results": {"64": _batch_results(), "1": _batch_results(),
                                          "epoch": {"source": "fashion", "ours_s": 0.05, "torch_s": 0.2,
                                                    "torch_form": "torch compile+graph bench fused",
                                                    "torch_arithmetic": "float32, TF32 off"}}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(results, default=str))
    assert bench.main(["--table", str(path)]) == 0
    out = capsys.readouterr().out
    one = {"gpu": "H100", "results": {"128": _batch_results()}}   # another run's batch size, rendered with them
    (tmp_path / "b128.json").write_text(json.dumps(one, default=str))
    assert bench.main(["--table", str(path), str(tmp_path / "b128.json")]) == 0
    both = capsys.readouterr().out
    assert "| variant, us per step | 64 | 1 | 128 |" in both and both.count("Epoch of 60,000") == 1
    # one batch size's forms split over two runs: their union, the fastest of all the yardstick
    other = {"torch max-autotune+graph bench fused": _result(140.0), "ours auto": _result(31.0)}
    other["fastest_torch_fp32"] = "torch max-autotune+graph bench fused"
    other["head_to_head"] = {"torch max-autotune+graph bench fused": _result(141.0), "ours auto": _result(30.0)}
    other["summary"] = bench.summarize(other)
    m = bench.merged([results, {"results": {"64": other}}])["results"]["64"]
    assert m["fastest_torch_fp32"] == "torch max-autotune+graph bench fused" and "torch graph bench fused" in m
    assert m["summary"]["interleaved"]["speedup"] == pytest.approx(141 / 30) and m["ours auto"]["us_per_step"] == 31.0
    m = bench.merged([{"results": {"64": other}}, results])["results"]["64"]   # the slower run's pair is not taken
    assert m["summary"]["interleaved"]["speedup"] == pytest.approx(141 / 30)
    assert "| 64 | 30.0 | torch compile+graph bench fused | 150.0 | 5.00x | 30.4 vs 152.0: 5.00x | 28.0 vs 140.0: 5.00x |" \
        in out
    assert "| torch max-autotune bench fused | failed | failed |" in out
    assert "| torch eager nobench foreach | 400.0 | 400.0 |" in out
    assert "Epoch of 60,000 images at batch 64 (fashion): ours 0.050 s, torch compile+graph bench fused (float32, " \
           "TF32 off) 0.200 s: 4.0x" in out


def test_a_recorded_row_names_the_command_without_where_its_results_file_went():
    assert bench.recorded_command(["--batch", "1", "64", "--json", "/root/out/b.json", "--record", "s.json"]) == \
        "python3 scripts/bench.py --batch 1 64 --record s.json"
    assert bench.recorded_command(["--json=/x/b.json", "--variants", "ours auto"]) == \
        "python3 scripts/bench.py --variants 'ours auto'"


def test_the_flags_default_to_the_quick_forms_and_a_results_file():
    args = bench.parser().parse_args([])
    assert args.torch_forms == ["quick"] and args.json == "bench.json" and args.tf32 and 128 in args.batch
    assert bench.parser().parse_args(["--torch-forms", "all", "--no-tf32"]).torch_forms == ["all"]
    with pytest.raises(ValueError, match="matches no form"):
        bench.main(["--torch-forms", "nothing/*/*", "--json", "/nonexistent/x.json"])


# ------------------------------------------------------------------ many models at once (scripts/sweep_bench.py)

@pytest.mark.parametrize("kind", ["func", "grouped"])
def test_each_pytorch_ensemble_trains_every_model_as_its_lone_sgd_does(kind):
    """PyTorch's ensembles (scripts/torch_ensembles.py), in float64 on the CPU: three steps of K models, each
    its own batches and learning rate, equal K lone torch.optim.SGD runs (Nesterov, weight decay) on a
    label-smoothed cross-entropy to rounding."""
    import copy

    import torch
    import torch.nn.functional as F

    import torch_ensembles
    from torch_lenet import TorchLeNet

    torch.manual_seed(0)
    K, B, kw = 3, 5, {"momentum": 0.9, "weight_decay": 5e-4, "nesterov": True}
    lone = [TorchLeNet().double() for _ in range(K)]
    lr = torch.tensor([0.05, 0.1, 0.15], dtype=torch.float64)
    ens = torch_ensembles.make(kind, [copy.deepcopy(m) for m in lone], lr, label_smoothing=0.05, **kw)
    opts = [torch.optim.SGD(m.parameters(), lr=float(a), **kw) for m, a in zip(lone, lr)]
    for _ in range(3):
        x, y = torch.randn(K, B, 28, 28, dtype=torch.float64), torch.randint(0, 10, (K, B))
        ens.step(x, y)
        for k in range(K):
            opts[k].zero_grad()
            F.cross_entropy(lone[k](x[k].unsqueeze(1)), y[k], label_smoothing=0.05).backward()
            opts[k].step()
    for k, got in enumerate(ens.models()):
        for name, want in lone[k].state_dict().items():
            err = float((got.state_dict()[name] - want).abs().max() / want.abs().max())
            assert err < 1e-12, (kind, k, name, err)


def test_both_sides_of_the_sweep_bench_train_alike_and_the_fastest_pytorch_form_is_the_yardstick():
    import sweep_bench as sb

    cs = sb.configs(4)
    assert [c.lr for c in cs] == sb.lrs(4) == pytest.approx([0.05, 0.05 + 0.1 / 3, 0.05 + 0.2 / 3, 0.15])
    for c in cs:
        assert (c.momentum, c.nesterov, c.weight_decay, c.label_smoothing) == \
            tuple(sb.SETTINGS[k] for k in ("momentum", "nesterov", "weight_decay", "label_smoothing"))
        assert (c.schedule, c.warmup_epochs, c.shift, c.flip, c.ema, c.batch_size) == ("constant", 0, 0, False, None, 128)
    assert sb.torch_forms(1, ["func", "grouped"]) == ["plain", "func", "grouped"]
    assert sb.torch_forms(16, ["func", "grouped"]) == ["func", "grouped"]
    row = sb.row_of(16, 400e-6, {"func": {"s_per_step": 1.2e-3}, "grouped": {"s_per_step": 0.8e-3},
                                 "plain": {"error": "RuntimeError: x"}})
    assert row["fastest_torch"] == "grouped" and row["speedup"] == pytest.approx(2.0)
    line = sb.table_line(row)
    assert line.startswith("| 16 | 400.0 | 5.12 |") and "| grouped | 800.0 |" in line and "| 2.00x |" in line
    assert "func 1200.0, grouped 800.0, plain failed |" in line
    assert sb.parser().parse_args([]).torch == ["func", "grouped"]
    assert sb.parser().parse_args(["--no-torch"]).torch == []


# ------------------------------------------------------------------ the PyTorch trainer (scripts/torch_train.py)

@pytest.fixture
def torch_train(monkeypatch):
    monkeypatch.setenv("LENET_BYTECODE_CACHE", "off")   # its import keeps bytecode for its own process only
    import torch_train

    return torch_train


def test_the_pytorch_trainer_evaluates_with_one_read_of_the_device_per_evaluation(torch_train, monkeypatch):
    """Its test sums stay on the device, batch after batch, and are read once: no host synchronization per
    batch (a float() or int() of a device tensor waits for the GPU); the sums are the batch-by-batch ones."""
    import torch
    import torch.nn.functional as F

    from torch_lenet import TorchLeNet

    torch.manual_seed(0)
    model = TorchLeNet().eval()
    vimg = torch.randint(0, 256, (50, 28, 28), dtype=torch.uint8)
    vlab = torch.randint(0, 10, (50,))
    norm = lambda u8: u8.float().div(255).sub(0.3).div(0.35).unsqueeze(1)  # noqa: E731
    want = {}
    with torch.no_grad():
        for tta in (False, True):
            lg = model(norm(vimg))
            if tta:
                lg = (lg + model(norm(vimg.flip(-1)))) / 2
            want[tta] = (float(F.cross_entropy(lg, vlab, reduction="sum")), int((lg.argmax(1) == vlab).sum()))
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):   # every way to read a tensor on the host
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=original, _n=name: (reads.append(_n), _o(self, *a))[1])
    got = {}
    for tta in (False, True):
        reads.clear()
        got[tta] = torch_train.test_sums(model, vimg, vlab, norm, 7, tta)   # 8 batches
        assert reads == ["tolist"], reads
    monkeypatch.undo()
    for tta in (False, True):
        assert got[tta][0] == pytest.approx(want[tta][0], rel=1e-5) and got[tta][1] == want[tta][1]


def test_the_pytorch_trainer_runs_cudnn_benchmark_unless_told(torch_train):
    assert torch_train.parser().parse_args([]).cudnn_benchmark is True
    assert torch_train.parser().parse_args(["--no-cudnn-benchmark"]).cudnn_benchmark is False


def test_a_batch_times_each_form_alone_then_the_fastest_against_ours_interleaved(monkeypatch):
    """bench_batch's order of work, with stand-ins for the GPU's steps: every form and variant built, timed
    and closed alone (one that fails to build reported, the rest going on), the results saved after each,
    then the fastest PyTorch float32 form rebuilt beside ours auto, and its TF32 twin beside ours --allow-tf32."""
    speed = {"torch eager nobench fused": 300.0, "torch graph bench fused": 120.0, "torch graph bench fused tf32": 90.0,
             "ours auto": 30.0, "ours auto tf32": 25.0, "ours legacy": 70.0}
    built, closed = [], []

    class Fake:
        def __init__(self, name, form=None):
            if name == "torch compile+graph bench fused":
                raise RuntimeError("inductor failed\nsecond line")
            self.name, self.form, self.peak, self.build_s = name, form, 1 << 20, 0.5
            built.append(name)

        def close(self):
            closed.append(self.name)

    class FakeOurs(Fake):
        rows, tensor_bytes, arithmetic = [], 0, "float32"

    monkeypatch.setattr(bench, "TorchStep", lambda form, batch: Fake(form.name, form))
    monkeypatch.setattr(bench, "Ours", FakeOurs)
    monkeypatch.setattr(bench, "ours_makers", lambda batch, algo: {n: (lambda n=n: FakeOurs(n)) for n in
                                                                   ("ours legacy", "ours auto", "ours auto tf32")})
    monkeypatch.setattr(bench, "time_run", lambda v, k: speed[v.name])
    forms = tf.select(["eager/nobench/fused", "graph/bench/fused", "compile+graph/bench/fused"])
    saves = []
    r = bench.bench_batch(64, 3, "heuristic", forms, saved=lambda: saves.append(1))
    assert r["torch compile+graph bench fused"]["error"] == "RuntimeError: inductor failed"
    assert r["fastest_torch_fp32"] == "torch graph bench fused" and len(saves) == 6   # after each of the six
    assert r["torch graph bench fused"]["times_us"] == [120.0] * 3 and r["ours legacy"]["us_per_step"] == 70.0
    assert built[:5] == ["torch eager nobench fused", "torch graph bench fused", "ours legacy", "ours auto",
                         "ours auto tf32"] and closed[:5] == built[:5]    # alone: each closed before the next
    assert built[5:] == ["torch graph bench fused", "ours auto", "torch graph bench fused tf32", "ours auto tf32"]
    assert set(r["head_to_head"]) == set(built[5:]) and sorted(closed[5:]) == sorted(built[5:])
    s = r["summary"]
    assert s["interleaved"]["speedup"] == 4.0 and s["tf32"]["speedup"] == 90.0 / 25.0
    assert s["alone"] == {"ours legacy": 120.0 / 70.0, "ours auto": 4.0}
