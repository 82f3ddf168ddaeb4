"""The graph engine, the convolution spec and the engine policy, without a GPU: the frontend's
graph validation runs on the CPU, so shapes, fusions and names are checked in CI."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

import descriptors as D
from descriptors.algorithms import AlgoPolicy, UnknownAlgorithmError
from descriptors.candidates import ConvSpec
from descriptors.graph import ConvGraph, available, frontend

pytestmark = pytest.mark.stack   # libcudnn loads without a GPU, but must be installed

ROOT = Path(__file__).resolve().parents[1]


def test_frontend_uses_our_libcudnn():
    ok, why = available()
    assert ok, why
    assert int(frontend().backend_version()) == D.version()
    maps = Path("/proc/self/maps")
    if maps.exists():   # one libcudnn.so mapped: the frontend's dlopen found the file descriptors/ loaded
        libs = {line.split()[-1] for line in maps.read_text().splitlines() if "libcudnn.so" in line}
        assert len(libs) == 1, libs


@pytest.mark.parametrize("direction,fuse,roles", [
    ("fwd", "", ("x", "w", "y")), ("fwd", "bias_relu", ("x", "w", "b", "y")), ("bwd-data", "", ("dy", "w", "dx")),
    ("bwd-data", "drelu", ("dy", "w", "act", "dx")), ("bwd-filter", "", ("x", "dy", "dw"))])
def test_graphs_validate_without_a_gpu(direction, fuse, roles):
    g = ConvGraph(None, direction, (64, 6, 12, 12), (16, 6, 5, 5), fuse=fuse)
    assert g.roles == roles and g.y_shape == (64, 16, 8, 8) and g.plans == []
    assert g.shapes["b"] == (1, 16, 1, 1) and g.shapes["dw"] == (16, 6, 5, 5)
    # Note [graph execute]: the lowered graph's execute is what runs plans; a frontend without it fails here.
    assert callable(getattr(g._g._lowered_graph, "_execute_plan_at_index", None))


@pytest.mark.parametrize("kw,msg", [
    (dict(x_shape=(4, 2, 28, 28)), "x has 2 channels, w expects 1"),
    (dict(w_shape=(6, 1, 30, 30)), "does not fit"),
    (dict(direction="sideways"), "unknown direction 'sideways'"),
    (dict(direction="bwd-filter", fuse="drelu"), "bwd-filter cannot fuse 'drelu'; it fuses: nothing"),
    (dict(fuse="gelu"), "fwd cannot fuse 'gelu'; it fuses: 'bias_relu'"),
    (dict(pad=-1), "pad must be >= 0"),
    (dict(stride=(1, 0)), "stride and dilation >= 1"),
    (dict(dtype="float16"), "float32 only"),
    (dict(x_shape=(4, 1, 28)), r"x must be \(N, C, H, W\)"),
])
def test_bad_graphs_are_refused_before_cudnn(kw, msg):
    args = dict(direction="fwd", x_shape=(4, 1, 28, 28), w_shape=(6, 1, 5, 5))
    args.update(kw)
    extra = {k: args.pop(k) for k in ("fuse", "pad", "stride", "dtype") if k in args}
    with pytest.raises(ValueError, match=msg):
        ConvGraph(None, args["direction"], args["x_shape"], args["w_shape"], **extra)


def test_graph_lifetime_is_counted():
    gc.collect()
    base = D.live_objects()
    g = ConvGraph(None, "fwd", (2, 1, 8, 8), (3, 1, 3, 3))
    assert D.live_objects()["Graph"] == base["Graph"] + 1
    g.close()
    g.close()
    assert g.closed and D.live_objects() == base
    with pytest.raises(ValueError, match="closed"):
        _ = g._g
    with ConvGraph(None, "bwd-filter", (2, 1, 8, 8), (3, 1, 3, 3)) as h:
        assert not h.closed
    del h, g
    gc.collect()
    assert D.live_objects() == base


def test_conv_spec():
    s = ConvSpec("bwd-data", 64, (6, 12, 12), (16, 6, 5, 5), epilogue="drelu")
    assert s.y_shape == (64, 16, 8, 8) and s.roles == ("dy", "w", "act", "dx") and s.output == "dx"
    assert s.at(1000).n == 1000 and s.at(1000).x == s.x and hash(s) == hash(ConvSpec("bwd-data", 64, [6, 12, 12],
                                                                                    (16, 6, 5, 5), epilogue="drelu"))
    assert str(s) == "bwd-data+drelu x(64, 6, 12, 12) w(16, 6, 5, 5)"
    for kw, msg in [(dict(epilogue="bias_relu"), "bwd-data has no epilogue 'bias_relu'"), (dict(n=0), ">= 1"),
                    (dict(x=(5, 12, 12)), "x has 5 channels, w expects 6"), (dict(direction="up"), "'up'")]:
        with pytest.raises(ValueError, match=msg):
            ConvSpec(**{**dict(direction="bwd-data", n=64, x=(6, 12, 12), w=(16, 6, 5, 5)), **kw})


def test_policy_names_engines_and_chunks():
    from lenet.engines import Policy

    p = AlgoPolicy.parse("eng18_k11=0")
    assert p.fwd == p.bwd_data == p.bwd_filter == "eng18_k11=0" and p.fixed("fwd")
    p = Policy.parse("bwd-filter=eng18_k11=0,fwd=implicit_gemm", engine="auto", chunk=4096, allow_tf32=True)
    assert (p.fwd, p.bwd_data, p.bwd_filter, p.chunk) == ("implicit_gemm", "heuristic", "eng18_k11=0", 4096)
    assert "engine auto" in str(p) and "chunks of 4096" in str(p) and "tf32 allowed" in str(p)
    assert p.cudnn() == AlgoPolicy(fwd="implicit_gemm", bwd_filter="eng18_k11=0", allow_tf32=True)
    with pytest.raises(ValueError, match="--engine legacy offers only the descriptor API's algorithms, and --algo "
                                         "names the graph-API plan eng0"):
        Policy.parse("eng0", engine="legacy")
    if available()[0]:
        with pytest.raises(ValueError, match="--engine graph offers only graph-API plans, and --algo names the "
                                             "descriptor-API algorithm fft"):
            Policy.parse("fft", engine="graph")
    with pytest.raises(ValueError, match="unknown engine 'cpu'"):
        Policy(engine="cpu")
    with pytest.raises(ValueError, match="chunk must be a number of images >= 1"):
        Policy(chunk=0)
    with pytest.raises(UnknownAlgorithmError, match="graph-API plan name"):
        AlgoPolicy.parse("fwd=eng")


def _run(*args, env=None):
    e = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    return subprocess.run([sys.executable, "-m", *args], env=e, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_engine_graph_without_the_frontend_is_one_line(tmp_path):
    # A `cudnn` package that fails to import stands in for an install without nvidia-cudnn-frontend.
    (tmp_path / "cudnn").mkdir()
    (tmp_path / "cudnn" / "__init__.py").write_text("raise ImportError('No module named cudnn')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = _run("lenet.train_step", "--engine", "graph", "--synthetic", env=env)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "--engine graph" in out.stderr and "nvidia-cudnn-frontend" in out.stderr and "pip install" in out.stderr


@pytest.mark.parametrize("args,msg", [
    (["--engine", "tpu"], "--engine: invalid choice: 'tpu'"),
    (["--chunk", "0"], "--chunk: invalid value '0'"),
    (["--algo", "fft", "--engine", "graph"], "--engine graph offers only graph-API plans, and --algo names the descriptor-API algorithm fft"),
])
def test_engine_flag_errors(args, msg):
    out = _run("lenet.train_step", *args)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and msg in out.stderr, out.stderr
