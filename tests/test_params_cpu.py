"""The flat parameter layout and PyTorch's init, without a GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lenet import params as P


def test_layout_matches_pytorch_names_and_shapes():
    torch = pytest.importorskip("torch")
    from torch_lenet import TorchLeNet
    ref = {k: tuple(v.shape) for k, v in TorchLeNet().state_dict().items()}
    assert ref == dict(P.SHAPES) and list(ref) == list(P.NAMES)
    assert P.COUNT == sum(math.prod(s) for s in ref.values()) == 34622
    del torch


def test_offsets_aligned_and_disjoint():
    ends = []
    for n in P.NAMES:
        assert P.OFFSETS[n] % 64 == 0, n
        ends.append((P.OFFSETS[n], P.OFFSETS[n] + math.prod(P.SHAPES[n])))
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])) and ends[-1][1] <= P.TOTAL


def test_init_is_pytorch_default_and_seeded():
    a, b, c = P.init_host(0), P.init_host(0), P.init_host(1)
    for name, shape, fan in P.LAYOUT:
        bound = 1 / math.sqrt(fan)
        assert a[name].dtype == np.float32 and a[name].shape == shape
        assert np.abs(a[name]).max() <= bound and np.abs(a[name]).max() > 0.9 * bound
        assert np.array_equal(a[name], b[name]) and not np.array_equal(a[name], c[name])


def test_pack_unpack_roundtrip_and_views():
    s = P.init_host(3)
    flat = P.pack(s)
    assert flat.shape == (P.TOTAL,) and np.count_nonzero(flat) == P.COUNT
    back = P.unpack(flat)
    assert all(np.array_equal(back[k], s[k]) for k in s)
    v = P.views(flat)
    v["fc2.bias"][...] = 7
    assert np.all(P.unpack(flat)["fc2.bias"] == 7)


def test_pack_refuses_wrong_state():
    s = P.init_host(0)
    with pytest.raises(ValueError, match=r"fc1.weight has shape \(256, 120\), LeNet's is \(120, 256\)"):
        P.pack({**s, "fc1.weight": s["fc1.weight"].T})
    with pytest.raises(ValueError, match="missing \\['fc2.bias'\\]"):
        P.pack({k: v for k, v in s.items() if k != "fc2.bias"})
    with pytest.raises(ValueError, match="non-finite"):
        P.pack({**s, "conv1.bias": np.full(6, np.inf, np.float32)})


def test_pytorch_loads_our_parameters():
    pytest.importorskip("torch")
    from torch_lenet import from_state
    m = from_state(P.init_host(5), device="cpu")
    for k, v in m.state_dict().items():
        assert np.array_equal(v.numpy(), P.init_host(5)[k])
