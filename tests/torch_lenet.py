"""The PyTorch reference: the same LeNet in torch.nn, loaded with our parameters.

Used only by tests and benchmarks; of lenet/ and descriptors/, only lenet/torch.py imports torch.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def exact_float32() -> None:
    """No TF32 anywhere: the reference computes in plain float32, as we do (see Note [math type])."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


class TorchLeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(256, 120)
        self.fc2 = nn.Linear(120, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def from_state(state: dict[str, np.ndarray], device="cuda", dtype=torch.float32) -> TorchLeNet:
    m = TorchLeNet()
    m.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()})
    return m.to(device=device, dtype=dtype)


def decision_margins(state: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Per image, in float64: how far the closest ReLU input is from 0, and the closest
    max-pool window from a tie between its two largest values.

    Max-pool and ReLU gradients are discontinuous: two float32 computations that differ
    only by rounding can route a gradient differently when a decision is within rounding
    of its threshold. A batch whose margins are well above rounding compares gradients
    of the same function on both sides.
    """
    m = from_state(state, device="cpu", dtype=torch.float64)
    t = torch.as_tensor(x, dtype=torch.float64).reshape(-1, 1, 28, 28)
    n = t.shape[0]
    with torch.no_grad():
        def pool_gap(r):  # r (n, C, H, W) after ReLU; 2x2/2 windows
            c, h, w = r.shape[1:]
            win = r.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(n, -1, 4)
            top = win.topk(2, dim=-1).values
            gap = top[..., 0] - top[..., 1]
            gap = torch.where(top[..., 0] > 0, gap, torch.full_like(gap, float("inf")))
            return gap.min(dim=1).values

        a1 = m.conv1(t)
        r1 = F.relu(a1)
        a2 = m.conv2(F.max_pool2d(r1, 2, 2))
        r2 = F.relu(a2)
        a3 = m.fc1(F.max_pool2d(r2, 2, 2).flatten(1))
        margins = torch.stack([a1.abs().flatten(1).min(1).values, pool_gap(r1), a2.abs().flatten(1).min(1).values,
                               pool_gap(r2), a3.abs().min(1).values], dim=1)
    return margins.min(dim=1).values.numpy()


def margins_past_ties(state: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Per image, in float64: how close its nearest decision that two float32 sums could take either way is to
    its tie. Unlike ``decision_margins``, an exact tie is not near one (both break it alike, the first maximum,
    and Fashion-MNIST's constant backgrounds are full of them), and a ReLU counts where it decides what passes:
    a window's is its maximum less the next value below it where the maximum is positive, and |its maximum|
    (the ReLU after it); fc1's, |its pre-activation|."""
    m = from_state(state, device="cpu", dtype=torch.float64)
    t = torch.as_tensor(x, dtype=torch.float64).reshape(-1, 1, 28, 28)
    n = len(t)

    def stage(a):   # (the images' closest decisions of this conv's windows, relu(maxpool(a)))
        c, h, w = a.shape[1:]
        win = a.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(n, -1, 4)
        top = win.max(-1).values
        below = torch.where(win < top[..., None], win, torch.full_like(win, -torch.inf)).max(-1).values
        gap = torch.where(top > 0, top - below, torch.full_like(top, torch.inf))
        return torch.minimum(gap, top.abs()).min(1).values, F.relu(F.max_pool2d(a, 2))

    with torch.no_grad():
        g1, p1 = stage(m.conv1(t))
        g2, p2 = stage(m.conv2(p1))
        a3 = m.fc1(p2.flatten(1))
    return torch.stack([g1, g2, a3.abs().min(1).values], 1).min(1).values.numpy()


def well_conditioned_batch(state, n: int, seed: int, margin: float = 1e-4):
    """n standard-normal images (and uniform labels) whose decision margins are >= margin."""
    rng = np.random.default_rng(seed)
    xs = []
    while sum(len(a) for a in xs) < n:
        cand = rng.standard_normal((2 * n, 1, 28, 28)).astype(np.float32)
        xs.append(cand[decision_margins(state, cand) >= margin])
    x = np.concatenate(xs)[:n]
    return x, rng.integers(0, 10, n).astype(np.int32)
