"""The stage seam without a GPU: the engine registry and the names it gives the flags, what each
engine refuses and why, the stage's own checks, and the errors a user sees before any GPU work."""

from __future__ import annotations

from importlib import resources

import pytest

from descriptors import AlgoPolicy
from descriptors.algorithms import AlgorithmNotSupportedError, engine_names
from lenet import stages
from lenet.ops.context import PlanContext
from lenet.stages import ENGINES, Stage, StageSpec, StageTensors, ours

CONV1 = StageSpec("conv1", (1, 28, 28), (6, 1, 5, 5))
CONV2 = StageSpec("conv2", (6, 12, 12), (16, 6, 5, 5), dx=True)


def ctx(policy=None, fused=True):
    return PlanContext(handle=None, policy=policy or AlgoPolicy(), search=None, workspace=None, blas=None, ones=None,
                       lt=None, pool=None, relu=None, side=None, fused=fused, captured=True)


def test_one_registry_names_every_engine():
    assert list(ENGINES) == ["ours", "cudnn"]   # the order of preference where timing decides nothing
    assert set(engine_names()) == {"auto", "legacy", "graph", "ours"}
    assert {n for n in engine_names() if n != "auto"} - {"legacy", "graph"} == set(ENGINES) - {"cudnn"}
    for name in engine_names():
        AlgoPolicy(engine=name)   # every name the flags offer is a policy
    with pytest.raises(ValueError, match="unknown engine 'ourz'; use one of auto, legacy, graph, ours"):
        AlgoPolicy(engine="ourz")


@pytest.mark.parametrize("engine,serving", [("auto", {"ours", "cudnn"}), ("ours", {"ours"}), ("legacy", {"cudnn"}),
                                            ("graph", {"cudnn"})])
def test_which_engines_an_engine_flag_lets_compete(engine, serving):
    assert {e.name for e in ENGINES.values() if e.serves(engine)} == serving
    assert {e.name for e in ENGINES.values() if e.refuses(CONV2, ctx(AlgoPolicy(engine=engine))) is None} == serving


@pytest.mark.parametrize("policy,fused,needle", [
    (AlgoPolicy(engine="legacy"), True, "engine legacy runs cuDNN only"),
    (AlgoPolicy(engine="ours"), False, "fusion is off"),
    (AlgoPolicy(chunk=16), True, "--chunk fixes cuDNN's calls"),
    (AlgoPolicy.parse("fft"), True, "--algo names cuDNN's fft"),
])
def test_what_our_engine_refuses_and_why(policy, fused, needle):
    assert needle in ENGINES["ours"].refuses(CONV1, ctx(policy, fused))


def test_our_kernels_cover_lenets_stages_and_nothing_else():
    assert ENGINES["ours"].refuses(CONV1, ctx()) is None and ENGINES["ours"].refuses(CONV2, ctx()) is None
    other = StageSpec("wide", (3, 32, 32), (8, 3, 5, 5))
    assert "no kernel of ours" in ENGINES["ours"].refuses(other, ctx())
    assert set(ours.KERNELS) == {(CONV1.x, CONV1.w, False), (CONV2.x, CONV2.w, True)}
    from lenet import kernels

    for name in (*ours.modules(), "head", "head_weights"):
        assert kernels.source(name).count("__global__") >= 1, name


def test_candidates_are_named_and_the_heuristic_takes_the_first():
    engine = ENGINES["ours"]
    fwd, bwd = engine.candidates(CONV2, AlgoPolicy.parse("exhaustive"))
    names = [c.name for c in fwd + bwd]
    assert len(set(names)) == len(names) and "fused-fwd-v1-i1-g8" in names and "fused-bwd-v2-g4" in names
    hf, hb = engine.candidates(CONV2, AlgoPolicy())
    assert hf == fwd[:1] and hb == bwd[:1]


def test_no_engine_for_a_stage_is_one_line_naming_each_reason():
    stage = Stage(CONV1, StageTensors(*(None,) * 7), max_batch=8)
    with pytest.raises(AlgorithmNotSupportedError) as e:
        stage.plan(ctx(AlgoPolicy(engine="ours"), fused=False), 8)
    msg = str(e.value)
    assert "\n" not in msg and "ours fusion is off" in msg and "cudnn engine ours runs no cuDNN convolution" in msg


def test_stage_spec_checks_its_shapes():
    assert CONV1.conv_chw == (6, 24, 24) and CONV1.y == (6, 12, 12) and CONV2.y == (16, 4, 4)
    assert CONV2.conv("bwd-data", 7, "drelu").x_shape == (7, 6, 12, 12)
    with pytest.raises(ValueError, match="same C"):
        StageSpec("bad", (2, 28, 28), (6, 1, 5, 5))
    with pytest.raises(ValueError, match="cannot be pooled"):
        StageSpec("odd", (1, 27, 27), (6, 1, 5, 5))


def test_a_fixed_cudnn_name_with_engine_ours_is_refused_in_one_line():
    with pytest.raises(ValueError, match="engine ours runs no cuDNN convolution; use heuristic, exhaustive or one"):
        AlgoPolicy.parse("implicit_gemm", engine="ours")


def test_warm_asks_only_the_engines_the_flag_lets_compete(monkeypatch):
    called = []
    for e in ENGINES.values():
        monkeypatch.setattr(e, "warm", lambda batches=None, e=e: called.append(e.name))
    stages.warm("legacy")
    assert called == ["cudnn"]
    called.clear()
    stages.warm("auto")
    assert called == ["ours", "cudnn"]


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
    engine = ENGINES["ours"]
    p = AlgoPolicy.parse("fused-fwd-v1-i2-g8")
    assert (p.fwd, p.bwd_data, p.bwd_filter) == ("fused-fwd-v1-i2-g8", "heuristic", "heuristic")
    p = AlgoPolicy.parse("fused-bwd-v2-g16", engine="ours")
    assert (p.fwd, p.bwd_data, p.bwd_filter) == ("heuristic", "fused-bwd-v2-g16", "fused-bwd-v2-g16")
    fwd, bwd = engine.candidates(CONV2, p)
    assert [c.name for c in fwd] == ["fused-fwd-v1-i1-g8"] and [c.name for c in bwd] == ["fused-bwd-v2-g16"]
    auto = AlgoPolicy.parse("fused-bwd-v2-g16")
    assert engine.refuses(CONV2, ctx(auto)) is None
    assert "--algo names fused-bwd-v2-g16, not a cuDNN algorithm" in ENGINES["cudnn"].refuses(CONV2, ctx(auto))
    with pytest.raises(AlgorithmNotSupportedError, match="stage conv1 has no candidate fused-bwd-v2-g16"):
        engine.candidates(CONV1, p)   # stage 1's backward has one version
    p = AlgoPolicy.parse("fwd=fused-fwd-v1-i4-g16,bwd-filter=fused-bwd-v1-g2")
    fwd, bwd = engine.candidates(CONV1, p)
    assert [c.name for c in fwd + bwd] == ["fused-fwd-v1-i4-g16", "fused-bwd-v1-g2"]


@pytest.mark.parametrize("spec,kw,needle", [
    ("bwd-filter=fused-fwd-v1-i1-g8", {}, "is a candidate of engine ours for fwd, not bwd-filter"),
    ("fused-fwd-v1-i1-g8", {"engine": "legacy"}, "names a candidate of engine ours, but the engine is legacy"),
    ("fwd=fused-fwd-v1-i1-g8,bwd-filter=algo_1", {}, "names candidates of cuDNN and ours"),
    ("fused-fwd-v1-x1-g8", {}, "unknown algorithm 'fused-fwd-v1-x1-g8'"),
])
def test_a_wrong_pin_is_one_line(spec, kw, needle):
    with pytest.raises(ValueError) as e:
        AlgoPolicy.parse(spec, **kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_train_step_takes_a_pinned_candidate_before_the_gpu():
    from lenet import cli, train_step
    args = train_step.parser().parse_args(["--algo", "fused-bwd-v2-g4", "--engine", "ours"])
    assert cli.policy_from(args).bwd_filter == "fused-bwd-v2-g4"


def test_a_model_too_large_for_the_gpu_is_one_line_before_any_allocation():
    from lenet.model import BYTES_PER_IMAGE, check_memory
    gb = 1 << 30
    check_memory(8192, 79 * gb, 80 * gb)    # 8192 images: well within an H100
    with pytest.raises(ValueError) as e:
        check_memory(10_000_000, 79 * gb, 80 * gb)
    msg = str(e.value)
    assert "\n" not in msg and "10,000,000 images needs about" in msg and "79.0 GB free of 80.0 GB" in msg
    assert 40_000 < BYTES_PER_IMAGE < 60_000   # ~13 KB of buffers and ~37 KB of the engines' own per image


def test_launch_grids(monkeypatch):
    monkeypatch.setattr(ours, "_sms", lambda: 132)
    assert ours.Forward(2, 8).grid(1) == 1 and ours.Forward(2, 8).grid(7) == 4 and ours.Forward(1, 8).grid(10**6) == 1056
    assert ours.Backward(4).grid(1) == 1 and ours.Backward(4, 1).grid(64) == 64 and ours.Backward(16).grid(10**6) == 2112
    assert ours.parse_name("fused-bwd-v2-g4") == ours.Backward(4, 1) and ours.parse_name("fft") is None
    assert ours.parse_name("fused-fwd-v2-i4-g16") == ours.Forward(4, 16, 1)
    assert ours.parse_name("fused-fwd-i4-g16") is None   # a forward's name carries its version


def test_stage2_offers_both_forward_versions_and_stage1_one():
    engine = ENGINES["ours"]
    names = [c.name for c in engine.candidates(CONV2, AlgoPolicy.parse("exhaustive"))[0]]
    assert "fused-fwd-v1-i1-g8" in names and "fused-fwd-v2-i8-g4" in names and "fused-fwd-v2-i1-g8" not in names
    with pytest.raises(AlgorithmNotSupportedError, match="stage conv1 has no candidate fused-fwd-v2-i4-g8"):
        engine.candidates(CONV1, AlgoPolicy.parse("fused-fwd-v2-i4-g8"))
    assert [c.name for c in engine.candidates(CONV2, AlgoPolicy.parse("fused-fwd-v2-i4-g8"))[0]] == ["fused-fwd-v2-i4-g8"]


def test_the_heuristic_forward_depends_on_the_batch(monkeypatch):
    monkeypatch.setattr(ours, "_sms", lambda: 132)
    engine, h = ENGINES["ours"], AlgoPolicy()
    assert [c.name for c in engine.candidates(CONV2, h, 791)[0]] == ["fused-fwd-v1-i1-g8"]
    assert [c.name for c in engine.candidates(CONV2, h, 792)[0]] == ["fused-fwd-v2-i4-g8"]
    assert [c.name for c in engine.candidates(CONV1, h, 8192)[0]] == ["fused-fwd-v1-i1-g8"]   # one version
    every = engine.candidates(CONV2, AlgoPolicy.parse("exhaustive"), 8192)[0]
    assert sorted(every, key=str) == sorted(engine.candidates(CONV2, AlgoPolicy.parse("exhaustive"))[0], key=str)


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
    files = ("stage1_forward", "stage2_forward", "stage2_forward_tiled", "stage1_backward", "stage2_backward",
             "stage_reduce", "head", "head_weights", "sgd")   # the kernels of these files are launched by Launch
    for module in (*kernels.STAGE_MODULES, "head", "head_weights", "sgd"):
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
    assert checked >= 9


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
    translation unit: our compile path (descriptors.modules.binary) builds it alone, for an H100
    (sm_90), on a machine with no GPU at all, into the kernel cache, and each holds the kernels its
    launcher asks for (Note [first run] in descriptors/modules.py)."""
    from descriptors import modules
    from lenet import kernels

    monkeypatch.setenv("LENET_KERNEL_CACHE", str(tmp_path))
    own = {m: f"{m}_kernel" for m in kernels.STAGE_MODULES} | {"head": "head_forward_kernel",
                                                              "head_weights": "head_weights_kernel"}
    split = [k.encode() for k in own.values()]   # kernels each held by exactly one module
    for name in dict.fromkeys((*kernels.STAGE_MODULES, *kernels.COMMON_MODULES)):
        try:
            path = modules.binary(f"lenet.{name}", kernels.source(name), kernels.options(name), 90)
        except modules.CompileError as e:
            pytest.fail(str(e)[:2000])
        assert path.parent == tmp_path and path.suffix == ".cubin", path
        cubin = path.read_bytes()
        held = [k.decode() for k in split if b"." + k + b"\0" in cubin]   # the ELF's .text.NAME sections
        assert held == ([own[name]] if name in own else []), (name, held)


def test_the_heuristic_backward_depends_on_the_batch(monkeypatch):
    """SMALL_BATCH_PER_SM: up to 2 images per SM, stage 2's backward split over four parts comes first
    (and is the module a first run compiles for the step); above it, the two-part version. The
    one-part version (the slowest compile) is in no heuristic's modules: only a search times it."""
    monkeypatch.setattr(ours, "_sms", lambda: 132)
    ks = ours.KERNELS[(CONV2.x, CONV2.w, True)]
    assert ks.backward_candidates(64)[0] == ours.Backward(4, 2) and ks.backward_candidates(264)[0].version == 2
    assert ks.backward_candidates(265)[0] == ours.Backward(4, 1) == ks.backward_candidates(65536)[0]
    assert ks.backward_candidates()[0] == ours.Backward(4, 0)   # no batch: the versions in order
    assert set(ks.backward_candidates(64)) == set(ks.backward_candidates(8192))   # the same set, reordered
    assert "stage2_backward_split4" in ours.heuristic_modules([64]) and "stage2_backward_split" not in ours.heuristic_modules([64])
    for batches in ([128, 1000], [8192], None):
        assert "stage2_backward" not in ours.heuristic_modules(batches)
    assert "stage2_backward_split" in ours.heuristic_modules([128, 1000])
