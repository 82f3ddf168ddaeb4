"""The whole training step in one launch of thread-block clusters (step_cluster.cu, sm_90 and newer), or two
above one cluster's images: its forms and its launcher, as our engine binds it (lenet/engines/ours_step.py) and
the workbench times its variants (dev/step_cluster.py).

Note [the whole step's batch sizes]: a cluster of eight blocks takes one image or two (SC_MAXG), at 512 or 256
threads a block: step_cluster (one image, 43 KB of shared memory a block), step_cluster_t256, step_cluster_g2
(62 KB) and step_cluster_g2_t256. On an H200 one image a cluster beats the chain from one image to about 24
(8 images: 13.3 us a step against 30.5) and is level with it at 32, where its clusters begin to outnumber what
fits beside each other; at 256 threads a block (more blocks an SM) it still wins at 32-40 (19.7-21.0 us against
25.0-25.9), two images a cluster at 48-56 (22.1-22.6 against 27.1-29.6), two at 256 threads at 64-80 (27.7-28.5
against 28.6-33.8); at 96 the chain wins against these (35.8-36.4 against 39.8 and more). Three and four images
a cluster lost to these (dev/step_cluster.cu's _g3, _g4: each phase's work grows with the images, its block's
threads do not).
Our engine offers each form over the batch sizes of FORMS, about where it won, and the planner times those
offered against the chain (docs/kernels.md, "The whole step"). Each form offered is a module a first run
compiles (0.7-2.4 s of a CPU, started at start-up: Ours.warm), so the ranges overlap little: at the default
batch size (64) one form is offered.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

MODULE = "step_cluster"
RANKS = 8              # blocks a cluster (SC_RANKS)
ARCH = 90              # thread-block clusters
UPDATE_THREADS = 256


@dataclass(frozen=True)
class Form:
    """A form of the whole step our engine offers: its module, its candidate's name, and the batch sizes it is
    offered at (Note [the whole step's batch sizes])."""

    module: str
    name: str
    smallest: int
    largest: int


FORMS = (Form(MODULE, "cluster step", 1, 32),
         Form("step_cluster_t256", "cluster step, 256 threads", 24, 40),
         Form("step_cluster_g2", "cluster step, 2 images a cluster", 33, 56),
         Form("step_cluster_g2_t256", "cluster step, 2 images a cluster, 256 threads", 57, 80))
LIMIT = max(f.largest for f in FORMS)   # the largest batch our engine offers the whole step at


def forms(n: int) -> list[Form]:
    """The forms offered at batch n."""
    return [f for f in FORMS if f.smallest <= n <= f.largest]


def form(name: str) -> Form:
    """The form a candidate names; a ValueError naming the forms where none does."""
    found = next((f for f in FORMS if f.name == name), None)
    if found is None:
        raise ValueError(f"{name!r} is not a form of the whole step: {', '.join(f.name for f in FORMS)}")
    return found


def _defines(module: str) -> dict:
    """A module's define= macros, {name: value} ('' for a bare name)."""
    from . import _declared

    return dict(d.partition("=")[::2] for d in _declared(module).defines)


@functools.lru_cache(maxsize=None)
def shape(module: str = MODULE) -> tuple[int, int, int]:
    """(threads a block, dynamic shared memory in bytes, images a cluster) of a module of step_cluster.cu or of
    the workbench's: its declaration's smem= and define= (SC_THREADS; SC_MAXG, images a cluster;
    else the files' defaults)."""
    from . import _declared

    defines = _defines(module)
    return int(defines.get("SC_THREADS", 512)), _declared(module).smem_bytes(0), int(defines.get("SC_MAXG", 1))


class ClusterStep:
    """One training step of a model's buffers at batch n on ``stream``: ``x``, ``labels`` its input rows;
    ``loss`` (lenet.ops.LossTensors) the totals, logits and label smoothing (a float); ``update``
    (lenet.ops.UpdateTensors) the flat buffers, the device learning rate and the rule. One model only.
    ``prof``: the workbench's phase clock (a module compiled with SC_PROFILE), else None."""

    def __init__(self, x, labels, loss, update, n: int, stream, module: str = MODULE, prof=None):
        import cupy

        from . import kernel
        from .launch import Launch

        if update.models != 1:
            raise ValueError("the whole step runs one model, not a pack")
        f32, i32, null = np.float32, np.int32, np.uint64(0)
        threads, smem, maxg = shape(module)
        self.module, self.n, self.clusters = module, int(n), -(-int(n) // maxg)
        c, u = self.clusters, update
        rows = c > 1   # the gradients into rows of part, then the update's launch
        total = int(u.params.size)
        with stream:   # zeroed on the step's stream, before its first launch (a non-blocking stream: CuPy's
            # default one would not be ordered before it)
            self.part = cupy.zeros((c, total), cupy.float32) if rows else None   # zero where no parameter is
            self.part_loss = cupy.zeros(c, cupy.float32)
            self.part_correct = cupy.zeros(c, cupy.int32)
        ema = u.ema if u.ema is not None else null
        rule = (f32(u.momentum), f32(u.weight_decay), i32(bool(u.nesterov)), f32(1.0 - (u.ema_decay or 0.0)))
        running = loss.running if loss.running is not None else null
        scale = f32(1.0 / n)
        self.launches = [Launch(kernel(module, "step_cluster_kernel"), (RANKS * c,), (threads,), (
            x, labels, i32(n), u.params, u.grads, u.velocity, ema, u.lr, *rule, f32(loss.label_smoothing), scale,
            scale, loss.loss, loss.correct, running, self.part if rows else null, self.part_loss,
            self.part_correct, loss.logits, null if prof is None else prof), stream, shared_mem=smem)]
        if rows:
            self.launches.append(Launch(kernel(module, "step_cluster_update_kernel"),
                                        (-(-total // UPDATE_THREADS),), (UPDATE_THREADS,), (
                self.part, i32(c), u.params, u.grads, u.velocity, ema, u.lr, *rule, self.part_loss,
                self.part_correct, scale, loss.loss, loss.correct, running), stream))

    def __call__(self) -> None:
        for launch in self.launches:
            launch()
