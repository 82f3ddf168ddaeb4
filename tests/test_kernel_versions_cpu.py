"""Which stage kernel versions ship (lenet/kernels/stages.py's HEURISTIC; docs/kernels.md, "What ships"):
exactly those a generation's rows take; the others are dev/'s, where each compiles with the package's own
machinery and has its script; a name or a stored choice of a moved version gets one line, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from lenet.kernels import stages as kstages

ROOT = Path(__file__).resolve().parents[1]
MOVED = {"conv1_backward_v1.cu": {"stage1_backward": 1},
         "conv2_backward_v1_v2.cu": {"stage2_backward": 1, "stage2_backward_split": 2},
         "conv2_backward_v6.cu": {"stage2_backward_tensor": 6},
         "conv2_forward_v3.cu": {"stage2_forward_mma_pairs": 3}}


def _stage(name):
    return next(ks for ks in kstages.kernels().values() if ks.stage == name)


def test_a_version_ships_exactly_when_a_generations_rows_take_it():
    """Every stage version declared in lenet/kernels/ is named by some row of some generation (75, 80, 90), and
    every row names a version that ships: a version no row takes belongs in dev/."""
    taken = {(stage, direction, kstages.parse_name(name).version + 1)
             for rows in kstages.HEURISTIC.values() for (stage, direction), row in rows.items() for _, name in row}
    shipped = {(ks.stage, d, m.version) for ks in kstages.kernels().values()
               for d, mods in (("forward", ks.forward), ("backward", ks.backward)) for m in mods}
    assert shipped == taken, (sorted(shipped - taken), sorted(taken - shipped))
    assert [m.version for m in _stage("conv2").backward] == [3, 4, 5, 7, 8]
    assert [m.version for m in _stage("conv1").backward] == [2]
    assert [m.version for m in _stage("conv2").forward] == [1, 2, 4]


@pytest.mark.parametrize("arch,conv2_backward,conv2_forward", [(75, 15, 12), (80, 25, 18), (90, 25, 18)])
def test_exhaustive_times_each_shipped_version_at_every_launch_shape(monkeypatch, arch, conv2_backward, conv2_forward):
    from lenet.kernels import nvrtc

    monkeypatch.setattr(nvrtc, "_arch", lambda: arch)
    monkeypatch.delenv("LENET_KERNEL_ARCH", raising=False)
    shapes = len(kstages.BACKWARD_BLOCKS_PER_SM)
    assert len(_stage("conv2").backward_candidates()) == conv2_backward == shapes * (3 if arch < 80 else 5)
    assert len(_stage("conv1").backward_candidates()) == shapes
    fshapes = len(kstages.FORWARD_BLOCKS_PER_SM)   # versions 1 (1, 2 images), 2 (4, 8) and from 80 4 (4, 8)
    assert len(_stage("conv2").forward_candidates()) == conv2_forward == fshapes * (4 if arch < 80 else 6)
    assert len(_stage("conv1").forward_candidates()) == 9


@pytest.mark.parametrize("name", ["fused-bwd-v1-g4", "fused-bwd-v6-g2", "fused-bwd-v9-g4"])
def test_an_algo_naming_a_version_that_does_not_ship_is_one_line_listing_those_that_do(name):
    from lenet.engines import Policy

    with pytest.raises(ValueError) as e:
        Policy.parse(name)
    msg = str(e.value)
    assert "\n" not in msg and f"--algo {name}: no kernel of ours has that name" in msg, msg
    assert "fused-bwd-v7-gN" in msg and "fused-bwd-v2-gN" in msg and "dev/" in msg, msg


def test_a_stored_choice_of_a_moved_version_is_not_offered_so_it_is_planned_again():
    """lenet/engines/ours.py's recall takes a stored name only where the stage offers it (else the planner
    searches again); and a launch of it is a one-line error, not an index into another version."""
    conv2 = _stage("conv2")
    for gone in ("fused-bwd-v1-g4", "fused-bwd-v2-g4", "fused-bwd-v6-g4"):
        cand = kstages.parse_name(gone)
        assert cand is not None and not conv2.offers(cand)
        with pytest.raises(ValueError, match=f"stage conv2 has no version {cand.version + 1}: "):
            conv2.module(cand)
    for kept, module in (("fused-bwd-v3-g4", "stage2_backward_split4"), ("fused-bwd-v7-g4", "stage2_backward_roles"),
                         ("fused-bwd-v8-g3", "stage2_backward_roles3")):   # stored choices keep their meaning
        assert conv2.offers(kstages.parse_name(kept)) and conv2.module(kstages.parse_name(kept)).name == module
    assert _stage("conv1").module(kstages.parse_name("fused-bwd-v2-g2")).name == "stage1_backward_dense"
    assert not _stage("conv1").offers(kstages.parse_name("fused-bwd-v1-g4"))


def test_each_moved_version_is_in_dev_with_its_script_and_compiles_with_the_packages_machinery(tmp_path, monkeypatch):
    """dev/'s files declare the moved versions (Note [module declarations]); declared there, they join no
    stage of the package (kernels() and stage_modules() are the shipped ones), and each compiles through
    lenet.kernels.nvrtc for the lowest generation it declares."""
    from lenet import kernels
    from lenet.kernels import nvrtc

    monkeypatch.setenv("LENET_KERNEL_CACHE", str(tmp_path))
    shipped = {n: m for n, m in kernels.declared().items()}
    before = kernels.stage_modules()
    assert not set(shipped) & {n for mods in MOVED.values() for n in mods}
    try:
        for cu, want in MOVED.items():
            assert (ROOT / "dev" / cu).is_file() and (ROOT / "dev" / cu.replace(".cu", ".py")).is_file(), cu
            mods = kernels.declare(ROOT / "dev" / cu)
            assert {m.name: m.version for m in mods} == want, cu
            for m in mods:
                assert (ROOT / "dev" / cu).read_text() in kernels.source(m.name) and m.folder == str(ROOT / "dev")
                path = nvrtc.binary(f"lenet.{m.name}", kernels.source(m.name), kernels.options(m.name), m.arch)
                assert path.read_bytes().startswith(b"\x7fELF"), m.name
        moved = {n for mods in MOVED.values() for n in mods}
        assert kernels.stage_modules() == before and not set(kstages.modules()) & moved
        assert all(m.folder is None for ks in kstages.kernels().values() for m in ks.forward + ks.backward)
        with pytest.raises(ValueError, match="already declared"):
            kernels.declare(ROOT / "dev" / "conv2_backward_v6.cu")
    finally:
        kernels.declared().clear()
        kernels.declared().update(shipped)
    assert (ROOT / "dev" / "README.md").is_file() and (ROOT / "dev" / "common.py").is_file()


# Each moved version joins its direction's shipped versions in the workbench (dev/common.py), numbered apart from
# them, and compiles as a pack's module too.
def test_each_moved_version_joins_its_directions_versions_in_the_workbench(tmp_path, monkeypatch):
    import sys

    from lenet import kernels
    from lenet.kernels import nvrtc

    monkeypatch.setenv("LENET_KERNEL_CACHE", str(tmp_path))
    monkeypatch.syspath_prepend(str(ROOT / "dev"))
    shipped = dict(kernels.declared())
    try:
        import common

        for cu, want in MOVED.items():
            stage = "conv1" if next(iter(want)).startswith("stage1") else "conv2"
            ks, mine = common.workbench(cu, stage)
            assert {m.name: m.version for m in mine} == want, cu
            for m in mine:
                versions = [v.version for v in getattr(ks, m.direction)]
                assert m.version in versions and versions == sorted(versions), versions
                path = nvrtc.binary(f"lenet.{m.name}.pack", kernels.source(m.name),
                                    kernels.options(m.name) + ("-DLENET_PACK",), m.arch)
                assert path.read_bytes().startswith(b"\x7fELF"), m.name
            kernels.declared().clear()
            kernels.declared().update(shipped)
    finally:
        kernels.declared().clear()
        kernels.declared().update(shipped)
        sys.modules.pop("common", None)
