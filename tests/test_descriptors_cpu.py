"""descriptors/ without a GPU: libcudnn loads and its descriptor functions work anywhere."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import descriptors as D
from descriptors import _lib
from descriptors.algorithms import ALGORITHM_NAMES, CALLS, AlgoPolicy, Direction, algorithm_id

pytestmark = pytest.mark.stack   # libcudnn loads without a GPU, but must be installed


def test_loads_cudnn_9_or_newer():
    assert D.version() >= 90000
    assert re.fullmatch(r"9\.\d+\.\d+", D.version_string()) or D.version() >= 100000
    assert Path(D.library_path()).exists()


def test_every_declared_function_exists_and_none_removed_in_cudnn8():
    lib = _lib.lib()
    for name in _lib.PROTOTYPES:
        assert getattr(lib, name).argtypes is not None or _lib.PROTOTYPES[name][1] == [], name
    removed = ("cudnnGetConvolutionForwardAlgorithm", "cudnnGetConvolutionBackwardDataAlgorithm",
               "cudnnGetConvolutionBackwardFilterAlgorithm")
    assert not any(n in _lib.PROTOTYPES for n in removed)
    enums = [v for v in vars(_lib).values() if isinstance(v, type) and issubclass(v, _lib.enum.Enum)]
    assert not any("PREFER" in m.name for e in enums for m in e)


# ------------------------------------------------------------------ output shapes

def test_lenet_layer_shapes():
    x = D.TensorDescriptor((64, 1, 28, 28))
    w1, w2 = D.FilterDescriptor((6, 1, 5, 5)), D.FilterDescriptor((16, 6, 5, 5))
    conv, pool = D.ConvolutionDescriptor(), D.PoolingDescriptor("max", 2, stride=2)
    assert conv.output_shape(x, w1) == (64, 6, 24, 24)
    assert pool.output_shape(D.TensorDescriptor((64, 6, 24, 24))) == (64, 6, 12, 12)
    assert conv.output_shape(D.TensorDescriptor((64, 6, 12, 12)), w2) == (64, 16, 8, 8)
    assert pool.output_shape(D.TensorDescriptor((64, 16, 8, 8))) == (64, 16, 4, 4)


@pytest.mark.parametrize("h,w", [(28, 28), (17, 23)])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("pad", [0, 1, 2])
@pytest.mark.parametrize("stride", [1, 2, 3])
@pytest.mark.parametrize("dil", [1, 2])
def test_conv_output_shape_sweep(h, w, k, pad, stride, dil):
    def out(n):
        return (n + 2 * pad - dil * (k - 1) - 1) // stride + 1
    if out(h) < 1 or out(w) < 1:
        pytest.skip("no output for this combination")  # never reached for these sizes
    x, f = D.TensorDescriptor((2, 3, h, w)), D.FilterDescriptor((4, 3, k, k))
    conv = D.ConvolutionDescriptor(pad=pad, stride=stride, dilation=dil)
    assert conv.output_shape(x, f) == (2, 4, out(h), out(w))


@pytest.mark.parametrize("mode", ["max", "max_deterministic", "average", "average_exclude_padding"])
@pytest.mark.parametrize("win,pad,stride", [(2, 0, 2), (3, 1, 2), (3, 0, 1), (5, 2, 3), (2, 1, 1)])
def test_pool_output_shape_sweep(mode, win, pad, stride):
    x = D.TensorDescriptor((3, 2, 13, 20))
    p = D.PoolingDescriptor(mode, window=win, pad=pad, stride=stride)
    o = lambda n: (n + 2 * pad - win) // stride + 1  # noqa: E731
    assert p.output_shape(x) == (3, 2, o(13), o(20))


# ------------------------------------------------------------------ bad parameters

@pytest.mark.parametrize("shape", [(0, 1, 28, 28), (1, -1, 28, 28), (1, 1, 0, 28), (-4, 1, 1, 1)])
def test_tensor_bad_sizes(shape):
    with pytest.raises(D.CudnnError) as e:
        D.TensorDescriptor(shape)
    assert e.value.status_name == "CUDNN_STATUS_BAD_PARAM"
    assert e.value.function == "cudnnSetTensor4dDescriptor"
    assert str(shape) in str(e.value) and e.value.explanation  # cuDNN's own words


@pytest.mark.parametrize("shape", [(0, 1, 5, 5), (6, 1, -5, 5)])
def test_filter_bad_sizes(shape):
    with pytest.raises(D.CudnnError) as e:
        D.FilterDescriptor(shape)
    assert e.value.is_bad_param and e.value.function == "cudnnSetFilter4dDescriptor"


@pytest.mark.parametrize("kw", [dict(stride=0), dict(stride=(1, -2)), dict(pad=-1), dict(dilation=0)])
def test_conv_bad_params(kw):
    with pytest.raises(D.CudnnError) as e:
        D.ConvolutionDescriptor(**kw)
    assert e.value.is_bad_param
    assert "stride=" in str(e.value) and "pad=" in str(e.value)
    assert e.value.explanation, "cuDNN's explanation (cudnnGetLastErrorString) should be carried"


def test_conv_filter_larger_than_input():
    conv = D.ConvolutionDescriptor()
    with pytest.raises(D.CudnnError) as e:
        conv.output_shape(D.TensorDescriptor((1, 1, 4, 4)), D.FilterDescriptor((1, 1, 5, 5)))
    assert e.value.is_bad_param and "(1, 1, 4, 4)" in str(e.value)


def test_conv_channel_mismatch():
    with pytest.raises(D.CudnnError) as e:
        D.ConvolutionDescriptor().output_shape(D.TensorDescriptor((1, 3, 8, 8)), D.FilterDescriptor((2, 4, 3, 3)))
    assert e.value.is_bad_param


def test_pool_window_larger_than_padded_input():
    p = D.PoolingDescriptor("max", window=30, stride=2)
    with pytest.raises(D.CudnnError) as e:
        p.output_shape(D.TensorDescriptor((1, 1, 28, 28)))
    assert e.value.is_bad_param
    assert "window=(30, 30)" in str(e.value) and "(1, 1, 28, 28)" in str(e.value)


@pytest.mark.parametrize("kw", [dict(window=0), dict(window=2, stride=0), dict(window=(2, -1))])
def test_pool_bad_params(kw):
    with pytest.raises(D.CudnnError) as e:
        D.PoolingDescriptor("max", **kw)
    assert e.value.is_bad_param and e.value.function == "cudnnSetPooling2dDescriptor"


@pytest.mark.parametrize("pad", [-1, 2, (0, 3)])
def test_pool_pad_checked_before_cudnn(pad):
    # cuDNN itself accepts these and computes windows made only of padding.
    with pytest.raises(ValueError, match=r"pooling pad .* must be >= 0 and smaller than the window \(2, 2\)"):
        D.PoolingDescriptor("max", window=2, pad=pad)


def test_unknown_names_are_value_errors():
    with pytest.raises(ValueError, match="unknown pooling mode 'min'"):
        D.PoolingDescriptor("min")
    with pytest.raises(ValueError, match="unknown activation mode"):
        D.ActivationDescriptor("gelu")
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        D.TensorDescriptor((1, 1, 1, 1), "int8")
    with pytest.raises(ValueError, match="shape must be 4 integers"):
        D.TensorDescriptor((1, 28, 28))


# ------------------------------------------------------------------ lifetime and repr

def test_each_descriptor_destroyed_exactly_once():
    gc.collect()
    base = D.live_objects()
    made = [D.TensorDescriptor((1, 2, 3, 4)), D.FilterDescriptor((2, 2, 3, 3)), D.ConvolutionDescriptor(),
            D.PoolingDescriptor(), D.ActivationDescriptor("tanh")]
    now = D.live_objects()
    for kind in ("Tensor", "Filter", "Convolution", "Pooling", "Activation"):
        assert now[kind] == base[kind] + 1, kind
    made[0].close()
    made[0].close()            # a second close does nothing
    with pytest.raises(ValueError, match="closed"):
        _ = made[0].ptr
    with made[1]:
        pass                   # `with` closes too
    assert made[1].closed
    del made
    gc.collect()
    assert D.live_objects() == base


def test_failed_set_still_destroys():
    gc.collect()
    base = D.live_objects()
    with pytest.raises(D.CudnnError):
        D.TensorDescriptor((0, 1, 1, 1))
    gc.collect()
    assert D.live_objects() == base


def test_reprs_read_state_back_from_cudnn():
    assert repr(D.TensorDescriptor((2, 3, 4, 5))) == \
        "TensorDescriptor(shape=(2, 3, 4, 5), strides=(60, 20, 5, 1), dtype=float32)"
    assert "shape=(6, 1, 5, 5)" in repr(D.FilterDescriptor((6, 1, 5, 5)))
    r = repr(D.ConvolutionDescriptor(pad=(1, 2), stride=3, dilation=2))
    assert "pad=(1, 2)" in r and "stride=(3, 3)" in r and "dilation=(2, 2)" in r and "math_type=fma" in r
    r = repr(D.PoolingDescriptor("average", window=3, pad=1, stride=2))
    assert "average_count_include_padding" in r and "window=(3, 3)" in r and "stride=(2, 2)" in r
    assert "coef=6.0" in repr(D.ActivationDescriptor("clipped_relu", coef=6.0))
    assert "float16" in repr(D.TensorDescriptor((1, 1, 2, 2), "float16"))


# ------------------------------------------------------------------ algorithm names and policy

def _header_enum(prefix: str) -> dict[str, int]:
    inc = Path(D.library_path()).resolve().parent.parent / "include"
    text = "".join(p.read_text(errors="replace") for p in inc.glob("cudnn*.h"))
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    found = dict((m.group(1).lower(), int(m.group(2)))
                 for m in re.finditer(prefix + r"(\w+)\s*=\s*(\d+)", text))
    # CUDNN_CONVOLUTION_BWD_DATA_ALGO_0 is named algo_0, as cuDNN's docs call it.
    found = {(f"algo_{k}" if k.isdigit() else k): v for k, v in found.items()}
    found.pop("count", None)
    return found


def test_algorithm_tables_cover_the_loaded_cudnn():
    prefixes = {Direction.FORWARD: "CUDNN_CONVOLUTION_FWD_ALGO_",
                Direction.BACKWARD_DATA: "CUDNN_CONVOLUTION_BWD_DATA_ALGO_",
                Direction.BACKWARD_FILTER: "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_"}
    inc = Path(D.library_path()).resolve().parent.parent / "include"
    assert list(inc.glob("cudnn*.h")), f"the cuDNN wheel ships its headers; none in {inc}"
    for d, prefix in prefixes.items():
        assert _header_enum(prefix) == ALGORITHM_NAMES[d], d


def test_algorithm_names():
    assert algorithm_id("fwd", "implicit_precomp_gemm") == 1
    assert algorithm_id("fwd", "CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING") == 5
    assert algorithm_id("bwd-filter", "1") == 1 and algorithm_id("bwd-data", "ALGO_0") == 0
    with pytest.raises(ValueError, match="unknown bwd-data algorithm 'direct'.*algo_0, algo_1, fft"):
        algorithm_id("bwd-data", "direct")
    assert set(CALLS) == set(Direction)


def test_policy_parsing():
    p = AlgoPolicy.parse("heuristic")
    assert (p.fwd, p.bwd_data, p.bwd_filter) == ("heuristic",) * 3
    p = AlgoPolicy.parse("fft")
    assert (p.fwd, p.bwd_data, p.bwd_filter) == ("fft",) * 3
    p = AlgoPolicy.parse("implicit_gemm")
    assert (p.fwd, p.bwd_data, p.bwd_filter) == ("implicit_gemm", "heuristic", "heuristic")
    p = AlgoPolicy.parse("fwd=direct, bwd-filter=exhaustive", workspace_limit=1024, deterministic=True)
    assert (p.fwd, p.bwd_data, p.bwd_filter) == ("direct", "heuristic", "exhaustive")
    assert p.workspace_limit == 1024 and p.deterministic
    for bad, msg in [("nope", "unknown algorithm 'nope'"), ("fwd=algo_1", "unknown fwd algorithm"),
                     ("up=fft", "unknown direction"), ("fwd=fft,fwd=gemm", "given twice"), ("", "empty"),
                     ("fwd=fft,gemm", "not DIRECTION=NAME")]:
        with pytest.raises(ValueError, match=msg):
            AlgoPolicy.parse(bad)
    with pytest.raises(ValueError, match="workspace limit"):
        AlgoPolicy(workspace_limit=-1)


def test_array_checks_refuse_host_arrays():
    t = D.TensorDescriptor((1, 1, 2, 2))
    with pytest.raises(ValueError, match="x must be a CuPy array on the GPU, got numpy.ndarray"):
        t.check(np.zeros((1, 1, 2, 2), np.float32), "x")


# ------------------------------------------------------------------ no GPU

def _no_gpu_env():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_handle_without_gpu_says_so_plainly():
    # Hide every GPU (so this runs the same on a GPU machine): the handle must say what failed.
    code = "import descriptors\ntry:\n    descriptors.Handle()\nexcept descriptors.NoGpuError as e:\n    print(e)\n"
    out = subprocess.run([sys.executable, "-c", code], env=_no_gpu_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("no usable NVIDIA GPU: "), out.stdout
    assert "cudaGetDeviceCount" in out.stdout or "no GPU" in out.stdout or "no NVIDIA driver" in out.stdout


def test_no_driver_is_named_as_such():
    # Without libcuda at all the line says there is no driver, not that "the driver is insufficient".
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("an NVIDIA driver is installed here; this checks the message of a machine without one")
    code = "import descriptors\nprint(descriptors.gpu_status()[1])\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "no NVIDIA driver is installed (libcuda.so.1 cannot be loaded)", out


def test_winograd_is_opt_in():
    assert not AlgoPolicy.parse("exhaustive").allow_winograd
    p = AlgoPolicy.parse("exhaustive", allow_winograd=True)
    assert p.allow_winograd and "winograd allowed" in str(p)
    assert AlgoPolicy.parse("winograd_nonfused").fwd == "winograd_nonfused"   # naming one always works
