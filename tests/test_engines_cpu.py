"""The engine seam without a GPU: the registry and the names it gives the flags, what each engine refuses
and why, the policy's own checks, our kernels' declarations and launch shapes, the planner's loop, and
the errors a user sees before any GPU work."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from descriptors.algorithms import AlgorithmNotSupportedError
from lenet import engines
from lenet.engines import BY_NAME, ENGINES, FLAGS, Policy, registry
from lenet.kernels import stages as kstages
from lenet.ops import Head, Loss, Stage, StageSpec

CONV1 = StageSpec("conv1", (1, 28, 28), (6, 1, 5, 5))
CONV2 = StageSpec("conv2", (6, 12, 12), (16, 6, 5, 5), dx=True)
OURS = BY_NAME["ours"]


@pytest.fixture(autouse=True)
def _an_h100s_kernels(monkeypatch):
    """Our candidates follow the architecture our kernels are compiled for (Note [kernel architecture] in
    lenet/kernels/nvrtc.py): these tests plan for an H100's (90), with or without a GPU here."""
    from lenet.kernels import nvrtc

    monkeypatch.setattr(nvrtc, "_arch", lambda: 90)
    monkeypatch.delenv("LENET_KERNEL_ARCH", raising=False)


def stage(spec=CONV2):
    return Stage(spec, None, 8)


def test_one_registry_names_every_engine():
    assert [e.name for e in ENGINES] == ["ours", "cudnn", "legacy", "graph", "cublaslt"]   # the order of preference
    assert FLAGS == ("auto", "ours", "legacy", "graph")
    for name in FLAGS:
        Policy(engine=name)   # every name the flags offer is a policy
    with pytest.raises(ValueError, match="unknown engine 'ourz'; use one of auto, ours, legacy, graph"):
        Policy(engine="ourz")
    assert {e.name for e in registry.offering("conv")} == {"legacy", "graph"}
    assert [e.name for e in registry.offering("head")] == ["ours", "cublaslt"]
    assert [e.name for e in registry.offering("loss")] == ["ours"] == [e.name for e in registry.offering("update")]


def test_the_registry_says_which_stored_engines_run_cudnn_stages():
    """What start-up asks before it warms cuDNN's first graph (Note [a first graph only where one runs] in
    lenet/startup.py): a stored choice of cuDNN's stage by parts or of either convolution engine."""
    assert all(registry.cudnn_stages({name}) for name in ("cudnn", "legacy", "graph"))
    assert not registry.cudnn_stages({"ours", "cublaslt", "an engine of another version"})
    assert not registry.cudnn_stages(set())


@pytest.mark.parametrize("flag,stages,heads", [("auto", {"ours", "cudnn"}, {"ours", "cublaslt"}),
                                               ("ours", {"ours"}, {"ours"}), ("legacy", {"cudnn"}, {"cublaslt"}),
                                               ("graph", {"cudnn"}, {"cublaslt"})])
def test_which_engines_an_engine_flag_lets_compete(flag, stages, heads):
    p = Policy(engine=flag)
    assert {e.name for e in registry.serving(stage(), p)[0]} == stages
    assert {e.name for e in registry.serving(Head(None, None, 8), p)[0]} == heads
    assert [e.name for e in registry.serving(Loss(None, 8), p)[0]] == ["ours"]   # our kernel under every engine
    assert {e.name for e in registry.serving_parts("conv", None, p)} == \
        {"auto": {"legacy", "graph"}, "ours": set(), "legacy": {"legacy"}, "graph": {"graph"}}[flag]


@pytest.mark.parametrize("policy,needle", [
    (Policy(engine="legacy"), "engine legacy runs cuDNN only"),
    (Policy(fused=False), "fusion is off"),
    (Policy(chunk=16), "--chunk fixes cuDNN's calls"),
    (Policy.parse("fft"), "--algo names cuDNN's fft"),
])
def test_what_our_engine_refuses_and_why(policy, needle):
    assert needle in registry.refusal(OURS, stage(CONV1), policy)   # the flag's rule, then the engine's own


def test_our_kernels_cover_lenets_stages_and_nothing_else():
    assert OURS.refuses(stage(CONV1), Policy()) is None and OURS.refuses(stage(CONV2), Policy()) is None
    other = StageSpec("wide", (3, 32, 32), (8, 3, 5, 5))
    assert "no kernel of ours" in OURS.refuses(stage(other), Policy())
    assert set(kstages.kernels()) == {(CONV1.x, CONV1.w, False), (CONV2.x, CONV2.w, True)}
    from lenet import kernels

    for name in (*kstages.modules(), "head", "head_weights"):
        assert kernels.source(name).count("__global__") >= 1, name


def test_a_kernel_version_is_declared_once_where_its_code_is():
    """Note [module declarations]: every module, its sources, macros, and each stage version's launch facts
    come from the // module lines of the .cu files; the candidates derive from them."""
    from lenet import kernels

    d = kernels.declared()
    assert {"head", "head_weights", "softmax_ce", "sgd", "data", "stage_reduce", "distance"} <= set(d)
    assert d["stage2_backward_split4"].defines == ("S2B_KS=4",) and d["stage2_backward_split4"].threads == 640
    assert d["stage2_forward_tiled"].images == (4, 8) and d["stage2_forward_tiled"].smem_bytes(4) == 4 * (2400 + 864 * 4)
    assert kernels.options("stage2_backward_split4") == ("-std=c++17", "-DS2B_KS=4")
    assert kernels.source("head").index("sce_row") < kernels.source("head").index("head_forward_kernel")
    ks = kstages.kernels()[(CONV2.x, CONV2.w, True)]
    assert [m.version for m in ks.forward] == [1, 2, 4] and [m.version for m in ks.backward] == [3, 4, 5, 7, 8]
    assert d["stage2_backward_balanced"].file == "stage2_backward_dense" and d["stage2_backward_balanced"].threads == 256
    assert d["stage2_backward_dense"].defines == ("S2D_VERSION=4",) and "stage2_backward_tensor" not in d   # version 6: dev/
    roles = d["stage2_backward_roles"]   # version 7: its shared memory is dynamic (smem=A, no images)
    assert roles.version == 7 and roles.smem == (14056, 0) and roles.smem_bytes(0) == 56224
    assert roles.uses == ("stage_common", "tf32", "stage2_tiles") and "s2d_column" in kernels.source("stage2_backward_roles")
    roles3 = d["stage2_backward_roles3"]   # version 8: version 7's source, budgeted for three blocks an SM
    assert roles3.version == 8 and roles3.file == roles.file and roles3.smem == roles.smem and roles3.kernel == "stage2_backward_roles3_kernel"
    assert kernels.options("stage2_backward_roles3") == ("-std=c++17", "-DS2R_VERSION=8") and kernels.options("stage2_backward_roles") == ("-std=c++17",)
    assert (ks.mw, ks.mb) == (2400, 16)
    names = {c.name for c in ks.forward_candidates() + ks.backward_candidates()}
    assert {"fused-fwd-v2-i8-g4", "fused-bwd-v3-g16"} <= names and "fused-fwd-v1-i4-g8" not in names


def test_candidates_are_named_and_the_heuristic_takes_the_first():
    fwd, bwd = OURS.stage_candidates(CONV2, Policy.parse("exhaustive"))
    names = [c.name for c in fwd + bwd]
    assert len(set(names)) == len(names) and "fused-fwd-v1-i1-g8" in names and "fused-bwd-v3-g4" in names and len(bwd) == 25   # 5 versions x 5 shapes
    hf, hb = OURS.stage_candidates(CONV2, Policy())
    assert hf == fwd[:1] and hb == bwd[:1]


class _Planner:
    """What the planner's loop needs of a Planner, without a GPU."""

    def __init__(self, store=None):
        from lenet.plan import Planner

        self.p = Planner.__new__(Planner)
        self.p.decisions, self.p.store, self.p.policy = {}, store, Policy()


class _Store(dict):
    def get(self, key):
        import json
        return super().get(json.dumps(key, sort_keys=True))

    def put(self, key, value):
        import json
        self[json.dumps(key, sort_keys=True)] = value


def test_the_planners_loop_checks_times_picks_stores_and_recalls():
    from lenet.engines.base import Named, Trial

    store, tried = _Store(), []
    cands = [Named("a", "slow"), Named("a", "fast"), Named("b", "wrong"), Named("b", "other")]
    ms = {"slow": 2.0, "fast": 1.0, "other": 1.5}

    def trial(c, best):
        tried.append(c.name)
        return "is far from the reference" if c.name == "wrong" else Trial(c, ms[c.name])
    planner = _Planner(store).p
    key = {"op": "x", "n": 3}
    d = planner.choose(key, cands, trial, encode=lambda d: {"name": d.best.candidate.name})
    assert [t.candidate.name for t in d.table] == ["fast", "other", "slow"] and d.refused == {"b:wrong": "is far from the reference"}
    assert planner.choose(key, cands, trial) is d and tried == ["slow", "fast", "wrong", "other"]   # memo
    again = _Planner(store).p.choose(key, cands, trial, recall=lambda v: Trial(Named("a", v["name"]), None))
    assert again.recalled and again.best.candidate.name == "fast" and len(tried) == 4   # recalled: nothing tried
    tried.clear()
    h = _Planner().p.choose(key, cands, trial, rule="first-per-engine")
    assert tried == ["slow", "wrong", "other"] and [t.candidate.name for t in h.table] == ["other", "slow"]
    tried.clear()
    f = _Planner().p.choose(key, cands, trial, rule="first")
    assert tried == ["slow"] and f.best.candidate.name == "slow"   # timing decides nothing
    with pytest.raises(AlgorithmNotSupportedError, match="no candidate for the thing passed: b:wrong is far"):
        _Planner().p.choose(key, cands[2:3], trial, what="the thing")


@pytest.mark.parametrize("spec,arch,fails,bound", [
    ("heuristic", 90, (), ["ours"]),                       # taken untimed: cuDNN's stage never bound
    ("heuristic", 90, ("ours",), ["ours", "cudnn"]),       # ours offers none that passes: the next engine
    ("exhaustive", 90, (), ["ours", "cudnn"]),              # every engine timed
    ("heuristic", 80, (), ["ours", "cudnn"]),               # a generation without measured rows: timed
    ("heuristic", 75, (), ["ours", "cudnn"]),
])
def test_the_heuristic_takes_the_measured_engine_without_timing_the_others(monkeypatch, spec, arch, fails, bound):
    """Note [the heuristic's engine] in lenet/engines/registry.py: on generation 90 the heuristic plans a stage with
    our kernels alone (cuDNN's stage is bound only where ours offers none that passes); exhaustive, and the
    generations without measured rows, bind and time every engine's."""
    from types import SimpleNamespace

    from lenet.engines.base import PlannedOp
    from lenet.kernels import nvrtc
    from lenet.plan import Planner

    monkeypatch.setattr(nvrtc, "_arch", lambda: arch)
    seen = []

    def bind_of(name):
        def bind(op, n, c, planner):
            seen.append(name)
            if name in fails:
                raise AlgorithmNotSupportedError(f"{name} refused")
            planned = PlannedOp()
            planned.engine = name
            return planned
        return bind
    for name in ("ours", "cudnn"):
        monkeypatch.setattr(BY_NAME[name], "bind", bind_of(name))
    monkeypatch.setattr(Planner, "time_step", lambda self, op, planned: {"ours": 1.0, "cudnn": 3.0}[planned.engine])
    planner = Planner.__new__(Planner)
    planner.policy, planner.store, planner.decisions, planner._losses = Policy.parse(spec), None, {}, {}
    planner.ctx = SimpleNamespace(device_id=0, captured=True, workspace=SimpleNamespace(reserve=lambda b: None))
    chosen = planner.plan(stage(), 8)
    assert seen == bound and chosen.engine == ("cudnn" if fails else "ours")
    assert list(chosen.times) == [f"{e}:{'fused kernels' if e == 'ours' else 'cuDNN by parts'}"
                                  for e in (["ours", "cudnn"] if bound == ["ours", "cudnn"] and not fails else bound[-1:])]


def test_the_start_up_builds_no_first_graph_where_the_heuristic_runs_no_cudnn_stage():
    """What start-up asks with no stored choice (Note [a first graph only where one runs] in lenet/startup.py):
    on generation 90 the heuristic's first search runs our stages alone under --engine auto, unless the flags
    keep our kernels out or ask every engine timed; on generations without measured rows it may run cuDNN's."""
    ask = registry.heuristic_runs_cudnn_stage
    assert not ask("auto", Policy(), 90) and not ask("auto", Policy(), 97)
    assert registry.measured_first("stage", Policy(), 90) == "ours" == registry.measured_first("head", Policy(), 90)
    for policy in (Policy.parse("exhaustive"), Policy(fused=False), Policy(chunk=64), Policy(deterministic=True),
                   Policy.parse("fwd=implicit_gemm")):
        assert ask("auto", policy, 90), policy
    for arch in (75, 80, 86, 89, 100, 120):
        assert ask("auto", Policy(), arch), arch
    assert ask("graph", Policy(), 90) and ask("legacy", Policy(), 90)


def test_no_engine_for_an_operation_is_one_line_naming_each_reason():
    from lenet.plan import Planner

    planner = Planner.__new__(Planner)   # refused before any GPU work: no handle needed
    planner.policy = Policy.parse("fwd=fused-fwd-v1-i1-g8,bwd-filter=fused-bwd-v2-g4", fused=False)
    with pytest.raises(AlgorithmNotSupportedError) as e:
        planner.plan(stage(CONV1), 8)
    msg = str(e.value)
    assert "\n" not in msg and "no engine runs stage conv1" in msg and "ours fusion is off" in msg, msg
    assert "cudnn --algo names fused-fwd-v1-i1-g8, not a cuDNN algorithm" in msg, msg


def test_stage_spec_checks_its_shapes():
    assert CONV1.conv_chw == (6, 24, 24) and CONV1.y == (6, 12, 12) and CONV2.y == (16, 4, 4)
    assert CONV2.conv("bwd-data", 7, "drelu").x_shape == (7, 6, 12, 12)
    with pytest.raises(ValueError, match="same C"):
        StageSpec("bad", (2, 28, 28), (6, 1, 5, 5))
    with pytest.raises(ValueError, match="cannot be pooled"):
        StageSpec("odd", (1, 27, 27), (6, 1, 5, 5))


def test_a_fixed_cudnn_name_with_engine_ours_is_refused_in_one_line():
    with pytest.raises(ValueError, match="engine ours runs no cuDNN convolution; use heuristic, exhaustive or one"):
        Policy.parse("implicit_gemm", engine="ours")


def test_warm_asks_only_the_engines_the_flag_lets_compete(monkeypatch):
    from lenet.engines.base import Engine

    called = []
    for e in ENGINES:
        if type(e).warm is not Engine.warm:   # the engines that warm anything
            monkeypatch.setattr(e, "warm", lambda batches=None, pack=False, policy=None, e=e: called.append(e.name))
    engines.warm("legacy")
    assert called == ["cudnn"]
    called.clear()
    engines.warm("auto")
    assert called == ["ours", "cudnn"]
    called.clear()
    engines.warm("ours")
    assert called == ["ours"]
    assert engines.uses_frontend("auto") and engines.uses_frontend("graph") and not engines.uses_frontend("legacy")


def test_the_policy_key_holds_every_flag_and_the_store_ignores_another_format(tmp_path):
    import json

    from lenet.plancache import PlanCache, environment

    keys = {json.dumps(p.key()) for p in (Policy(), Policy(fused=False), Policy(chunk=1024), Policy(engine="ours"),
                                           Policy.parse("exhaustive"), Policy(deterministic=True),
                                           Policy(allow_tf32=True), Policy(workspace_limit=0))}
    assert len(keys) == 8
    path = tmp_path / "plans.json"
    path.write_text(json.dumps({"format": 1, "entries": {"old": {"chunk": 3}}}))
    said = []
    cache = PlanCache(path, environment("gpu", 13000, "9.19.0", None), warn=said.append)
    assert cache.get({"op": "x"}) is None and not said   # an older format: set aside without a word
    cache.put({"op": "x"}, {"chunk": 1})
    cache.flush()
    assert json.loads(path.read_text())["format"] == 2 and not said


_HELD_FLUSH = """
import json, os, sys, threading
from lenet import files
from lenet.plancache import PlanCache, environment
files.hold_writes()   # a program before its checks passed
path = sys.argv[1]
cache = PlanCache(path, environment("gpu", 13000, "9.19.0", None))
cache.put({"op": "a"}, {"chunk": 1})
cache.flush()
before = os.path.exists(path)
done = threading.Event()


def plan():   # a planning thread that goes on adding while the checks' thread releases the held writes
    for i in range(2000):
        cache.put({"op": i}, {"chunk": i})
        if i % 100 == 0:
            cache.flush()
    done.set()


t = threading.Thread(target=plan)
t.start()
files.checks_passed()
t.join()
cache.flush()
files.wait_for_writes()
print(json.dumps({"before": before, "entries": len(json.loads(open(path).read())["entries"])}))
"""


def test_the_plan_cache_is_written_once_the_checks_passed_and_holds_every_entry(tmp_path):
    """Note [the model beside the data] (lenet/train.py): a model planned beside the program's checks flushes
    its plan cache before they pass; the file is written once they did, on a thread, while the planning thread
    adds more, and the last flush holds every entry."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _HELD_FLUSH, str(tmp_path / "cache" / "plans.json")], env=env,
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert json.loads(out.stdout) == {"before": False, "entries": 2001}


def test_train_step_draws_a_batch_larger_than_the_split_with_replacement(dataset):
    # The README's `train_step --batch-size 65536` on the 60,000 Fashion-MNIST images: no refusal.
    from lenet import train_step
    args = train_step.parser().parse_args(["--data-dir", str(dataset), "--batch-size", "100", "--no-data-cache"])
    x, y, source = train_step.make_batch(args)
    assert x.shape == (100, 1, 28, 28) and y.shape == (100,) and "drawn with replacement from its 40" in source
    again = train_step.make_batch(args)
    assert (again[0] == x).all() and (again[1] == y).all(), "the draws are not seeded"
    args = train_step.parser().parse_args(["--data-dir", str(dataset), "--batch-size", "40", "--no-data-cache"])
    x, y, source = train_step.make_batch(args)
    assert len(set(map(bytes, x.reshape(40, -1)))) == 40 and "seeded permutation" in source


def test_our_candidates_can_be_pinned_by_the_names_train_step_prints():
    engine = OURS
    p = Policy.parse("fused-fwd-v1-i2-g8")
    assert (p.fwd, p.bwd_data, p.bwd_filter) == ("fused-fwd-v1-i2-g8", "heuristic", "heuristic")
    p = Policy.parse("fused-bwd-v5-g16", engine="ours")
    assert (p.fwd, p.bwd_data, p.bwd_filter) == ("heuristic", "fused-bwd-v5-g16", "fused-bwd-v5-g16")
    fwd, bwd = engine.stage_candidates(CONV2, p)
    assert [c.name for c in fwd] == ["fused-fwd-v1-i1-g8"] and [c.name for c in bwd] == ["fused-bwd-v5-g16"]
    auto = Policy.parse("fused-bwd-v5-g16")
    assert engine.refuses(stage(CONV2), auto) is None
    assert "--algo names fused-bwd-v5-g16, not a cuDNN algorithm" in BY_NAME["cudnn"].refuses(stage(CONV2), auto)
    fwd, bwd = engine.stage_candidates(CONV1, Policy.parse("fused-bwd-v2-g16", engine="ours"))   # stage 1 ships v2
    assert [c.name for c in bwd] == ["fused-bwd-v2-g16"]
    with pytest.raises(AlgorithmNotSupportedError, match="stage conv1 has no candidate fused-bwd-v4-g16"):
        engine.stage_candidates(CONV1, Policy.parse("fused-bwd-v4-g16", engine="ours"))
    with pytest.raises(AlgorithmNotSupportedError, match="stage conv2 has no candidate fused-bwd-v2-g16"):
        engine.stage_candidates(CONV2, Policy.parse("fused-bwd-v2-g16", engine="ours"))
    p = Policy.parse("fwd=fused-fwd-v1-i4-g16,bwd-filter=fused-bwd-v2-g2")
    fwd, bwd = engine.stage_candidates(CONV1, p)
    assert [c.name for c in fwd + bwd] == ["fused-fwd-v1-i4-g16", "fused-bwd-v2-g2"]


@pytest.mark.parametrize("spec,kw,needle", [
    ("bwd-filter=fused-fwd-v1-i1-g8", {}, "is a candidate of engine ours for fwd, not bwd-filter"),
    ("fused-fwd-v1-i1-g8", {"engine": "legacy"}, "names a candidate of engine ours, but the engine is legacy"),
    ("fwd=fused-fwd-v1-i1-g8,bwd-filter=algo_1", {}, "names candidates of cuDNN and ours"),
    ("fused-fwd-v1-x1-g8", {}, "unknown algorithm 'fused-fwd-v1-x1-g8'"),
])
def test_a_wrong_pin_is_one_line(spec, kw, needle):
    with pytest.raises(ValueError) as e:
        Policy.parse(spec, **kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_train_step_takes_a_pinned_candidate_before_the_gpu():
    from lenet import cli, train_step
    args = train_step.parser().parse_args(["--algo", "fused-bwd-v2-g4", "--engine", "ours"])
    assert cli.policy_from(args, Policy).bwd_filter == "fused-bwd-v2-g4"


def test_a_model_too_large_for_the_gpu_is_one_line_before_any_allocation():
    from lenet.model import bytes_per_image, check_memory
    gb = 1 << 30
    check_memory(8192, 79 * gb, 80 * gb)    # 8192 images: well within an H100
    with pytest.raises(ValueError) as e:
        check_memory(10_000_000, 79 * gb, 80 * gb)
    msg = str(e.value)
    assert "\n" not in msg and "10,000,000 images needs about" in msg and "79.0 GB free of 80.0 GB" in msg
    assert 40_000 < bytes_per_image() < 60_000   # ~13 KB of buffers and ~37 KB of the engines' own per image
    assert bytes_per_image(Policy(engine="ours")) < 16_000   # no unpooled outputs: cuDNN's stage does not run
    with pytest.raises(ValueError, match="10,000,000 images"):
        check_memory(10_000_000, 79 * gb, 80 * gb, Policy(engine="ours"))


def test_launch_grids(monkeypatch):
    monkeypatch.setattr(kstages, "sm_count", lambda: 132)
    assert kstages.Forward(2, 8).grid(1) == 1 and kstages.Forward(2, 8).grid(7) == 4 and kstages.Forward(1, 8).grid(10**6) == 1056
    assert kstages.Backward(4).grid(1) == 1 and kstages.Backward(4, 1).grid(64) == 64 and kstages.Backward(16).grid(10**6) == 2112
    # a pack's models share one wave, rounded down (Note [one wave for a pack]): 16 x 64 <= 1056, 8 x 64 <= 528
    assert kstages.Forward(1, 8).grid(128, 64) == 16 and kstages.Backward(4).grid(128, 64) == 8
    assert kstages.Backward(2).grid(128, 64) == 4 and kstages.Backward(2).grid(128, 1000) == 1
    assert kstages.parse_name("fused-bwd-v2-g4") == kstages.Backward(4, 1) and kstages.parse_name("fft") is None
    assert kstages.parse_name("fused-fwd-v2-i4-g16") == kstages.Forward(4, 16, 1)
    assert kstages.parse_name("fused-fwd-i4-g16") is None   # a forward's name carries its version


def test_stage2_offers_both_forward_versions_and_stage1_one():
    engine = OURS
    names = [c.name for c in engine.stage_candidates(CONV2, Policy.parse("exhaustive"))[0]]
    assert "fused-fwd-v1-i1-g8" in names and "fused-fwd-v2-i8-g4" in names and "fused-fwd-v2-i1-g8" not in names
    with pytest.raises(AlgorithmNotSupportedError, match="stage conv1 has no candidate fused-fwd-v2-i4-g8"):
        engine.stage_candidates(CONV1, Policy.parse("fused-fwd-v2-i4-g8"))
    assert [c.name for c in engine.stage_candidates(CONV2, Policy.parse("fused-fwd-v2-i4-g8"))[0]] == ["fused-fwd-v2-i4-g8"]


def test_the_heuristic_forward_depends_on_the_batch(monkeypatch):
    """HEURISTIC: two images a block iteration at one image (a one-block step) and from half an image per SM
    to one (a grid of about one block per SM is slow in a step), one otherwise; from 6 images per SM stage 2's
    tensor-core forward (version 4), where it runs (8.0), else its tiled one (version 2)."""
    monkeypatch.setattr(kstages, "sm_count", lambda: 132)
    engine, h = OURS, Policy()
    for spec in (CONV1, CONV2):
        first = {n: engine.stage_candidates(spec, h, n)[0][0].name for n in (1, 2, 65, 66, 131, 132, 791)}
        assert first == {1: "fused-fwd-v1-i2-g8", 2: "fused-fwd-v1-i1-g8", 65: "fused-fwd-v1-i1-g8", 66: "fused-fwd-v1-i2-g8",
                         131: "fused-fwd-v1-i2-g8", 132: "fused-fwd-v1-i1-g8", 791: "fused-fwd-v1-i1-g8"}
    assert [c.name for c in engine.stage_candidates(CONV2, h, 791)[0]] == ["fused-fwd-v1-i1-g8"]
    assert [c.name for c in engine.stage_candidates(CONV2, h, 792)[0]] == ["fused-fwd-v4-i4-g16"]
    from lenet.kernels import nvrtc

    for arch, first in ((75, "fused-fwd-v2-i4-g8"), (80, "fused-fwd-v4-i4-g16")):   # v4 needs 8.0
        monkeypatch.setattr(nvrtc, "_arch", lambda arch=arch: arch)
        monkeypatch.delenv("LENET_KERNEL_ARCH", raising=False)
        assert [c.name for c in engine.stage_candidates(CONV2, h, 8192)[0]] == [first]
    assert [c.name for c in engine.stage_candidates(CONV1, h, 8192)[0]] == ["fused-fwd-v1-i1-g8"]   # one version
    every = engine.stage_candidates(CONV2, Policy.parse("exhaustive"), 8192)[0]
    assert sorted(every, key=str) == sorted(engine.stage_candidates(CONV2, Policy.parse("exhaustive"))[0], key=str)


def _kernel_bodies(text: str) -> dict[str, str]:
    """name -> body of every function in a CUDA source (brace-matched)."""
    import re

    out = {}
    for m in re.finditer(r"\b(\w+)(?:<[^>]*>)?\s*\([^;{()]*\)\s*\{", text):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        out.setdefault(m.group(1), text[m.end():i - 1])
    return out


def test_every_kernel_launched_programmatically_waits_first():
    """Note [programmatic launch]: a kernel of the modules lenet.kernels.launch.Launch starts begins with
    griddep_entry() (itself, or the device function it is a wrapper of): nothing before the wait."""
    import re

    from lenet import kernels

    first = lambda body: body.strip().split(";")[0].strip()   # noqa: E731
    checked = 0
    folder = resources.files("lenet").joinpath("kernels")
    files = ("stage1_forward", "stage2_forward", "stage2_forward_tiled", "stage2_forward_mma", "stage2_backward",
             "stage1_backward_dense", "stage2_backward_dense", "stage_reduce", "head", "head_split", "head_tail", "head_weights",
             "sgd")   # the kernels of these files are launched by Launch
    for module in (*kernels.STAGE_MODULES, "head", "head_split", "head_tail", "head_weights", "sgd"):
        assert kernels.source(module).startswith(folder.joinpath("griddep.cu").read_text())
    for module in files:
        text = folder.joinpath(f"{module}.cu").read_text()
        bodies = _kernel_bodies(text)
        for name in re.findall(r"__global__\s+void\s+(?:__(?:launch_bounds|maxnreg)__\([^)]*\)\s+)?(\w+)", text):
            stmt = first(bodies[name])
            callee = re.match(r"(\w+)(?:<[^>]*>)?\(", stmt)
            ok = stmt == "griddep_entry()" or (callee is not None and first(bodies[callee.group(1)]) == "griddep_entry()")
            assert ok, f"{module}: {name} does not begin with griddep_entry()"
            checked += 1
    assert checked >= 15


def test_launch_packs_arrays_and_numpy_scalars_and_refuses_the_rest():
    import ctypes

    import numpy as np

    from lenet.kernels.launch import _packed

    class Array:   # what Launch reads of a CuPy array: its device pointer
        class data:
            ptr = 0x7F0000001000
    values, pointers = _packed((Array(), np.int32(-3), np.float32(0.5), np.uint64(7)))
    assert [type(v) for v in values] == [ctypes.c_void_p, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64]
    assert [v.value for v in values] == [0x7F0000001000, -3, 0.5, 7]
    assert [pointers[i] for i in range(4)] == [ctypes.addressof(v) for v in values]
    with pytest.raises(TypeError, match="kernel argument of type int: pass a CuPy array or a numpy scalar"):
        _packed((3,))


@pytest.mark.stack
def test_every_module_of_ours_compiles_with_nvrtc_without_a_gpu(tmp_path, monkeypatch):
    """Each module (a stage kernel, one version of stage 2's backward, the head...) is a whole
    translation unit: our compile path (lenet.kernels.nvrtc.binary) builds it alone, for an H100
    (sm_90), on a machine with no GPU at all, into the kernel cache, and each holds the kernels its
    launcher asks for (Note [first run] in lenet/kernels/nvrtc.py)."""
    from lenet.kernels import nvrtc as modules
    from lenet import kernels

    monkeypatch.setenv("LENET_KERNEL_CACHE", str(tmp_path))
    own = {m: [f"{m}_kernel"] for m in kernels.STAGE_MODULES} | {
        "head": ["head_forward_kernel"], "head_weights": ["head_weights_kernel"],
        "head_split": ["head_split_hidden_kernel", "head_split_out_kernel"],
        "head_tail": ["head_tail_kernel", "head_mask_kernel"]}
    split = [k.encode() for ks in own.values() for k in ks]   # kernels each held by exactly one module
    for name in dict.fromkeys((*kernels.STAGE_MODULES, *kernels.COMMON_MODULES, "distance", "head_tail")):
        try:
            path = modules.binary(f"lenet.{name}", kernels.source(name), kernels.options(name), 90)
        except modules.CompileError as e:
            pytest.fail(str(e)[:2000])
        assert path.parent == tmp_path and path.suffix == ".cubin", path
        cubin = path.read_bytes()
        held = [k.decode() for k in split if b"." + k + b"\0" in cubin]   # the ELF's .text.NAME sections
        assert held == own.get(name, []), (name, held)


def test_the_heuristic_backward_depends_on_the_batch(monkeypatch):
    """HEURISTIC in lenet/kernels/stages.py, on 132 SMs: stage 2's tensor-core backward in two warp roles,
    version 7 with 4 blocks per SM below 2 images per SM and 2 up to 32, version 8 (three blocks an SM) from
    32 on; stage 1's dense backward at every batch. The
    first run compiles the modules of the batches it runs; the other versions are in no heuristic's modules:
    only a search times them."""
    monkeypatch.setattr(kstages, "sm_count", lambda: 132)
    ks = kstages.kernels()[(CONV2.x, CONV2.w, True)]
    first = {n: ks.backward_candidates(n)[0].name for n in (1, 64, 263, 264, 4223, 4224, 65536)}
    assert first == {1: "fused-bwd-v7-g4", 64: "fused-bwd-v7-g4", 263: "fused-bwd-v7-g4", 264: "fused-bwd-v7-g2",
                     4223: "fused-bwd-v7-g2", 4224: "fused-bwd-v8-g3", 65536: "fused-bwd-v8-g3"}
    one = kstages.kernels()[(CONV1.x, CONV1.w, False)]
    assert {one.backward_candidates(n)[0].name for n in (1, 128, 8192, 65536)} == {"fused-bwd-v2-g2"}
    assert ks.backward_candidates()[0] == kstages.Backward(4, 2)   # no batch: the versions in order (v3 first)
    assert set(ks.backward_candidates(64)) == set(ks.backward_candidates(8192))   # the same set, reordered
    assert sorted(kstages.HEURISTIC) == [75, 80, 90] and kstages.table(89) is kstages.HEURISTIC[80]
    for gen, rows in kstages.HEURISTIC.items():   # every name a generation's rows give is a shape it runs
        assert set(rows) == {(s, d) for s in ("conv1", "conv2") for d in ("forward", "backward")}, gen
        for (stage, _), row in rows.items():
            assert all(kstages.parse_name(name) is not None for _, name in row) and row[-1][0] == kstages.INF
            k = next(k for k in kstages.kernels().values() if k.stage == stage)
            assert all(k.offers(kstages.parse_name(name)) for _, name in row), stage
            assert all(k.refuses(kstages.parse_name(name), gen) is None for _, name in row), (gen, stage)
    assert "stage1_backward_dense" in kstages.heuristic_modules([128])
    others = {"stage2_backward_split4", "stage2_backward_dense", "stage2_backward_balanced"}   # generation 75's
    for batches in ([1], [64, 128, 200, 1000], [128, 8192], None):
        mods = set(kstages.heuristic_modules(batches))
        assert "stage2_backward_roles" in mods and not others & mods, batches
    assert set(kstages.heuristic_modules([128])) & {"stage2_backward_roles", "stage2_backward_roles3"} == {"stage2_backward_roles"}
    assert set(kstages.heuristic_modules([8192])) & {"stage2_backward_roles", "stage2_backward_roles3"} == {"stage2_backward_roles3"}
    # The forwards: every row up to the largest batch's (stage 2's tensor-core forward from 6 images an SM,
    # 792 images on 132 SMs, where the generation runs it), every row without batch sizes.
    from lenet.kernels import nvrtc

    monkeypatch.setattr(nvrtc, "_arch", lambda: 90)
    assert "stage2_forward_mma" not in kstages.heuristic_modules([64]) + kstages.heuristic_modules([791, 128])
    assert {"stage2_forward_mma", "stage2_forward"} <= set(kstages.heuristic_modules([128, 792]))
    assert "stage2_forward_mma" in kstages.heuristic_modules() and "stage1_forward" in kstages.heuristic_modules([1])
    monkeypatch.setattr(nvrtc, "_arch", lambda: 75)
    assert "stage2_forward_mma" not in kstages.heuristic_modules([128, 1000]) + kstages.heuristic_modules()


def test_one_block_is_a_grid_of_one_at_every_batch(monkeypatch):
    """Backward.one_block: the share that makes a launch one block summing every image (the plan-time
    check's second run, Note [checking a stage])."""
    monkeypatch.setattr(kstages, "sm_count", lambda: 132)
    for cand in (kstages.Backward(2, 6), kstages.Backward(3, 7), kstages.Backward(16, 0)):
        assert {cand.grid(n, cand.one_block()) for n in (1, 256, 65536)} == {1}
        assert cand.grid(256) > 1


def test_the_heads_heuristic_splits_small_batches_and_makes_one_forward_block_per_sm_above(monkeypatch):
    """lenet/kernels/head.py's shapes: up to 256 images the split forward in the smallest slices that make
    at most one slice per 4 SMs; above, head.cu's smallest group that makes at most one block per SM; from
    TAIL_HEURISTIC_MIN images the tail form first (Note [head tail]), head.cu's after it (where cuBLASLt
    cannot run the tail's products)."""
    from lenet.kernels import head

    monkeypatch.setattr(head, "sm_count", lambda: 132)
    got = {n: [(s.form, s.group, s.per) for s in head.shapes(n, True)]
           for n in (1, 33, 64, 66, 67, 132, 133, 256, 257, 264, 265, 511, 512, 1057, 65536)}
    assert got == {1: [("split", 1, 256)], 33: [("split", 1, 256)], 64: [("split", 2, 256)],
                   66: [("split", 2, 256)], 67: [("split", 4, 256)], 132: [("split", 4, 256)],
                   133: [("split", 8, 256)], 256: [("split", 8, 256)], 257: [("tail", 2, 0), ("block", 2, 256)],
                   264: [("tail", 2, 0), ("block", 2, 256)], 265: [("tail", 2, 0), ("block", 4, 256)],
                   511: [("tail", 2, 0), ("block", 4, 256)], 512: [("tail", 2, 0), ("block", 4, 256)],
                   1057: [("tail", 2, 0), ("block", 8, 256)], 65536: [("tail", 2, 0), ("block", 8, 1024)]}
    # a pack: the tail by the pack's images, ours after it by each model's (64 models of 128: 8192)
    assert [(s.form, s.group) for s in head.shapes(128, True, 64)] == [("tail", 2), ("split", 4)]
    assert [(s.form, s.group) for s in head.shapes(128, True, 2)] == [("split", 4)]
    assert [s.form for s in head.shapes(128, False, 2)].count("tail") == 1


def test_a_search_times_every_head_form_where_it_fits(monkeypatch):
    """Every shape once per (form, blocks, ranges); the split forward up to SPLIT_MAX_BATCH images, in at
    most 8 slices per SM (the loss's parts); the tail from TAIL_MIN_BATCH images, once per distinct grid;
    the heuristic's shapes among them."""
    from lenet.kernels import head

    monkeypatch.setattr(head, "sm_count", lambda: 132)
    one = head.shapes(1, False)
    assert [(s.form, s.group, s.per) for s in one] == [("block", 1, 256), ("split", 1, 256)]
    for n in (1, 7, 64, 100, 255, 256, 300, 512, 1056, 1057, 2048, 2049, 65536):
        cands = head.shapes(n, False)
        assert all(s in cands for s in head.shapes(n, True)), n
        assert len({(s.form, head.tail_blocks(n, s.group)) if s.form == "tail" else
                    (s.form, -(-n // s.group), -(-n // s.per)) for s in cands}) == len(cands)
        split = [s for s in cands if s.split]
        assert bool(split) == (n <= head.SPLIT_MAX_BATCH), n
        assert all(-(-n // s.group) <= 8 * 132 for s in split)
        tails = [s.group for s in cands if s.form == "tail"]
        assert tails == ([] if n < 256 else [2] if n <= 8 * 132 else [2, 1]), (n, tails)
    assert head.tail_blocks(1057, 2) == 133 and head.tail_blocks(65536, 2) == 264 and head.tail_blocks(512, 1) == 64
    assert head.tail_blocks(128, 2, 64) == 4 and head.tail_blocks(128, 2, 1000) == 1   # a pack: one wave shared
    assert head.HeadShape("split", 4, 256).name == "fused head split g4 w256"
    assert head.HeadShape("block", 4, 256).name == "fused head g4 w256"
    assert head.HeadShape("tail", 2, 0).name == "fused head tail g2 (fc1 on cuBLASLt)"
    assert head.TAIL_WIDTH == 1354   # db1 (120), 8 padding, dW2 (1200), 16 padding, db2 (10): the flat layout


def test_a_stored_head_shape_is_recalled_only_while_the_policy_offers_it(monkeypatch):
    """A plan cache written under another heuristic (or a shape no longer offered, or of a form this
    version does not know) is searched again, not recalled: Ours.recall takes a stored head shape only if
    it is among the policy's candidates now."""
    from types import SimpleNamespace

    from lenet.engines import Policy
    from lenet.engines.ours import Ours
    from lenet.kernels import head

    import lenet.kernels

    monkeypatch.setattr(head, "sm_count", lambda: 132)
    monkeypatch.setattr(lenet.kernels, "sm_count", lambda: 132)   # sums_as_lone's
    op = SimpleNamespace(kind="head", models=1)
    heuristic = SimpleNamespace(policy=Policy.parse("heuristic"))
    exhaustive = SimpleNamespace(policy=Policy.parse("exhaustive"))
    ours = Ours()
    split = {"form": "split", "group": 2, "per": 256}
    assert ours.recall(op, 64, split, heuristic) == head.HeadShape("split", 2, 256)
    assert ours.recall(op, 64, split, heuristic).engine == "ours"   # a candidate
    assert ours.recall(op, 64, {"form": "block", "group": 1, "per": 256}, heuristic) is None
    assert ours.recall(op, 64, {"form": "block", "group": 1, "per": 256}, exhaustive) == head.HeadShape("block", 1, 256)
    assert ours.recall(op, 64, {"split": True, "group": 2, "per": 256}, exhaustive) is None   # an older store's
    assert ours.recall(op, 64, {"form": "split", "group": 3, "per": 256}, exhaustive) is None
    assert ours.recall(op, 4096, {"form": "split", "group": 16, "per": 256}, exhaustive) is None
    assert ours.recall(op, 8192, {"form": "tail", "group": 2, "per": 0}, heuristic) == head.HeadShape("tail", 2, 0)
    assert ours.recall(op, 8192, {"form": "tail", "group": 1, "per": 0}, heuristic) is None
    assert ours.recall(op, 255, {"form": "tail", "group": 2, "per": 0}, exhaustive) is None
    assert ours.recall(op, 8192, {"form": "fused", "group": 2, "per": 0}, exhaustive) is None
    pack = SimpleNamespace(kind="head", models=64)   # a pack's tail by its images, 64 x 128
    assert ours.recall(pack, 128, {"form": "tail", "group": 2, "per": 0}, heuristic) == head.HeadShape("tail", 2, 0)
    rule = SimpleNamespace(policy=Policy.parse("heuristic", deterministic=True))   # a reproducible rule: no tail
    assert ours.recall(pack, 128, {"form": "tail", "group": 2, "per": 0}, rule) is None
    assert ours.recall(pack, 128, {"form": "split", "group": 4, "per": 256}, rule) == head.HeadShape("split", 4, 256)
    assert ours.recall(op, 8192, {"form": "tail", "group": 2, "per": 0}, rule) is None
    few = SimpleNamespace(kind="head", models=3)   # 3 x 128 sums as its lone runs: the lone run's shapes
    assert ours.recall(few, 128, {"form": "tail", "group": 2, "per": 0}, heuristic) is None
    assert ours.recall(few, 128, {"form": "split", "group": 4, "per": 256}, heuristic) == head.HeadShape("split", 4, 256)
    assert ours.recall(few, 128, {"form": "tail", "group": 2, "per": 0}, exhaustive) is None


def test_a_packs_head_runs_on_our_kernels_or_cublaslt():
    """Our head has pack versions (head_common.cu): it serves a pack beside cuBLASLt's batched matmuls under
    auto, alone under --engine ours; cuDNN's engines take cuBLASLt's."""
    from lenet.engines import Policy, registry
    from lenet.ops import Head

    def serving(policy, models=3):
        return [e.name for e in registry.serving(Head(None, None, 1, models), policy)[0]]
    assert serving(Policy()) == ["ours", "cublaslt"]
    assert serving(Policy(engine="ours")) == serving(Policy(engine="ours"), 1) == ["ours"]
    assert serving(Policy(engine="legacy")) == ["cublaslt"]


def test_a_deterministic_pack_counts_the_partial_rows_of_its_lone_grids():
    """Under --deterministic each model of a pack runs its lone run's grid (Note [a pack and a lone run]):
    the memory check counts a row of partial sums per image; a lone model's figure is unchanged."""
    from lenet.engines import Policy
    from lenet.model import bytes_per_image

    assert bytes_per_image(Policy(deterministic=True), 1) == bytes_per_image(Policy(), 1)
    extra = bytes_per_image(Policy(deterministic=True), 3) - bytes_per_image(Policy(), 3)
    assert extra == 4 * (16 * 6 * 25 + 16 + 6 * 25 + 6)   # conv2's and conv1's (weights + biases) per image


def test_a_pack_sums_as_its_lone_runs_while_it_is_small_and_always_when_deterministic():
    """sums_as_lone (Note [a pack and a lone run] in lenet/pack.py): a lone model always; a pack under
    --deterministic always; otherwise up to LONE_SUMS_PER_SM images per SM of the whole pack."""
    from lenet.engines.base import LONE_SUMS_PER_SM, sums_as_lone

    sms = 132
    assert LONE_SUMS_PER_SM == 4
    assert sums_as_lone(1, 1 << 20, Policy(), sms)
    assert sums_as_lone(3, 128, Policy(), sms) and sums_as_lone(4, 128, Policy(), sms)   # 512 <= 528
    assert sums_as_lone(4, 132, Policy(), sms) and not sums_as_lone(4, 133, Policy(), sms)
    assert not sums_as_lone(16, 128, Policy(), sms) and not sums_as_lone(64, 128, Policy(), sms)
    assert sums_as_lone(64, 128, Policy(deterministic=True), sms)
    assert sums_as_lone(8, 64, Policy(), sms) and not sums_as_lone(8, 64, Policy(), 100)   # the GPU's SMs count


def test_the_relu_bit_is_one_constant_and_the_heads_key_names_an_unmasked_dx():
    """Note [the ReLU bit] in lenet/kernels/stage_common.cu: the check's reference sets the bit the kernels
    define, every stage forward writes it (arg_byte) and every backward reads dp through it (arg_g, arg_q); a
    head whose dx is left to the stage below is planned, and its choice stored, under a key of its own
    (the masked head's key is the one stored before)."""
    import dataclasses
    import re
    import types

    import numpy as np

    from lenet import kernels
    from lenet.engines.reference import ARG_OFF
    from lenet.ops import Head

    common = (kernels.FOLDER / "stage_common.cu").read_text()
    assert int(re.search(r"#define ARG_OFF (\d+)", common).group(1)) == ARG_OFF
    files = {kernels._declared(m).file for m in kernels.STAGE_MODULES}
    for f in files:
        own = (kernels.FOLDER / f"{f}.cu").read_text()
        if "forward" in f:
            assert "arg_byte(" in own and "(unsigned char)q" not in own, f
        elif "backward" in f:
            assert re.search(r"arg_g\(\w+(\[\w+\])?, \w+(\[\w+\])?\)", own) and re.search(r"arg_q\(\w+(\[\w+\])?\)", own), f
    assert {f for f in files if "forward" in f} == {"stage1_forward", "stage2_forward", "stage2_forward_tiled",
                                                   "stage2_forward_mma"}
    w = {"fc1.weight": np.zeros((120, 256), np.float32), "fc2.weight": np.zeros((10, 120), np.float32)}
    head = Head(types.SimpleNamespace(w=w), None, 64)
    assert head.key() == {"fc1": [120, 256], "fc2": [10, 120]}
    assert dataclasses.replace(head, dx_mask=False).key() == {"fc1": [120, 256], "fc2": [10, 120], "dx_mask": False}


def test_a_stage_backward_refuses_an_input_off_a_16_byte_boundary():
    """Stage 2's backward versions 7 and 8 move their input (and version 7 its input gradient, argmax bytes and
    output gradient) 16 bytes at a time: an array that does not start on a 16-byte boundary is refused in one
    line before any launch (the forwards refuse it too)."""
    from types import SimpleNamespace

    ks = kstages.kernels()[(CONV2.x, CONV2.w, True)]
    x = SimpleNamespace(data=SimpleNamespace(ptr=4))
    with pytest.raises(ValueError, match="its input 16 bytes at a time: it must start on a 16-byte boundary"):
        kstages.stage_backward(ks, kstages.Backward(4, 4), 8, None, None, x, None, None, None, None, None, None)
    ok, off = SimpleNamespace(data=SimpleNamespace(ptr=256)), SimpleNamespace(data=SimpleNamespace(ptr=264))
    for name, args in (("input gradient", (ok, None, ok, ok, None, None, off)),   # version 7 also copies arg and
                       ("argmax bytes", (ok, None, off, ok, None, None, ok)),     # dp 16 bytes at a time, and
                       ("output gradient", (ok, None, ok, off, None, None, ok))):  # stores dx as float4s
        with pytest.raises(ValueError, match=f"its {name} 16 bytes at a time"):
            kstages.stage_backward(ks, kstages.Backward(4, 6), 8, None, None, *args)


@pytest.mark.parametrize("arch,sms,want", [
    (75, 40, {1: "fused-bwd-v3-g4", 64: "fused-bwd-v3-g4", 159: "fused-bwd-v3-g4", 160: "fused-bwd-v5-g2",
              10239: "fused-bwd-v5-g2", 10240: "fused-bwd-v5-g4"}),
    (86, 82, {1: "fused-bwd-v7-g4", 64: "fused-bwd-v8-g3", 327: "fused-bwd-v8-g3", 328: "fused-bwd-v7-g2",
              2623: "fused-bwd-v7-g2", 2624: "fused-bwd-v8-g3"}),
    (90, 132, {1: "fused-bwd-v7-g4", 263: "fused-bwd-v7-g4", 264: "fused-bwd-v7-g2", 4224: "fused-bwd-v8-g3"}),
])
def test_each_generation_has_its_rows(monkeypatch, arch, sms, want):
    """A T4 (75, 40 SMs) takes stage 2's backward versions 3-5, which it runs (one image is 0.025 images per
    SM there: past the one-image row, which 132 SMs reach); an RTX 3090 (86, 82 SMs) the rows measured
    without programmatic launch; an H100 its own: the rows in images per SM of each GPU."""
    from lenet.kernels import nvrtc

    monkeypatch.setattr(nvrtc, "_arch", lambda: arch)
    monkeypatch.setattr(kstages, "sm_count", lambda: sms)
    ks = kstages.kernels()[(CONV2.x, CONV2.w, True)]
    assert {n: ks.backward_candidates(n)[0].name for n in want} == want
    runs = {ks.module(c).name for c in ks.backward_candidates()}
    assert ("stage2_backward_roles3" in runs) == (arch >= 80) and "stage2_backward_balanced" in runs
    assert set(kstages.heuristic_modules()) <= {ks.module(c).name for c in ks.backward_candidates()} | {
        m.name for k in kstages.kernels().values() for m in k.forward + k.backward[:2]} | {"stage_reduce"}


def test_a_search_offers_no_workspace_the_gpu_cannot_give():
    """An 8 GB card: a candidate asking for more workspace than 80% of the free memory is left out, named with
    what it needs; the others stay in their order."""
    from types import SimpleNamespace as C

    from lenet.engines.cudnn import within_free_memory

    cands = [("legacy", C(name="fft", workspace_bytes=9 << 30)), ("legacy", C(name="gemm", workspace_bytes=0)),
             ("graph", C(name="plan3", workspace_bytes=6 << 30)), ("graph", C(name="plan7", workspace_bytes=5 << 30))]
    excluded = {}
    kept = within_free_memory(cands, 7 << 30, excluded)
    assert [c.name for _, c in kept] == ["gemm", "plan7"]
    assert set(excluded) == {"fft", "plan3"} and "needs 9,663,676,416 B of workspace" in excluded["fft"]


class _ConvLoop:
    """ConvSearch's loop without a GPU: two convolution engines offering three candidates each, each
    candidate's time per call at a size given by ``ms``, ``bad`` failing its check; every trial counted."""

    def __init__(self, policy=None, bad=()):
        from types import SimpleNamespace

        from descriptors.candidates import Candidate

        self.planner = _Planner().p
        self.planner.policy, self.planner._states = policy or Policy(), {}
        self.planner.ctx = SimpleNamespace(device_id=0, captured=True)
        engines = [SimpleNamespace(name=e, version=lambda: "1") for e in ("legacy", "graph")]
        self.planner.part_engines = lambda kind, part, policy=None: engines
        self.cands = [(e, Candidate(e.name, f"{e.name[0]}{i}", False, 0, True, "fp32")) for e in engines for i in range(3)]
        self.bad, self.tried = set(bad), []

    def offered(self, whole=frozenset()):
        """Every candidate; with ``first_only``, as under the heuristic on cuDNN's graphs: the graph engine's
        first alone but where ``whole`` names it."""
        first = getattr(self, "first_only", False) and "graph" not in whole
        return [(e, c) for e, c in self.cands if not (first and e.name == "graph" and c.name != "g0")]

    def ms(self, size: int, name: str) -> float:
        return size * (1.0 + int(name[1:]) / 10) * (0.9 if name[0] == "g" else 1.0) / (1 + (size == 1024))

    def patch(self, monkeypatch):
        from lenet.engines import cudnn
        from lenet.engines.base import Check, Trial

        def try_(search, spec, c, rec):
            self.tried.append((spec.n, c.name))
            return "is far" if (spec.n, c.name) in self.bad else Trial(c, self.ms(spec.n, c.name), Check(0.0))
        monkeypatch.setattr(cudnn.ConvSearch, "offered", lambda search, s, whole=frozenset(): self.offered(whole))
        monkeypatch.setattr(cudnn.ConvSearch, "_try", try_)
        return self


def _per_size_tables(loop, sizes, rule):
    """What one search per call size tried and found (the loop's nesting before it was one loop)."""
    tried, best = [], {}
    for s in sizes:
        passed = set()
        for _, c in loop.cands:
            if (rule == "first-per-engine" and c.engine in passed) or (rule == "first" and passed):
                continue
            tried.append((s, c.name))
            if (s, c.name) not in loop.bad:
                passed.add(c.engine)
                best[s] = min(best.get(s, float("inf")), loop.ms(s, c.name))
    return tried, best


@pytest.mark.parametrize("algo,rule", [("heuristic", "first-per-engine"), ("exhaustive", "all")])
def test_a_convolution_is_one_loop_over_chunks_and_candidates(monkeypatch, algo, rule):
    from descriptors.candidates import ConvSpec

    loop = _ConvLoop(Policy.parse(algo), bad={(2500, "l0"), (452, "g0"), (1024, "l0"), (1024, "l1")}).patch(monkeypatch)
    spec = ConvSpec("bwd-filter", 2500, (1, 28, 28), (6, 1, 5, 5))
    choice = BY_NAME["cudnn"].conv_choice(loop.planner, spec)
    tried, best = _per_size_tables(loop, [2500, 1024, 452, 2048], rule)
    assert sorted(loop.tried) == sorted(tried) and len(set(loop.tried)) == len(loop.tried)   # each once
    totals = {c: (2500 // c) * best[c] + (best[2500 % c] if 2500 % c else 0.0) for c in (2500, 1024, 2048)}
    chunk = min(totals, key=totals.get)
    assert chunk == 1024 and choice.chunk == chunk and choice.ms == pytest.approx(totals[chunk])
    assert choice.full.ms == best[1024] and choice.rest.ms == best[452] and choice.policy == algo
    assert [(s, k) for s, k, _ in choice.calls()] == [(0, 1024), (1024, 1024), (2048, 452)]
    n = len(loop.tried)   # a batch of 1024 meets the calls of 1024 just tried: nothing is tried again
    assert BY_NAME["cudnn"].conv_choice(loop.planner, spec.at(1024)).full.ms == best[1024] and len(loop.tried) == n
    table = BY_NAME["cudnn"].table(loop.planner, spec.at(1024)).table   # the view of one size's trials
    assert [t.ms for t in table] == sorted(t.ms for t in table) and table[0].ms == best[1024]
    assert BY_NAME["cudnn"].table(loop.planner, spec.at(1024)).table is table and len(loop.tried) == n


def test_a_reproducible_convolution_takes_the_first_that_passes(monkeypatch):
    from descriptors.candidates import ConvSpec

    loop = _ConvLoop(Policy(deterministic=True), bad={(16384, "l0"), (3616, "l0"), (3616, "l1")}).patch(monkeypatch)
    choice = BY_NAME["cudnn"].conv_choice(loop.planner, ConvSpec("fwd", 20000, (1, 28, 28), (6, 1, 5, 5)))
    assert loop.tried == [(16384, "l0"), (16384, "l1"), (3616, "l0"), (3616, "l1"), (3616, "l2")]
    assert (choice.chunk, choice.full.candidate.name, choice.rest.candidate.name) == (16384, "l1", "l2")


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_heuristic_looks_at_a_graphs_whole_list_where_its_first_plan_is_refused(monkeypatch, deterministic):
    """Note [the heuristic's one plan] in descriptors/graph.py: under the heuristic each cuDNN graph offers its
    first plan; where an engine has none that passes (g0 not exact here, and the legacy engine's all too
    under --deterministic), a second look offers the whole lists and tries the plans not yet tried, in order.
    Each candidate is tried once, and a second search at that size (a batch that meets its calls) picks the
    same without trying anything again."""
    from descriptors.candidates import ConvSpec

    legacy_bad = {(64, f"l{i}") for i in range(3)} if deterministic else set()
    loop = _ConvLoop(Policy(deterministic=deterministic), bad={(64, "g0"), (64, "g1")} | legacy_bad).patch(monkeypatch)
    loop.first_only = True
    looks = []
    offered = loop.offered
    loop.offered = lambda whole=frozenset(): looks.append(set(whole)) or offered(whole)
    spec = ConvSpec("fwd", 64, (1, 28, 28), (6, 1, 5, 5))
    table = BY_NAME["cudnn"].table(loop.planner, spec).table
    if deterministic:   # the first that passes: nothing passed in the first look, so every engine looks again
        assert loop.tried == [(64, "l0"), (64, "l1"), (64, "l2"), (64, "g0"), (64, "g1"), (64, "g2")]
        assert looks == [set(), {"legacy", "graph"}] and [t.candidate.name for t in table] == ["g2"]
    else:   # each engine's first that passes: only the graph engine looks again
        assert loop.tried == [(64, "l0"), (64, "g0"), (64, "g1"), (64, "g2")]
        assert looks == [set(), {"graph"}] and sorted(t.candidate.name for t in table) == ["g2", "l0"]
    n = len(loop.tried)
    choice = BY_NAME["cudnn"].conv_choice(loop.planner, spec)
    assert choice.full.candidate.name == ("g2" if deterministic else min(("l0", "g2"), key=lambda c: loop.ms(64, c)))
    assert len(loop.tried) == n and len(looks) == 2


def test_the_second_look_waits_until_the_first_looks_candidates_are_tried(monkeypatch):
    """A chunk size whose remainder cannot be tried (its candidates not offered) has its full calls' candidates
    yielded but never tried: no engine passed there, yet nothing was refused, so no second look is taken (it
    would build every whole list and fix that size's order for later searches); a later search at that size
    tries the first look, and takes the second only for the engine whose first plan is refused."""
    from descriptors.candidates import ConvSpec
    from lenet.engines import cudnn

    loop = _ConvLoop(bad={(1024, "g0")}).patch(monkeypatch)
    loop.first_only = True
    looks = []

    def offered(search, s, whole=None):
        looks.append((s, set(whole or ())))
        if s == 64:
            raise AlgorithmNotSupportedError("nothing fits at 64")
        return loop.offered(whole or frozenset())
    monkeypatch.setattr(cudnn.ConvSearch, "offered", offered)
    spec = ConvSpec("bwd-filter", 2112, (1, 28, 28), (6, 1, 5, 5))   # chunks of 1024 or 2048 leave 64
    choice = BY_NAME["cudnn"].conv_choice(loop.planner, spec)
    assert choice.chunk == 2112 and choice.rest is None
    assert all(not whole for _, whole in looks), looks   # first looks only
    assert not any(s in (1024, 2048) for s, _ in loop.tried)
    BY_NAME["cudnn"].conv_choice(loop.planner, spec.at(1024))
    assert [(s, w) for s, w in looks if w] == [(1024, {"graph"})]
    assert [c for s, c in loop.tried if s == 1024] == ["l0", "g0", "g1"]


@pytest.mark.parametrize("bad,second,picked", [({"F0"}, False, "U0"), ({"F0", "U0"}, True, "F1"),
                                               ({"F0", "U0"}, "raises", None)])
def test_a_reproducible_second_look_follows_cudnns_order_and_stays_chosen(monkeypatch, bad, second, picked):
    """Under --deterministic (the rule "first") on one engine of two graphs, fused (F) and unfused (U), three
    plans each: the first look offers F0 and U0; only where both are refused does the second look offer the
    whole lists, in cuDNN's order (fused first), and the first that passes is taken; a second search at that
    size (the model's shared trials) picks the same without trying anything again. A second look that cannot
    offer anything (nothing fits) leaves the size broken with the first look's refusals."""
    from types import SimpleNamespace

    from descriptors.candidates import Candidate, ConvSpec
    from lenet.engines import cudnn

    loop = _ConvLoop(Policy(deterministic=True), bad={(64, b) for b in bad}).patch(monkeypatch)
    graph = SimpleNamespace(name="graph", version=lambda: "1")
    loop.planner.part_engines = lambda kind, part, policy=None: [graph]
    whole = [(graph, Candidate("graph", f"{g}{i}", g == "F", 0, True, "fp32")) for g in "FU" for i in range(3)]
    looks = []

    def offered(search, s, whole_of=None):
        looks.append(bool(whole_of))
        if whole_of and second == "raises":
            raise AlgorithmNotSupportedError("no graph candidate fits")
        return list(whole) if whole_of else [whole[0], whole[3]]
    monkeypatch.setattr(cudnn.ConvSearch, "offered", lambda search, s, whole=None: offered(search, s, whole))
    spec = ConvSpec("fwd", 64, (1, 28, 28), (6, 1, 5, 5))

    def passing(search):
        out = []
        for c in search.picks(64):
            if not isinstance(search.measure(64, c), str):
                out.append(c.name)
        return out
    got = passing(cudnn.ConvSearch(BY_NAME["cudnn"], loop.planner, spec))
    assert looks == ([False, True] if second else [False])
    if picked is None:
        search = cudnn.ConvSearch(BY_NAME["cudnn"], loop.planner, spec)
        assert got == [] and passing(search) == []
        assert "graph:F0 (fused) is far; graph:U0 is far" in search.broken[64]
        return
    order = ["F0", "U0"] + (["F1"] if second else [])
    assert got == [picked] and [c for _, c in loop.tried] == order
    assert passing(cudnn.ConvSearch(BY_NAME["cudnn"], loop.planner, spec)) == [picked]
    assert [c for _, c in loop.tried] == order and len(looks) == (2 if second else 1)


def test_a_convolution_with_no_candidate_passing_says_why(monkeypatch):
    from descriptors.candidates import ConvSpec

    loop = _ConvLoop(bad={(64, f"{e}{i}") for e in "lg" for i in range(3)}).patch(monkeypatch)
    with pytest.raises(AlgorithmNotSupportedError, match=r"no candidate for fwd .* passed: legacy:l0 is far; legacy:l1 is far"):
        BY_NAME["cudnn"].conv_choice(loop.planner, ConvSpec("fwd", 64, (1, 28, 28), (6, 1, 5, 5)))


def test_a_heads_loss_is_planned_before_the_head_as_its_own_operation(monkeypatch):
    """Note [the head's loss]: planning a head plans its loss first (its own decision, which the model's
    plan of the loss then finds); the cuBLASLt head's bind only takes it from the planner."""
    from types import SimpleNamespace

    from lenet import plan as plan_module
    from lenet.engines.base import PlannedOp
    from lenet.ops import LossTensors

    planner = _Planner().p
    planner.policy, planner._states, planner._losses = Policy(engine="legacy"), {}, {}
    planner.ctx = SimpleNamespace(device_id=0, captured=True, workspace=SimpleNamespace(reserve=lambda b: None))
    bound = []

    def bind(engine, op, n, candidate, planner):
        loss = planner.loss(op, n) if op.kind == "head" else None
        bound.append((engine.name, op.kind, loss.op if loss is not None else None))
        return PlannedOp()
    for name in ("ours", "cublaslt"):
        monkeypatch.setattr(type(BY_NAME[name]), "bind", bind)
    monkeypatch.setattr(plan_module.Planner, "time_step", lambda self, op, planned: 1.0)
    logits = SimpleNamespace(shape=(8, 10))
    loss_t = LossTensors(logits, None, None, None, None, None)
    head = Head(SimpleNamespace(w={"fc1.weight": SimpleNamespace(shape=(120, 256)),
                                   "fc2.weight": SimpleNamespace(shape=(10, 120))}), loss_t, 8)
    chosen = planner.plan(head, 8)
    assert [(e, k) for e, k, _ in bound] == [("ours", "loss"), ("cublaslt", "head")] and chosen.engine == ""
    loss = planner.plan(Loss(loss_t, 8), 8)   # the model's own: the same decision, nothing bound again
    assert bound[1][2] is loss.op and len(bound) == 2
    with pytest.raises(AlgorithmNotSupportedError, match="was not planned before it"):
        planner.loss(head, 16)


def _pool_reference_by_windows(c, dy_raw):
    """pool_reference as it was first written (Note [the pooling on the host]): each window's four values on a
    last axis of a transposed copy, np.argmax, the two largest by maxima and minima over that axis (a sort's
    last two, the same values), the routing's product over it."""
    import numpy as np

    m, k, h, ww = c.shape
    win = c.reshape(m, k, h // 2, 2, ww // 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(m, k, h // 2, ww // 2, 4)
    arg = win.argmax(axis=-1).astype(np.uint8)
    a, b, cc, d = (win[..., q] for q in range(4))
    hi1, lo1, hi2, lo2 = np.maximum(a, b), np.minimum(a, b), np.maximum(cc, d), np.minimum(cc, d)
    top, second = np.maximum(hi1, hi2), np.maximum(np.minimum(hi1, hi2), np.maximum(lo1, lo2))
    ordered = np.sort(win, axis=-1)
    assert np.array_equal(top, ordered[..., 3]) and np.array_equal(second, ordered[..., 2])   # as values
    flat = (win == win[..., :1]).all(axis=-1) & (top > 0)
    dy = (dy_raw * (top > 0)).astype(np.float32)
    routed = (np.arange(4, dtype=np.uint8) == arg[..., None]) * dy[..., None]
    dc = np.ascontiguousarray(routed.reshape(m, k, h // 2, ww // 2, 2, 2).transpose(0, 1, 2, 4, 3, 5)
                              .reshape(m, k, h, ww), dtype=np.float32)
    return np.maximum(top, np.float32(0)), arg, top, second, flat, dy, dc


@pytest.mark.parametrize("case", ["normal", "quantized", "constant", "zeros and signs"])
def test_the_host_pooling_is_the_window_forms_bit_for_bit(case):
    """Note [the pooling on the host] (lenet/engines/reference.py): the reference's pooling over four strided
    views gives every array the window form gave, bit for bit (-0.0 where a routed gradient is 0 * a negative
    one), on what real data holds: exact ties at every level, constant windows, zeros of both signs, all at
    once; first maxima taken in the kernels' order."""
    import numpy as np

    from lenet.engines.reference import pool_reference

    rng = np.random.default_rng(7)
    shape = (9, 3, 8, 12)
    c = rng.standard_normal(shape, dtype=np.float32)
    if case == "quantized":   # few levels: most windows hold a tie somewhere, some at their maximum
        c = (rng.integers(-2, 3, shape) / np.float32(4)).astype(np.float32)
    elif case == "constant":   # constant windows at a level above, at and below zero, and constant rows
        c = np.repeat(np.repeat(rng.integers(-1, 2, (9, 3, 4, 6)).astype(np.float32), 2, axis=2), 2, axis=3)
        c[:, 0, 0, :] = 0.5
    elif case == "zeros and signs":
        c = rng.choice(np.array([0.0, -0.0, 1.0, -1.0, 2.0], np.float32), shape)
    dy_raw = rng.standard_normal((9, 3, 4, 6), dtype=np.float32)
    dy_raw[0, 0, 0, :] = -0.0
    got, want = pool_reference(c, dy_raw), _pool_reference_by_windows(c, dy_raw)
    for name, g, w in zip(("y", "arg", "top", "second", "flat", "dy", "dc"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert np.array_equal(g, w), name
        if g.dtype == np.float32:
            assert np.array_equal(np.signbit(g), np.signbit(w)), name   # -0.0 where the window form has it
    assert got[1].max() > 0 and got[4].any() == (case in ("constant", "quantized", "zeros and signs"))
