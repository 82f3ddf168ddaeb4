"""Our compile path without a GPU (lenet/kernels/nvrtc.py, Note [first run]): NVRTC through ctypes,
the kernel cache's location, reuse, repair and pruning, the PTX fallback for a GPU newer than NVRTC,
and a compile error's message."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.stack
ROOT = Path(__file__).resolve().parents[1]

SOURCE = 'extern "C" __global__ void twice_kernel(float* x, int n) { int i = threadIdx.x; if (i < n) x[i] *= 2.f; }\n'


@pytest.fixture
def modules(tmp_path, monkeypatch):
    from lenet.kernels import nvrtc as modules

    monkeypatch.delenv("LENET_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return modules


def test_the_cache_follows_the_environment(modules, tmp_path, monkeypatch):
    assert modules.cache_folder() == tmp_path / "xdg" / "lenet" / "kernels"
    monkeypatch.setenv("LENET_KERNEL_CACHE", str(tmp_path / "mine"))
    assert modules.cache_folder() == tmp_path / "mine"
    monkeypatch.delenv("LENET_KERNEL_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert modules.cache_folder() is None, "a HOME that does not exist was made"   # Note [cache folders]
    assert not (tmp_path / "home").exists()
    (tmp_path / "home").mkdir()
    from lenet import files
    files._root.clear()   # decided once a run: a new run would see the folder
    assert modules.cache_folder() == tmp_path / "home" / ".cache" / "lenet" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")   # ignored, as the XDG spec says
    assert modules.cache_folder() == tmp_path / "home" / ".cache" / "lenet" / "kernels"


def test_a_module_compiles_once_then_comes_from_the_cache(modules, monkeypatch):
    path = modules.binary("t.twice", SOURCE, ("-std=c++17",), 90)
    data = path.read_bytes()
    assert path.name.startswith("t.twice.sm_90.") and path.suffix == ".cubin"
    assert data.startswith(b"\x7fELF") and b".text.twice_kernel\0" in data
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    monkeypatch.setattr(modules.Nvrtc, "compile", lambda *a, **k: pytest.fail("compiled again"))
    assert modules.binary("t.twice", SOURCE, ("-std=c++17",), 90) == path
    assert path.read_bytes() == data


def test_a_truncated_file_is_compiled_again(modules):
    path = modules.binary("t.twice", SOURCE, (), 90)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    assert modules.binary("t.twice", SOURCE, (), 90) == path and path.read_bytes() == whole


def test_a_changed_source_replaces_the_old_binary_and_other_arches_stay(modules):
    old = modules.binary("t.twice", SOURCE, (), 90)
    other = modules.binary("t.twice", SOURCE, (), 80)
    new = modules.binary("t.twice", SOURCE.replace("2.f", "3.f"), (), 90)
    assert new != old and not old.exists() and other.exists()
    assert sorted(p.name for p in new.parent.iterdir()) == sorted([new.name, other.name])


def test_a_gpu_newer_than_nvrtc_gets_ptx_of_the_newest_arch_it_knows(modules):
    nv = modules.nvrtc()
    newest = max(nv.archs)
    assert nv.target(newest) == (f"sm_{newest}", "cubin")
    assert nv.target(newest + 1) == (f"compute_{newest}", "ptx")
    path = modules.binary("t.twice", SOURCE, (), newest + 1)
    assert path.suffix == ".ptx" and b".entry twice_kernel" in path.read_bytes()
    with pytest.raises(modules.CompileError, match="compute capability"):
        nv.target(min(nv.archs) - 1)


def test_a_compile_error_names_the_module_and_holds_nvrtcs_log(modules):
    with pytest.raises(modules.CompileError) as e:
        modules.binary("t.broken", SOURCE.replace("*= 2.f", "*= undeclared"), (), 90)
    assert "t.broken.cu" in str(e.value) and "undeclared" in str(e.value)
    assert not modules.cache_folder().exists() or not any(modules.cache_folder().iterdir())


def test_a_folder_that_cannot_be_written_costs_a_compile_and_nothing_else(modules, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("LENET_KERNEL_CACHE", str(blocked / "kernels"))   # under a file: mkdir fails
    path = modules.binary("t.twice", SOURCE, (), 90)
    assert path.is_file() and path.read_bytes().startswith(b"\x7fELF") and blocked.read_text() == ""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _every_module():
    from lenet import kernels

    return [(n, m) for name, m in kernels.declared().items() for n in (name, name + kernels.PACK)]


def _supported_archs():
    try:
        from lenet.kernels import nvrtc
        return [a for a in nvrtc.nvrtc().archs if a >= nvrtc.LOWEST_ARCH]
    except Exception:   # noqa: BLE001 (no stack: the tests below are skipped by their marker's rule)
        return [75, 80, 86, 89, 90]


@pytest.mark.parametrize("arch", _supported_archs())
def test_every_module_compiles_for_every_architecture_from_its_lowest(modules, tmp_path, monkeypatch, arch):
    """Note [module declarations]: every module, plain and pack, compiles for every compute capability the
    installed NVRTC knows from the lowest it declares (75 unless ``arch=``) upward, as a cubin (ptxas
    included: that is where a feature of a newer generation is refused). A failure names the module and
    the architecture."""
    from concurrent.futures import ThreadPoolExecutor

    from lenet import kernels

    monkeypatch.setenv("LENET_KERNEL_CACHE", str(tmp_path))

    def one(item):
        name, m = item
        if not m.runs_on(arch):
            return None
        try:
            modules.binary(f"lenet.{name}", kernels.source(name), kernels.options(name), arch)
        except modules.CompileError as e:
            return f"module {name} does not compile for sm_{arch}: {str(e)[:1500]}"
        return None

    with ThreadPoolExecutor(2) as pool:   # NVRTC lets go of the GIL
        failures = [f for f in pool.map(one, _every_module()) if f]
    assert not failures, "\n".join(failures)


def test_a_declared_lowest_architecture_is_needed(modules, tmp_path, monkeypatch):
    """A module that declares ``arch=A`` above the lowest generation does not compile for the generation
    below A: the declaration is what keeps its versions from older GPUs, and it is not stricter than it
    must be."""
    from lenet import kernels

    monkeypatch.setenv("LENET_KERNEL_CACHE", str(tmp_path))
    archs = modules.nvrtc().archs
    raised = [(n, m) for n, m in _every_module() if m.arch > modules.LOWEST_ARCH]
    assert raised, "no module declares a lowest architecture above 75: stage 2's tensor-core versions need 80"
    for name, m in raised:
        below = max(a for a in archs if a < m.arch)
        with pytest.raises(modules.CompileError,
                           match="requires .target sm_80|requires .target sm_|__cluster_dims__ is not supported"):
            modules.binary(f"lenet.{name}", kernels.source(name), kernels.options(name), below)


def test_the_kernel_architecture_follows_lenet_kernel_arch(modules, monkeypatch, tmp_path):
    """Note [kernel architecture]: LENET_KERNEL_ARCH compiles our kernels as PTX for that compute capability
    (at most the GPU's), a one-line error names a value that is not one; candidates and the heuristic follow
    it (stage 2's tensor-core versions are not offered below 80)."""
    from lenet.kernels import stages

    monkeypatch.setattr(modules, "_arch", lambda: 90)
    monkeypatch.delenv("LENET_KERNEL_ARCH", raising=False)
    assert modules.kernel_arch() == 90 and modules.requested_arch() is None
    for text, want in (("75", 75), ("7.5", 75), ("sm_80", 80), (" compute_86 ", 86)):
        monkeypatch.setenv("LENET_KERNEL_ARCH", text)
        assert modules.kernel_arch() == want
    for bad in ("74", "abc", "9", "7.5.1", "100x"):
        monkeypatch.setenv("LENET_KERNEL_ARCH", bad)
        with pytest.raises(ValueError, match=r"^LENET_KERNEL_ARCH='.*' is not a compute capability our kernels "
                                             r"compile for: give one of 75, 80, .*[^\n]$"):
            modules.kernel_arch()
    monkeypatch.setenv("LENET_KERNEL_ARCH", "100")
    with pytest.raises(ValueError, match="LENET_KERNEL_ARCH=100: this GPU is compute capability 9.0"):
        modules.kernel_arch()
    monkeypatch.setenv("LENET_KERNEL_ARCH", "75")
    monkeypatch.setenv("LENET_KERNEL_CACHE", str(tmp_path))
    path = modules.binary("t.twice", SOURCE, (), modules.kernel_arch(), ptx=True)
    assert path.name.startswith("t.twice.compute_75.") and path.suffix == ".ptx"
    assert b".target sm_75" in path.read_bytes()
    conv2 = next(ks for ks in stages.kernels().values() if ks.stage == "conv2")
    monkeypatch.setattr(stages, "sm_count", lambda: 40)
    versions = {conv2.module(c).name for c in conv2.backward_candidates(64)}
    assert versions and all(conv2.module(c).arch <= 75 for c in conv2.backward_candidates(64))
    assert "stage2_backward_roles" not in versions and "stage2_backward_balanced" in versions
    assert conv2.refuses(stages.parse_name("fused-bwd-v8-g3")) == (
        "fused-bwd-v8-g3 needs compute capability 8.0 or newer; this GPU's kernels are 7.5")
    monkeypatch.setenv("LENET_KERNEL_ARCH", "80")
    assert "stage2_backward_roles3" in {conv2.module(c).name for c in conv2.backward_candidates(64)}
    assert conv2.refuses(stages.parse_name("fused-bwd-v8-g3")) is None


def test_a_gpu_older_than_every_supported_generation_gets_one_line(modules, monkeypatch):
    from descriptors.errors import NoGpuError
    from lenet import kernels

    monkeypatch.delenv("LENET_KERNEL_ARCH", raising=False)
    monkeypatch.setattr(modules, "_arch", lambda: 70)
    with pytest.raises(NoGpuError) as e:
        kernels.require_arch("Tesla V100-SXM2-16GB")
    assert str(e.value) == ("no usable NVIDIA GPU: Tesla V100-SXM2-16GB is compute capability 7.0; lenet-cudnn runs "
                            "on 7.5 (Turing) and newer, and no extra of it supports older GPUs")
    monkeypatch.setattr(modules, "_arch", lambda: 75)
    kernels.require_arch("Tesla T4")


def test_forgetting_a_build_whose_load_failed_keeps_a_newer_one():
    """Note [a version removed under us]: a thread whose load failed drops its own build only; a build another
    such thread started since stays (the one every caller waits for, and the exit waits for)."""
    from concurrent.futures import Future

    from lenet.kernels import nvrtc

    old, new = Future(), Future()
    nvrtc._modules["lenet.test-forget"] = new
    try:
        nvrtc.forget("lenet.test-forget", old)
        assert nvrtc._modules["lenet.test-forget"] is new
        nvrtc.forget("lenet.test-forget", new)
        assert "lenet.test-forget" not in nvrtc._modules
    finally:
        nvrtc._modules.pop("lenet.test-forget", None)


def test_a_module_built_with_the_package_is_read_not_compiled(modules, tmp_path, monkeypatch):
    """Note [kernels built with the package]: a binary in the package's built/ folder, named as the cache
    names it, is used where the cache has none; one cut short there is compiled again, into the cache."""
    built = tmp_path / "built"
    [name] = modules.build_into(built, 75, [("t.twice", SOURCE, ("-std=c++17",))])
    monkeypatch.setattr(modules, "INSTALLED", built)
    real = modules.Nvrtc.compile
    monkeypatch.setattr(modules.Nvrtc, "compile", lambda *a, **k: pytest.fail("compiled"))
    assert modules.binary("t.twice", SOURCE, ("-std=c++17",), 75) == built / name
    assert modules.BUILT[-1][0] == "t.twice" and modules.BUILT[-1][3] == "installed"
    (built / name).write_bytes((built / name).read_bytes()[:100])
    monkeypatch.setattr(modules.Nvrtc, "compile", real)
    path = modules.binary("t.twice", SOURCE, ("-std=c++17",), 75)
    assert path == modules.cache_folder() / name and modules.BUILT[-1][3] == "nvrtc"


def test_every_module_a_gpu_may_launch_is_listed_for_the_wheel():
    from lenet import kernels

    declared = kernels.declared()
    for arch in (75, 80, 90):
        names = kernels.every_module(arch)
        own = [n for n in names if not n.endswith(kernels.PACK)]
        assert set(own) == {n for n, m in declared.items() if m.folder is None and m.runs_on(arch)}, arch
        packed = {n[: -len(kernels.PACK)] for n in names if n.endswith(kernels.PACK)}
        assert packed == {n for n in own if n in kernels.stage_modules() or n.startswith("head")}, arch
        assert len(names) == len(set(names))
    assert "step_cluster" in kernels.every_module(90) and "step_cluster" not in kernels.every_module(80)
    assert "stage2_backward_roles__pack" in kernels.every_module(80) and "softmax_ce__pack" not in kernels.every_module(90)


def test_the_wheels_build_compiles_every_module_where_the_runs_find_them(modules, tmp_path, monkeypatch):
    """build_support/lenet_build.py, as setup.py's build step runs it on a machine whose GPU is compute
    capability 7.5: every module of every_module(75) lands in the wheel's built/ folder under the name a run
    looks for, so a first run compiles none of them. Without a GPU it asks for nothing more and builds nothing."""
    import importlib
    import sys

    from lenet import kernels

    monkeypatch.syspath_prepend(str(ROOT / "build_support"))
    lenet_build = importlib.import_module("lenet_build")
    built = tmp_path / "built"
    assert lenet_build.build_kernels(str(built), []) == 0 and not built.exists()
    monkeypatch.setattr(lenet_build._setuptools, "get_requires_for_build_wheel", lambda settings=None: ["wheel"])
    for archs, more in (([], []), ([90], lenet_build.KERNEL_BUILD_REQUIRES)):
        monkeypatch.setattr(lenet_build, "gpu_archs", lambda: archs)
        assert lenet_build.get_requires_for_build_wheel() == ["wheel", *more]
    assert lenet_build.build_kernels(str(built), [75]) == len(kernels.every_module(75))
    assert str(ROOT) not in sys.path[:1]
    monkeypatch.setattr(modules, "INSTALLED", built)
    monkeypatch.setattr(modules.Nvrtc, "compile", lambda *a, **k: pytest.fail("compiled"))
    for n in kernels.every_module(75):
        assert modules.binary(f"lenet.{n}", kernels.source(n), kernels.options(n), 75).parent == built, n


_HELD = """
import json, os, sys
from lenet import files
from lenet.kernels import nvrtc
files.hold_writes()   # a program before its checks passed
source = sys.argv[1]
first = nvrtc.binary("t.twice", source, (), 75)
made_before = os.path.exists(os.path.join(os.environ["XDG_CACHE_HOME"], "lenet"))
files.checks_passed()
files.wait_for_writes()
names = sorted(os.listdir(nvrtc.cache_folder()))
print(json.dumps({"first": str(first), "made_before": made_before, "names": names,
                  "same": open(nvrtc.cache_folder() / names[0], "rb").read() == first.read_bytes(),
                  "again": str(nvrtc.binary("t.twice", source, (), 75))}))
"""


def test_a_module_compiled_before_the_checks_is_cached_once_they_passed(tmp_path):
    """Note [nothing written before the checks] (lenet/files.py): a module compiled before a program's checks
    passed (at start-up, or by a model planned beside them) runs from a temporary file of the run's own, is
    written into the kernel cache once they passed, and the temporary file goes when the process ends."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XDG_CACHE_HOME=str(tmp_path / "xdg"), TMPDIR=str(tmp_path / "tmp"))
    env.pop("LENET_KERNEL_CACHE", None)
    (tmp_path / "tmp").mkdir()
    out = subprocess.run([sys.executable, "-c", _HELD, SOURCE], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    got = json.loads(out.stdout)
    assert got["first"].startswith(str(tmp_path / "tmp")) and not got["made_before"], got
    assert len(got["names"]) == 1 and got["names"][0].startswith("t.twice.sm_75.") and got["same"], got
    assert got["again"] == str(tmp_path / "xdg" / "lenet" / "kernels" / got["names"][0]), got
    assert not os.listdir(tmp_path / "tmp"), "the run's own copy was left behind"
