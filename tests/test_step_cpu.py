"""The whole training step (Note [a whole step] in lenet/steps.py): who may run it and where, before any GPU work;
its module for sm_90 and its workbench's variants over it, compiled by NVRTC."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _op(models=1, input_grad=False):
    from lenet.network import STAGES

    specs = [SimpleNamespace(spec=s) for s in STAGES]
    if input_grad:
        import dataclasses
        specs[0] = SimpleNamespace(spec=dataclasses.replace(STAGES[0], dx=True, dx_mask=False))
    return SimpleNamespace(kind="step", name="train step", models=models, stages=specs,
                           update=SimpleNamespace(ema=None, ema_decay=None))


@pytest.fixture
def sm90(monkeypatch):
    import lenet.kernels as kernels

    monkeypatch.setattr(kernels, "arch", lambda: 90)


def test_our_engine_offers_the_whole_step_to_one_model_on_sm90_up_to_its_limit(sm90):
    from lenet.engines import Policy, registry
    from lenet.engines.ours import Ours
    from lenet.kernels.step import LIMIT

    ours, op = Ours(), _op()
    for engine in ("auto", "ours"):
        ok, why_not = registry.serving(op, Policy.parse("heuristic", engine=engine))
        assert [e.name for e in ok] == ["ours"], why_not
    offered = {n: [c.name for c in ours.candidates(op, n, None)] for n in range(1, LIMIT + 2)}
    assert offered[1] == offered[16] == ["cluster step"]
    assert offered[32] == ["cluster step", "cluster step, 256 threads"]
    assert offered[40] == ["cluster step, 256 threads", "cluster step, 2 images a cluster"]
    assert offered[56] == ["cluster step, 2 images a cluster"]
    assert offered[64] == ["cluster step, 2 images a cluster, 256 threads"]
    assert offered[LIMIT] == ["cluster step, 2 images a cluster, 256 threads"] and offered[LIMIT + 1] == []
    assert all(offered[n] for n in range(1, LIMIT + 1)), "a batch size up to LIMIT without a form"
    # a stored choice is recalled by its name, where that form is offered at that batch size
    assert ours.recall(op, 32, {"engine": "ours", "name": "cluster step, 256 threads"}, None).name == offered[32][1]
    assert ours.recall(op, 32, {"engine": "ours", "name": "cluster step, 2 images a cluster"}, None) is None
    assert ours.recall(op, LIMIT + 1, {"engine": "ours", "name": "cluster step"}, None) is None


@pytest.mark.parametrize("case, why", [
    ("pack", "runs one model, not a pack"),
    ("input_grad", "does not compute the images' gradient"),
    ("pinned", "--algo fixes a stage's candidate"),
    ("legacy", "engine legacy runs"),
    ("graph", "engine graph runs"),
    ("unfused", "fusion is off"),
    ("chunk", "--chunk fixes cuDNN's calls"),
])
def test_the_whole_step_is_refused_where_it_cannot_run_and_the_chain_runs(sm90, case, why):
    from lenet.engines import Policy, registry

    op = _op(models=3 if case == "pack" else 1, input_grad=case == "input_grad")
    policy = {"pinned": Policy.parse("fused-fwd-v1-i1-g8", engine="ours"),
              "legacy": Policy.parse("heuristic", engine="legacy"), "graph": Policy.parse("heuristic", engine="graph"),
              "unfused": Policy.parse("heuristic", engine="auto", fused=False),
              "chunk": Policy.parse("heuristic", engine="auto", chunk=16)}.get(case, Policy.parse("heuristic"))
    ok, why_not = registry.serving(op, policy)
    assert ok == [] and why in why_not["ours"], why_not


def test_below_sm90_the_whole_step_is_refused_naming_clusters(monkeypatch):
    import lenet.kernels as kernels
    from lenet.engines import Policy, registry

    monkeypatch.setattr(kernels, "arch", lambda: 80)
    ok, why_not = registry.serving(_op(), Policy.parse("heuristic"))
    assert ok == [] and "needs thread-block clusters (compute capability 9.0)" in why_not["ours"]
    assert "compiled for 8.0" in why_not["ours"]


def test_the_whole_steps_module_declares_sm90_and_its_launch_shape():
    from lenet import kernels
    from lenet.kernels import step

    m = kernels.declared()["step_cluster"]
    assert m.arch == 90 and m.folder is None
    assert step.shape() == (512, 4 * 11004, 1) and m.smem == (11004, 0)
    assert [step.shape(f.module) for f in step.FORMS] == [(512, 4 * 11004, 1), (256, 4 * 11004, 1), (512, 4 * 15944, 2),
                                                         (256, 4 * 15944, 2)]
    assert all(kernels.declared()[f.module].arch == 90 and kernels.declared()[f.module].file == "step_cluster"
               for f in step.FORMS)
    text = (ROOT / "lenet" / "kernels" / "step_common.cu").read_text()   # the whole step's shared offsets
    for name, off in __import__("lenet.params", fromlist=["OFFSETS"]).OFFSETS.items():
        macro = {"conv1.weight": "OFF_C1W", "conv1.bias": "OFF_C1B", "conv2.weight": "OFF_C2W", "conv2.bias": "OFF_C2B",
                 "fc1.weight": "OFF_F1W", "fc1.bias": "OFF_F1B", "fc2.weight": "OFF_F2W", "fc2.bias": "OFF_F2B"}[name]
        assert f"#define {macro} {off}\n" in text, f"step_common.cu's {macro} is not lenet/params.py's {off}"
    assert f"#define PARAMS_TOTAL {__import__('lenet.params', fromlist=['TOTAL']).TOTAL}\n" in text


def test_the_workbench_variants_are_the_shipped_file_under_other_macros(tmp_path, monkeypatch):
    """dev/step_cluster.cu declares its variants over lenet/kernels/step_cluster.cu (uses=), each with the phase
    clock, and dev/step_cluster_v1.cu the form before Note [four barriers]; three of them compile for sm_90
    with the package's NVRTC machinery."""
    from lenet import kernels
    from lenet.kernels import nvrtc, step

    if 90 not in nvrtc.nvrtc().archs:
        pytest.fail(f"this NVRTC does not compile for sm_90 (it knows {nvrtc.nvrtc().archs})")
    monkeypatch.setenv("LENET_KERNEL_CACHE", str(tmp_path))
    shipped = dict(kernels.declared())
    try:
        mods = kernels.declare(ROOT / "dev" / "step_cluster.cu")
        assert len(mods) >= 8 and all(m.uses[-1] == "step_cluster" and "SC_PROFILE" in m.defines for m in mods)
        text = (ROOT / "lenet" / "kernels" / "step_cluster.cu").read_text()   # its layout's size at G images
        base, extra = map(int, re.search(r"#define SC_SMEM \((\d+) \+ SC_MAXG \* \(SC_IMAGE \+ (\d+)\)\)", text).groups())
        image = int(re.search(r"#define SC_IMAGE (\d+)", text).group(1))
        for m in [*(kernels.declared()[f.module] for f in step.FORMS), *mods]:
            threads, smem, images = step.shape(m.name)
            assert smem == 4 * (base + images * (image + extra)), m.name
        assert step.shape("step_cluster_g4")[2] == 4 and step.shape("step_cluster_g8")[2] == 8
        v1 = kernels.declare(ROOT / "dev" / "step_cluster_v1.cu")
        assert [m.name for m in v1] == ["step_cluster_v1"] and "step_cluster" not in v1[0].uses
        assert step.shape("step_cluster_t256_dev")[0] == 256 and step.shape("step_cluster_v1") == (512, 4 * 24880, 1)
        for name in ("step_cluster_dev", "step_cluster_g4", "step_cluster_g4_t256", "step_cluster_v1"):
            nvrtc.binary(f"dev.{name}", kernels.source(name), kernels.options(name), 90)
    finally:
        kernels.declared().clear()
        kernels.declared().update(shipped)
        step.shape.cache_clear()


def _states(seed=0, momentum=True, ema=True):
    """(before, the chain's after) on the host, as lenet/step_check.py compares them: a step of lr 0.01."""
    import numpy as np

    rng = np.random.default_rng(seed)
    size = 300
    before = {"params": rng.standard_normal(size).astype(np.float32), "ema": rng.standard_normal(size).astype(np.float32)}
    g = rng.standard_normal(size).astype(np.float32)
    v = (0.9 * rng.standard_normal(size) + g).astype(np.float32)
    after = {"grads": g, "params": (before["params"] - np.float32(0.01) * v).astype(np.float32),
             "velocity": v if momentum else None, "logits": rng.standard_normal((4, 10)).astype(np.float32),
             "loss": 2.3, "running": 7.1, "correct": 2}
    after["ema"] = (before["ema"] + np.float32(0.01) * (after["params"] - before["ema"])).astype(np.float32) if ema else None
    return before, after, {"a": (0, 100), "b": (100, 200)}


def test_the_whole_steps_check_passes_the_chains_own_state_and_float32_rounding():
    import copy

    import numpy as np

    from lenet.step_check import compare

    before, ref, tensors = _states()
    assert compare(before, copy.deepcopy(ref), ref, tensors) == (0.0, None)
    mine = copy.deepcopy(ref)
    for key in ("grads", "velocity"):
        mine[key] = (ref[key] * np.float32(1 + 3e-6)).astype(np.float32)   # another summation order
    mine["params"] = np.nextafter(ref["params"], np.float32(np.inf))        # an ulp off every new value
    worst, why = compare(before, mine, ref, tensors)
    assert why is None and 0 < worst, why


@pytest.mark.parametrize("key, change, named", [
    ("grads", 1e-3, "a's gradient"),
    ("velocity", 1e-3, "a's momentum"),
    ("update", 1e-2, "a's change in the update"),      # 1% of the update: 1e-4 of the new values would pass
    ("ema", 1e-2, "a's moving average's change"),
    ("logits", 1e-3, "the logits"),
    ("loss", 1e-3, "the loss"),
    ("running", 1e-3, "the running"),
    ("correct", 1, "right answers"),
])
def test_the_whole_steps_check_fails_each_part_of_the_state_that_is_off(key, change, named):
    import copy

    import numpy as np

    from lenet.step_check import compare

    before, ref, tensors = _states()
    mine = copy.deepcopy(ref)
    if key == "update":
        mine["params"] = (before["params"] + (ref["params"] - before["params"]) * np.float32(1 + change)).astype(np.float32)
    elif key == "ema":
        mine["ema"] = (before["ema"] + (ref["ema"] - before["ema"]) * np.float32(1 + change)).astype(np.float32)
    elif key in ("loss", "running", "correct"):
        mine[key] = ref[key] + change
    else:
        mine[key] = (ref[key] * np.float32(1 + change)).astype(np.float32)
    worst, why = compare(before, mine, ref, tensors)
    assert why is not None and named in why, why


def test_without_momentum_or_an_average_the_check_compares_neither():
    from lenet.step_check import compare

    before, ref, tensors = _states(momentum=False, ema=False)
    mine = dict(ref, velocity=None, ema=None)
    assert compare(before, mine, ref, tensors)[1] is None


def test_our_engine_starts_compiling_the_forms_offered_at_the_programs_batch_sizes(monkeypatch):
    """Ours.warm (at start-up, once the flags give the batch sizes) prefetches the whole step's forms offered at
    them beside the stage kernels, on sm_90 and newer only, and not for a program of packs (lenet sweep) nor under
    a policy that lets no whole step run (--algo fixing a stage's candidate, --chunk, --deterministic)."""
    import lenet.kernels as kernels
    from lenet.engines import ours
    from lenet.kernels import stages

    got = []
    monkeypatch.setattr(ours, "prefetch", lambda names: got.extend(names))
    monkeypatch.setattr(stages, "sm_count", lambda: 132)
    monkeypatch.setattr(kernels, "arch", lambda: 90)
    for batches, want in (((64, 1000), ["step_cluster_g2_t256"]),
                          ((32, 40), ["step_cluster", "step_cluster_t256", "step_cluster_g2"]),
                          ((128, 1000), [])):
        got.clear()
        ours.Ours().warm(batches)
        assert [n for n in got if n.startswith("step_")] == want, batches
        assert "stage_reduce" in got
    got.clear()
    ours.Ours().warm((64, 1000), pack=True)
    assert got and not [n for n in got if n.startswith("step_")]
    from lenet.engines import Policy

    for flags, forms in ((dict(), True), (dict(algo="heuristic"), True), (dict(algo="exhaustive"), True),
                         (dict(algo="fwd=implicit_gemm"), False), (dict(chunk=16), False),
                         (dict(deterministic=True), False)):   # a policy that lets no whole step run: no form
        got.clear()
        policy = Policy.parse(flags.pop("algo", "heuristic"), **flags)
        ours.Ours().warm((64, 1000), policy=policy)
        assert bool([n for n in got if n.startswith("step_")]) is forms, flags
        assert "stage_reduce" in got
    monkeypatch.setattr(kernels, "arch", lambda: 80)
    got.clear()
    ours.Ours().warm((8, 1000))
    assert got and not [n for n in got if n.startswith("step_")]


def test_a_forward_only_operation_names_it_in_its_key_and_the_whole_ones_key_is_the_one_stored_before():
    """Note [forward-only plans] in lenet/ops.py: a stored choice of a stage or head planned forward only is never
    recalled for the whole operation (nor the other way), and a whole one's key is what stores already hold."""
    from lenet.network import STAGES
    from lenet.ops import Head, HeadTensors, Stage, StageTensors, forward_only

    stage = Stage(STAGES[1], StageTensors(*[None] * 7), 128)
    assert stage.key() == STAGES[1].key() and "forward_only" not in stage.key()
    assert forward_only(stage).key() == {**stage.key(), "forward_only": True}
    assert forward_only(stage).tensors is stage.tensors and not stage.forward_only
    w = {"fc1.weight": SimpleNamespace(shape=(120, 256)), "fc2.weight": SimpleNamespace(shape=(10, 120))}
    head = Head(HeadTensors(None, None, None, None, None, None, w, {}, None), None, 128)
    assert head.key() == {"fc1": [120, 256], "fc2": [10, 120]}
    assert forward_only(head).key() == {**head.key(), "forward_only": True}


def test_a_step_planned_forward_only_refuses_to_train_naming_it():
    from lenet.engines.base import forward_only_error
    from lenet.steps import Step

    ran = []
    head = SimpleNamespace(backward=lambda: ran.append("head"), backward_given=lambda: ran.append("head"),
                           forward_loss=lambda: ran.append("forward"))
    step = Step(1000, [], head, None, None, forward_only=True)
    for what in (step.train, step.chain, step.backward, step.backward_given):
        with pytest.raises(RuntimeError, match="the step at batch 1000 was planned forward only"):
            what()
    assert not ran, ran   # refused before any launch
    assert "plan the batch size for training first" in str(forward_only_error("conv1", 7))


def test_a_size_planned_forward_only_is_let_go_when_planned_for_training_and_the_model_told_once(monkeypatch):
    """Plans.plan (Note [forward-only plans] in lenet/ops.py): an evaluation's size planned forward only, then
    for training, keeps one Step, the training one, and calls ``superseded`` once (the model captures its
    evaluation's graph again); a size planned for training first calls nothing; replan keeps each size's form."""
    from lenet.steps import Plans

    made = []

    def make(self, n, forward):
        step = SimpleNamespace(n=n, forward_only=forward, chain=None)
        made.append((n, forward))
        return step
    monkeypatch.setattr(Plans, "_make", make)
    told = []
    plans = Plans(SimpleNamespace(), SimpleNamespace(), 1000, update=None, superseded=lambda: told.append(1))
    evaluation = plans.plan_forward(1000)
    assert evaluation.forward_only and plans.plan_forward(1000) is evaluation and not plans.planned(1000)
    training = plans.plan(1000)
    assert not training.forward_only and plans.planned(1000) and told == [1]
    assert plans.forward_steps == {} and plans.plan_forward(1000) is training and plans.plan(1000) is training
    plans.plan(150)
    plans.plan_forward(45)
    assert told == [1] and made == [(1000, True), (1000, False), (150, False), (45, True)]
    made.clear()
    plans.replan()
    assert sorted(made) == [(45, True), (150, False), (1000, False)] and told == [1]
