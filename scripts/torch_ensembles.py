"""PyTorch's two best ways to train K LeNets at once (scripts/sweep_bench.py takes the faster), written from
the shared probes (torch_ensemble.py, torch_ensemble_grouped.py), each model its own images and learning
rate, every model under torch.optim.SGD's rule (weight decay, momentum, Nesterov) and a label-smoothed
cross-entropy, the mean over its own batch:

  func     torch.func: the K models' parameters stacked (stack_module_state), vmap(grad(functional_call))
  grouped  the K models as the groups of one grouped convolution per stage (conv1 K -> 6K, conv2 6K -> 16K,
           groups=K), the head as batched matmuls (baddbmm), the update in foreach ops

Each ``step(x, y)`` takes the K models' batches, x (K, B, 28, 28) and y (K, B), and updates every model;
``models()`` gives them back as K PyTorch LeNets (what tests/test_bench_cpu.py holds against K lone
torch.optim.SGD steps). Device-agnostic: the benchmark captures a step in a CUDA graph on the GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_lenet import TorchLeNet

KINDS = ("func", "grouped")


def sgd_update(params: list, grads: list, bufs: list, lrs: list, momentum: float, weight_decay: float,
               nesterov: bool) -> None:
    """torch.optim.SGD's step (its _single_tensor_sgd, momentum buffers already made) over tensors that
    hold several models, each's learning rate broadcast over its rows (``lrs``: one tensor per parameter)."""
    with torch.no_grad():
        g = torch._foreach_add(grads, params, alpha=weight_decay) if weight_decay else list(grads)
        if momentum:
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, g)
            g = torch._foreach_add(g, bufs, alpha=momentum) if nesterov else bufs
        for p, u, lr in zip(params, g, lrs):
            p.sub_(u * lr)


class Ensemble:
    """K models' parameters, momentum buffers and learning rates, and one training step of them all."""

    kind = ""

    def __init__(self, models: list, lr: torch.Tensor, momentum: float = 0.9, weight_decay: float = 0.0,
                 nesterov: bool = False, label_smoothing: float = 0.0):
        self.K = len(models)
        self.lr = lr                     # (K,) each model's learning rate
        self.momentum, self.weight_decay, self.nesterov = momentum, weight_decay, nesterov
        self.label_smoothing = label_smoothing

    def update(self, grads: list) -> None:
        sgd_update(self.params, grads, self.bufs, self.lrs, self.momentum, self.weight_decay, self.nesterov)


class FuncEnsemble(Ensemble):
    """torch.func: stack_module_state, vmap(grad(functional_call)) (probes/torch_ensemble.py)."""

    kind = "func"

    def __init__(self, models: list, lr: torch.Tensor, **kw):
        from torch.func import functional_call, grad, stack_module_state, vmap

        super().__init__(models, lr, **kw)
        stacked, _ = stack_module_state(models)
        self.names = list(stacked)
        self.params = [stacked[k].detach().clone() for k in self.names]   # (K, *shape) each
        self.bufs = [torch.zeros_like(p) for p in self.params]
        self.lrs = [lr.view(-1, *[1] * (p.dim() - 1)) for p in self.params]
        base = TorchLeNet().to("meta")
        ls = self.label_smoothing

        def loss(p, x, y):
            return F.cross_entropy(functional_call(base, p, (x.unsqueeze(1),)), y, label_smoothing=ls)
        self._grad = vmap(grad(loss))

    def step(self, x, y) -> None:
        g = self._grad(dict(zip(self.names, self.params)), x, y)
        self.update([g[k] for k in self.names])

    def models(self) -> list:
        out = []
        for k in range(self.K):
            m = TorchLeNet().to(self.params[0].device, self.params[0].dtype)
            m.load_state_dict({n: p[k] for n, p in zip(self.names, self.params)})
            out.append(m)
        return out


class GroupedEnsemble(Ensemble):
    """The K models as groups of one grouped convolution, the head as baddbmm (probes/torch_ensemble_grouped.py)."""

    kind = "grouped"

    def __init__(self, models: list, lr: torch.Tensor, **kw):
        super().__init__(models, lr, **kw)
        K = self.K

        def cat(name):
            return torch.cat([m.get_parameter(name).detach() for m in models]).clone()

        def stack_t(name, bias=False):   # a Linear's (out, in) as (K, in, out); its bias as (K, 1, out)
            return torch.stack([m.get_parameter(name).detach().unsqueeze(0) if bias else
                                m.get_parameter(name).detach().t() for m in models]).contiguous()
        self.params = [cat("conv1.weight"), cat("conv1.bias"), cat("conv2.weight"), cat("conv2.bias"),
                       stack_t("fc1.weight"), stack_t("fc1.bias", True), stack_t("fc2.weight"), stack_t("fc2.bias", True)]
        for p in self.params:
            p.requires_grad_()
        self.bufs = [torch.zeros_like(p) for p in self.params]
        per = lambda c: lr.repeat_interleave(c)   # noqa: E731  a model's lr over its c rows of a grouped tensor
        self.lrs = [per(6).view(-1, 1, 1, 1), per(6), per(16).view(-1, 1, 1, 1), per(16)] + [lr.view(K, 1, 1)] * 4

    def logits(self, x):
        """(K, B, 10) of the K models on their images x (K, B, 28, 28)."""
        P, K, B = self.params, self.K, x.shape[1]
        h = x.permute(1, 0, 2, 3)                                            # (B, K, 28, 28): model k's in channel k
        h = F.max_pool2d(F.relu(F.conv2d(h, P[0], P[1], groups=K)), 2)       # (B, 6K, 12, 12)
        h = F.max_pool2d(F.relu(F.conv2d(h, P[2], P[3], groups=K)), 2)       # (B, 16K, 4, 4)
        h = h.reshape(B, K, 256).transpose(0, 1)                              # (K, B, 256)
        h = F.relu(torch.baddbmm(P[5], h, P[4]))                              # (K, B, 120)
        return torch.baddbmm(P[7], h, P[6])                                   # (K, B, 10)

    def step(self, x, y) -> None:
        K, B = self.K, x.shape[1]
        z = self.logits(x)
        loss = F.cross_entropy(z.reshape(K * B, 10), y.reshape(-1), label_smoothing=self.label_smoothing,
                               reduction="sum") / B   # each model's mean over its batch, summed over models
        self.update(list(torch.autograd.grad(loss, self.params)))

    def models(self) -> list:
        P, out = self.params, []
        for k in range(self.K):
            m = TorchLeNet().to(P[0].device, P[0].dtype)
            m.load_state_dict({"conv1.weight": P[0][6 * k:6 * k + 6], "conv1.bias": P[1][6 * k:6 * k + 6],
                               "conv2.weight": P[2][16 * k:16 * k + 16], "conv2.bias": P[3][16 * k:16 * k + 16],
                               "fc1.weight": P[4][k].t(), "fc1.bias": P[5][k, 0], "fc2.weight": P[6][k].t(),
                               "fc2.bias": P[7][k, 0]})
            out.append(m)
        return out


def make(kind: str, models: list, lr, **kw) -> Ensemble:
    return {"func": FuncEnsemble, "grouped": GroupedEnsemble}[kind](models, lr, **kw)
