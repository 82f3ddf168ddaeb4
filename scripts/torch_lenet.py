"""The PyTorch reference: the same LeNet in torch.nn, loaded with our parameters.

Used only by tests and benchmarks; lenet/ and descriptors/ never import torch.
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
