"""Our compile path without a GPU (lenet/kernels/nvrtc.py, Note [first run]): NVRTC through ctypes,
the kernel cache's location, reuse, repair and pruning, the PTX fallback for a GPU newer than NVRTC,
and a compile error's message."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.stack

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
