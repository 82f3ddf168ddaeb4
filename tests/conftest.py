"""GPU gating, the reference tolerance, and a comparison that explains itself.

Tests marked ``gpu`` are skipped, with the reason, where no usable GPU is found.
With LENET_REQUIRE_GPU=1 (the GPU check sets it) any skipped test is a failure,
so a run on the GPU machine cannot pass by skipping.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import numpy as np
import pytest

# The test process itself writes no bytecode beside the sources either (as `python -B -m pytest`, the
# README's test command, does): run as `python -m pytest`, a module of ours a test imports later than the
# session's first look at the checkout would leave lenet/__pycache__/<module>.pyc in it.
sys.dont_write_bytecode = True
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

# Note [a session of its own]: the tests and every program they start run with a HOME, cache and config
# folders and a temporary folder of the session's own, made here (before any test module is imported) in one
# folder of the temporary folder the user has, and removed with everything in it when the session ends: the
# user's HOME (~/.cache/lenet, ~/.cupy, ~/.config/matplotlib, ~/.nv) and /tmp (pytest's pytest-of-$USER,
# which held 137 MB after a run) are left as they were. The variables that name one cache each are unset so
# that they follow (a user's own CUPY_CACHE_DIR is no place for the tests' runs). pip keeps reading the
# user's configuration (its package index), from where it is.
def _pip_config() -> str | None:
    home = os.path.expanduser("~")
    for where in (os.path.join(os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config"), "pip", "pip.conf"),
                  os.path.join(home, ".pip", "pip.conf")):
        if os.path.isfile(where):
            return where
    return None


def _session_folders() -> Path:
    import tempfile

    pip = os.environ.get("PIP_CONFIG_FILE") or _pip_config()
    session = Path(tempfile.mkdtemp(prefix="lenet-tests-"))
    for name in ("home", "tmp", "cache", "config"):
        (session / name).mkdir()
    os.environ.update(HOME=str(session / "home"), TMPDIR=str(session / "tmp"), XDG_CACHE_HOME=str(session / "cache"),
                      XDG_CONFIG_HOME=str(session / "config"))
    for k in ("TEMP", "TMP", "LENET_DATA_CACHE", "LENET_PLAN_CACHE", "LENET_BYTECODE_CACHE", "LENET_KERNEL_CACHE",
              "CUPY_CACHE_DIR", "MPLCONFIGDIR", "CUDA_CACHE_PATH", "PYTHONPYCACHEPREFIX"):
        os.environ.pop(k, None)
    if pip:
        os.environ["PIP_CONFIG_FILE"] = pip
    tempfile.tempdir = str(session / "tmp")
    return session


SESSION = _session_folders()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if config.option.basetemp is None:   # pytest's own temporary folders: in the session's, not /tmp/pytest-of-$USER
        config.option.basetemp = str(SESSION / "pytest")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    import shutil

    shutil.rmtree(SESSION, ignore_errors=True)


REQUIRE_GPU = os.environ.get("LENET_REQUIRE_GPU") == "1"
# The programs the tests start write no bytecode beside the sources either (they keep theirs in the
# session's cache folder, Note [bytecode cache] in lenet/startup.py): the checkout stays as it was.
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"


def _checkout_entries() -> set[str] | None:
    """Every untracked or ignored entry of the checkout (git status --porcelain --ignored), or None
    where this is no git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return set(out.stdout.splitlines()) if out.returncode == 0 else None


def pytest_sessionstart(session):
    session.config._checkout_before = _checkout_entries()


def pytest_sessionfinish(session, exitstatus):
    """The test command leaves the checkout as it found it: a file a test (or a program it ran) left in
    it fails the session, named (bytecode beside the sources, a .pytest_cache, a run's output)."""
    before, after = getattr(session.config, "_checkout_before", None), _checkout_entries()
    if before is None or after is None:
        return
    new = sorted(after - before)
    if new:
        print(f"\nthe tests left {len(new)} new entries in the checkout: {new[:10]}", file=sys.stderr)
        session.exitstatus = 1

# Note [tolerance]: float32 parity is judged by the norm-wise relative error
# |ours - ref| / |ref| <= 1e-4. Both sides compute in plain float32 (TF32 off in
# cuDNN, cuBLAS and PyTorch); they differ only in summation order and, for the
# FFT and Winograd algorithms, in transform rounding. Float32's unit roundoff is
# 6e-8 and the longest sums here are a few hundred thousand terms (conv2's weight
# gradient at batch 256: 256*8*8 products per weight), so honest differences land
# near 1e-6..1e-5. A wrong index, a missing term or a transposed operand moves the
# error to 1e-2 or more, so 1e-4 separates the two with margin on both sides.
# Measured (scripts/algo_errors.py, H100, cuDNN 9.19): every algorithm but the
# Winograd family lands within 1.1e-6 of a float64 reference.
#
# Two refinements keep the comparison about the same function:
# - The Winograd algorithms are less precise by design: winograd_nonfused measured
#   4e-4..1.2e-3 against float64. They are held to WINOGRAD_RTOL, against both
#   PyTorch and float64, and are never chosen by heuristic/exhaustive by default
#   (see Note [winograd precision] in descriptors/algorithms.py).
# - Max-pool and ReLU gradients are discontinuous. Where a pre-activation is within
#   rounding of 0, or two pool inputs within rounding of a tie, ours and PyTorch's
#   may route a gradient term differently; neither is wrong. Whole-network gradient
#   tests use batches whose decisions are at least 1e-4 from their thresholds
#   (torch_lenet.well_conditioned_batch), checked in float64.
RTOL = 1e-4
WINOGRAD_RTOL = 3e-3


def rel_err(ours, ref) -> float:
    ours = np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, f"shape {ours.shape} != reference {ref.shape}"
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(ours - ref) / (den if den > 0 else 1.0))


def assert_close(ours, ref, what: str, rtol: float = RTOL) -> float:
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert np.all(np.isfinite(ours)), f"{what}: non-finite values in ours"
    e = rel_err(ours, ref)
    if e > rtol:
        o, r = ours.ravel()[:5], ref.ravel()[:5]
        pytest.fail(f"{what}: relative error {e:.3e} > {rtol:.0e}\n  ours {o}\n  ref  {r}")
    return e


def _gpu():
    from descriptors import gpu_status

    return gpu_status()


REQUIRE_STACK = os.environ.get("LENET_REQUIRE_STACK") == "1" or REQUIRE_GPU


@functools.lru_cache(maxsize=1)
def _stack() -> str | None:
    """Why the GPU stack's packages (libcudnn through cuda-pathfinder, CuPy, nvmath's bindings) cannot
    be loaded here, or None. They load on a machine without a GPU: CPU tests use them."""
    import importlib.util

    try:
        from descriptors import _lib

        _lib.lib()
        for name in ("cupy", "nvmath"):   # found, not imported: nvmath's package init is heavy
            if importlib.util.find_spec(name) is None:
                return f"{name} is not installed"
    except Exception as e:  # noqa: BLE001
        return str(e).splitlines()[0]
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu"):
            item.fixturenames.insert(0, "_gpu_gate")
        elif item.get_closest_marker("stack"):
            item.fixturenames.insert(0, "_stack_gate")


@pytest.fixture
def _stack_gate():
    why = _stack()
    if why is not None:
        if REQUIRE_STACK:
            pytest.fail(f"LENET_REQUIRE_STACK=1 but the GPU stack does not load: {why}")
        pytest.skip(f"needs the GPU stack installed (pip install '.[cu13]'): {why}")


@pytest.fixture
def _gpu_gate():
    ok, why = _gpu()
    if not ok:
        if REQUIRE_GPU:
            pytest.fail(f"LENET_REQUIRE_GPU=1 but no usable GPU: {why}")
        pytest.skip(f"needs an NVIDIA GPU: {why}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if REQUIRE_GPU and rep.skipped:
        rep.outcome = "failed"
        rep.longrepr = f"skipped under LENET_REQUIRE_GPU=1, which counts as a failure: {rep.longrepr}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    ok, why = _gpu()
    try:
        import descriptors

        cudnn = descriptors.version_string()
    except Exception as e:  # noqa: BLE001
        cudnn = f"not loaded ({e})"
    terminalreporter.write_line(f"GPU: {why if ok else 'none (' + why + ')'} | cuDNN {cudnn}")


@pytest.fixture(scope="session", autouse=True)
def _caches(tmp_path_factory):
    """The programs the tests run keep every cache (inflated datasets, stored plans, bytecode, CuPy's
    compiled kernels) in folders of the test session, never in the user's home: XDG_CACHE_HOME,
    which every cache of ours follows (lenet.files.cache_path), the dataset cache's own variable,
    and CuPy's CUPY_CACHE_DIR."""
    names = {"LENET_DATA_CACHE": "data-cache", "XDG_CACHE_HOME": "xdg-cache", "CUPY_CACHE_DIR": "cupy-cache"}
    old = {k: os.environ.get(k) for k in names}
    for k, folder in names.items():
        os.environ[k] = str(tmp_path_factory.mktemp(folder))
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def handle():
    from descriptors import Handle

    return Handle()


@pytest.fixture(autouse=True)
def _on_the_handles_stream(request):
    """A test that takes ``handle`` makes its CuPy arrays, fills and reads on the handle's stream, where cuDNN
    runs: the handle's stream waits for no other (non-blocking), so an input sent or an output filled with NaN
    on CuPy's default stream could land after cuDNN read or wrote it. That showed on a GPU shared with other
    processes (scripts/gpu_check.sh spread, GPU_CHECK_SLOTS), where each stream's work waits its turn."""
    if "handle" not in request.fixturenames:
        yield
        return
    with request.getfixturevalue("handle").stream:
        yield


def make_planner(handle, policy=None, max_batch: int = 65536):
    """A model's planner without the model (lenet/plan.py), on ``handle``'s stream, under ``policy``
    (lenet.engines.Policy; default: the defaults)."""
    from lenet.engines import Policy
    from lenet.plan import Planner

    return Planner(handle, policy or Policy(), max_batch=max_batch)


@pytest.fixture(scope="session")
def torch_ref():
    torch = pytest.importorskip("torch")
    from torch_lenet import exact_float32

    exact_float32()
    return torch


@pytest.fixture
def dataset(tmp_path):
    """A small IDX dataset (40 training, 20 test images) in a folder of its own."""
    from test_data_cpu import write_split

    root = tmp_path / "data"
    root.mkdir()
    write_split(root, n=40)
    write_split(root, n=20, split="test")
    return root
