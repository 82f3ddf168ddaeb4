"""What a model checks before any GPU work, each failure one line (a ValueError): a batch, the optimizer's
and the loss's constants, a setting of a pack, the memory a model needs and the engines a pack needs."""

from __future__ import annotations

import math

import numpy as np

from . import params as P
from .engines import Policy, registry
from .kernels import count_nonfinite
from .network import BUFFERS, CLASSES, STAGES
from .ops import Head, Stage


def check_batch(x, y, max_batch: int) -> int:
    """Validate a host batch; return n. One-line ValueErrors, before any GPU work."""
    x_shape = tuple(getattr(x, "shape", ()) or ())
    if x_shape[1:] not in ((1, 28, 28), (28, 28)):
        raise ValueError(f"images must have shape (N, 1, 28, 28) or (N, 28, 28), got {x_shape or type(x)}")
    n = int(x_shape[0])
    if not 1 <= n <= max_batch:
        raise ValueError(f"batch of {n} images; this model takes 1 to {max_batch} (its max_batch)")
    y_shape = getattr(y, "shape", None)
    if y_shape != (n,):
        raise ValueError(f"labels must have shape ({n},) to match the images, got {y_shape}")
    if not np.issubdtype(np.dtype(y.dtype), np.integer):
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    if not np.issubdtype(np.dtype(x.dtype), np.floating):
        raise ValueError(f"images must be floating point, got dtype {x.dtype}")
    on_gpu = type(x).__module__.split(".")[0] != "numpy"
    # The labels (n integers) are read on the host; a device batch's images are counted by a kernel of
    # ours: CuPy's min, max and isfinite().all() reduce through CUB, each a module NVRTC compiles on a
    # first run (docs/model.md, "A batch's check on the device").
    labels = y.get() if hasattr(y, "get") else np.asarray(y)
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= CLASSES:
        raise ValueError(f"labels must be in [0, {CLASSES}), got values from {lo} to {hi}")
    if count_nonfinite(x) if on_gpu else not bool(np.isfinite(x).all()):
        raise ValueError("images contain NaN or infinite values")
    return n


def bytes_per_image(policy: Policy | None = None, models: int = 1) -> int:
    """Bytes per image of max_batch that a model allocates under ``policy``: its buffers, and the scratch
    of every engine that may run its operations (cuDNN's unpooled outputs, our argmax bytes, fc1's ReLU
    bits for cuBLASLt)."""
    policy = policy or Policy()
    own = sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in BUFFERS.values())
    ops = [Stage(spec, None, 1, models) for spec in STAGES] + [Head(None, None, 1, models)]
    return own + sum(e.scratch_per_image(op, policy) for op in ops for e in registry.serving(op, policy)[0])


def check_pack(policy: Policy, models: int) -> None:
    """A one-line ValueError, before any GPU work, when no engine runs some operation of a pack of ``models``
    models under ``policy`` (the engines' own rules: Note [packs] in lenet/ops.py)."""
    for op in [Stage(spec, None, 1, models) for spec in STAGES] + [Head(None, None, 1, models)]:
        engines, why = registry.serving(op, policy)
        if not engines:
            raise ValueError(f"no engine runs the {op.kind} {op.name} of a pack of {models} models under this policy: "
                             + "; ".join(f"{k} {v}" for k, v in why.items()))


def models_that_fit(max_batch: int, free_bytes: int, policy: Policy | None = None) -> int:
    """How many models of ``max_batch`` images a pack may hold in ``free_bytes`` (check_memory's margin)."""
    return max(0, int((0.9 * free_bytes - (256 << 20)) // (max_batch * bytes_per_image(policy, 2))))


def check_memory(max_batch: int, free_bytes: int, total_bytes: int, policy: Policy | None = None,
                 models: int = 1) -> None:
    """A one-line ValueError, before anything is allocated, when a model (or a pack of ``models``) for
    ``max_batch`` images each cannot fit the GPU's free memory (with 10% and 256 MB kept for workspaces
    and libraries)."""
    need = models * max_batch * bytes_per_image(policy, models)
    if need > 0.9 * free_bytes - (256 << 20):
        gb = 1 << 30
        if models > 1:
            fit = models_that_fit(max_batch, free_bytes, policy)
            raise ValueError(f"a pack of {models} models at {max_batch:,} images each needs about {need / gb:.1f} GB "
                             f"of GPU memory; the GPU has {free_bytes / gb:.1f} GB free of {total_bytes / gb:.1f} GB: "
                             f"{fit} such models fit")
        raise ValueError(f"a model for {max_batch:,} images needs about {need / gb:.1f} GB of GPU memory; the GPU "
                         f"has {free_bytes / gb:.1f} GB free of {total_bytes / gb:.1f} GB: use a smaller batch")


def check_hyperparameters(momentum, weight_decay, nesterov, label_smoothing, ema_decay) -> None:
    """One-line ValueErrors for the optimizer's and the loss's constants, before any GPU work."""
    if not (0.0 <= momentum < 1.0):
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if not (weight_decay >= 0.0 and math.isfinite(weight_decay)):
        raise ValueError(f"weight decay must be >= 0, got {weight_decay}")
    if nesterov and momentum == 0.0:
        raise ValueError("Nesterov momentum needs a momentum > 0")
    if not (0.0 <= label_smoothing < 1.0):
        raise ValueError(f"label smoothing must be in [0, 1), got {label_smoothing}")
    if ema_decay is not None and not (0.0 < ema_decay < 1.0):
        raise ValueError(f"the EMA decay must be in (0, 1), got {ema_decay}")


def per_model(value, models: int, name: str) -> list:
    """A setting of a pack (Note [packs] in lenet/ops.py): one value for every model, or a sequence of
    one per model."""
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != models:
            raise ValueError(f"{name}: {len(value)} values for a pack of {models} models; give one or {models}")
        return list(value)
    return [value] * models


def settings_of(models, **given) -> dict:
    """A model's settings (seed, momentum, weight_decay, nesterov, label_smoothing, ema_decay), one list of
    ``models`` values each (a pack's: one value for every model, or one each), every model's checked."""
    if isinstance(models, bool) or not isinstance(models, (int, np.integer)) or models < 1:
        raise ValueError(f"models must be an integer >= 1, got {models!r}")
    settings = {k: per_model(v, int(models), k) for k, v in given.items()}
    for m in range(int(models)):
        P.check_seed(settings["seed"][m])
        check_hyperparameters(*(settings[k][m] for k in ("momentum", "weight_decay", "nesterov", "label_smoothing",
                                                           "ema_decay")))
    return settings


def policy_of(policy, fused) -> Policy:
    """The Policy a model takes: ``policy`` (None: the default) with ``fused``, when given, as its fusion."""
    if policy is None:
        policy = Policy()
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a lenet.engines.Policy, got {type(policy).__name__}")
    return policy if fused is None else policy.replace(fused=bool(fused))
