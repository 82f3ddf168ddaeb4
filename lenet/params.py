"""One flat float32 parameter buffer with named views under PyTorch's state_dict names.

Each tensor starts on a 256-byte boundary (64 floats) so cuDNN and cuBLAS see aligned
pointers; the padding stays zero (its gradient is never written, so SGD keeps it 0).
"""

from __future__ import annotations

import math

import numpy as np

# (name, shape, fan_in): PyTorch's names and shapes for this LeNet.
LAYOUT: tuple[tuple[str, tuple[int, ...], int], ...] = (
    ("conv1.weight", (6, 1, 5, 5), 25),
    ("conv1.bias", (6,), 25),
    ("conv2.weight", (16, 6, 5, 5), 150),
    ("conv2.bias", (16,), 150),
    ("fc1.weight", (120, 256), 256),
    ("fc1.bias", (120,), 256),
    ("fc2.weight", (10, 120), 120),
    ("fc2.bias", (10,), 120),
)
NAMES = tuple(n for n, _, _ in LAYOUT)
SHAPES = {n: s for n, s, _ in LAYOUT}
_ALIGN = 64  # floats


def _offsets() -> tuple[dict[str, int], int]:
    off, pos = {}, 0
    for name, shape, _ in LAYOUT:
        off[name] = pos
        pos += -(-math.prod(shape) // _ALIGN) * _ALIGN
    return off, pos


OFFSETS, TOTAL = _offsets()
COUNT = sum(math.prod(s) for _, s, _ in LAYOUT)   # 34,622 parameters


def check_seed(seed) -> int:
    """A seed is an integer >= 0 (NumPy's generators take no other): a one-line ValueError naming it."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    return int(seed)


def init_host(seed: int) -> dict[str, np.ndarray]:
    """PyTorch's default init for Conv2d/Linear: weight and bias uniform in +-1/sqrt(fan_in)."""
    check_seed(seed)
    rng = np.random.Generator(np.random.PCG64(seed))
    return {name: rng.uniform(-1 / math.sqrt(fan), 1 / math.sqrt(fan), size=shape).astype(np.float32)
            for name, shape, fan in LAYOUT}


def pack(state: dict[str, np.ndarray]) -> np.ndarray:
    """A host flat buffer (TOTAL,) from a state dict; checks names and shapes."""
    missing = [n for n in NAMES if n not in state]
    extra = [n for n in state if n not in SHAPES]
    if missing or extra:
        raise ValueError(f"state dict does not match LeNet: missing {missing}, unexpected {extra}")
    flat = np.zeros(TOTAL, dtype=np.float32)
    for name in NAMES:
        a = np.asarray(state[name])
        if a.shape != SHAPES[name]:
            raise ValueError(f"{name} has shape {a.shape}, LeNet's is {SHAPES[name]}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{name} holds non-finite values")
        flat[OFFSETS[name]: OFFSETS[name] + a.size] = a.ravel()
    return flat


def unpack(flat: np.ndarray) -> dict[str, np.ndarray]:
    return {n: flat[OFFSETS[n]: OFFSETS[n] + math.prod(SHAPES[n])].reshape(SHAPES[n]).copy() for n in NAMES}


def views(buf) -> dict:
    """Named views (state_dict names and shapes) into a flat device or host buffer."""
    return {n: buf[OFFSETS[n]: OFFSETS[n] + math.prod(SHAPES[n])].reshape(SHAPES[n]) for n in NAMES}
