"""PyTorch at its fastest for one LeNet training step: every form a speed-minded PyTorch user would try,
named, built and timed alike, so that a comparison takes the fastest of them (scripts/bench.py) and a
table can name each (scripts/bench.py --table).

A form is (mode, cudnn.benchmark, the SGD implementation, TF32, micro-batches):

  eager               the step as written: zero_grad, forward, cross-entropy, backward, optimizer.step()
  graph               the whole step captured in one CUDA graph and replayed (torch.cuda.graph)
  compile             the model through torch.compile (mode "default"), the step eager around it
  compile+graph       the compiled model, the whole step captured in one CUDA graph (the fastest form at
                      batch 1 to 128 on an H100: docs/results/speed.json)
  reduce-overhead     torch.compile(mode="reduce-overhead"): inductor's own CUDA graphs (cudagraph trees)
                      around the model's forward and backward, the optimizer's step eager
  max-autotune        torch.compile(mode="max-autotune"): kernels chosen by timing, and inductor's CUDA graphs
  max-autotune+graph  torch.compile(mode="max-autotune-no-cudagraphs"), the whole step captured in one graph

each with cudnn.benchmark off ("nobench") and on ("bench"), and SGD momentum 0.9 as torch.optim.SGD's
foreach or fused kernels; float32 with TF32 off unless the form says tf32 (cudnn.allow_tf32 and
cuda.matmul.allow_tf32 on: PyTorch's fastest arithmetic, reported apart). Above MICRO images a form also
runs as gradient accumulation over MICRO-image micro-batches (how a PyTorch user runs a large batch),
named "accumN". A form's key is MODE/BENCH/OPT[/tf32] (e.g. "compile+graph/bench/fused"); --torch-forms
takes presets (PRESETS) and shell patterns over the keys.

torch.compile is slow to build (max-autotune took 126 s at batch 64 on an H100); the compiled graphs are
cached by inductor, so a form's second optimizer or benchmark setting at the same batch size builds fast.
Everything here but the building and timing runs without a GPU (tests/test_bench_cpu.py).
"""

from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass, replace

MODES = ("eager", "graph", "compile", "compile+graph", "reduce-overhead", "max-autotune", "max-autotune+graph")
# torch.compile's mode per form mode (None: not compiled), and whether we capture the whole step ourselves
COMPILE_MODE = {"eager": None, "graph": None, "compile": "default", "compile+graph": "default",
                "reduce-overhead": "reduce-overhead", "max-autotune": "max-autotune",
                "max-autotune+graph": "max-autotune-no-cudagraphs"}
CAPTURED = ("graph", "compile+graph", "max-autotune+graph")
INDUCTOR_GRAPHS = ("reduce-overhead", "max-autotune")   # inductor's cudagraph trees: no accumulation over them
OPTIMIZERS = ("foreach", "fused")
MICRO = 8192   # above this batch size, forms also run as micro-batches of this many images
PRESETS = {
    "quick": ("eager/*/*", "graph/*/*", "compile+graph/*/*"),   # the default: one compile per batch size
    "nocompile": ("eager/*/*", "graph/*/*"),
    "compile": ("compile*/*/*", "reduce-overhead/*/*", "max-autotune*/*/*"),
    "all": ("*",),
    "none": (),   # ours alone (a comparison of two trees of ours)
}
LR = 0.01


@dataclass(frozen=True)
class Form:
    mode: str
    benchmark: bool
    optimizer: str
    tf32: bool = False
    micro: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"form mode {self.mode!r}: one of {', '.join(MODES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"form optimizer {self.optimizer!r}: one of {', '.join(OPTIMIZERS)}")
        if self.micro is not None and self.mode in INDUCTOR_GRAPHS:
            raise ValueError(f"{self.mode} replays inductor's graphs, whose outputs the next micro-batch overwrites: "
                             f"no accumulation over them")

    @property
    def key(self) -> str:
        return "/".join([self.mode, "bench" if self.benchmark else "nobench", self.optimizer]
                        + (["tf32"] if self.tf32 else []))

    @property
    def name(self) -> str:
        """As the tables print it: torch MODE BENCH OPT [tf32] [accumN]."""
        return " ".join(["torch", self.mode, "bench" if self.benchmark else "nobench", self.optimizer]
                        + (["tf32"] if self.tf32 else []) + ([f"accum{self.micro}"] if self.micro else []))

    @property
    def compile_mode(self) -> str | None:
        return COMPILE_MODE[self.mode]

    @property
    def captured(self) -> bool:
        return self.mode in CAPTURED

    @property
    def arithmetic(self) -> str:
        return "TF32 (cuDNN and matmul)" if self.tf32 else "float32, TF32 off"


def every_form(tf32: bool = False) -> list[Form]:
    return [Form(m, b, o, tf32) for m in MODES for b in (False, True) for o in OPTIMIZERS]


def select(specs, tf32: bool = False) -> list[Form]:
    """The forms (float32, or TF32 with ``tf32``) whose keys match any of ``specs``: presets (PRESETS) and shell
    patterns over MODE/BENCH/OPT, in MODES order; a spec that matches nothing is a one-line ValueError."""
    patterns = []
    for s in specs:
        patterns += PRESETS.get(s, (s,))
    forms = every_form(tf32)
    suffix = "/tf32" if tf32 else ""
    for p in patterns:
        if not any(fnmatch.fnmatchcase(f.key, p) or fnmatch.fnmatchcase(f.key, p + suffix) for f in forms):
            raise ValueError(f"--torch-forms {p!r} matches no form: presets {', '.join(PRESETS)}, or patterns over "
                             f"MODE/BENCH/OPT with MODE one of {', '.join(MODES)}, BENCH bench or nobench, OPT "
                             f"foreach or fused (e.g. 'graph/bench/*')")
    return [f for f in forms if any(fnmatch.fnmatchcase(f.key, p) or fnmatch.fnmatchcase(f.key, p + suffix)
                                    for p in patterns)]


def at_batch(forms: list[Form], batch: int, micro: int = MICRO) -> list[Form]:
    """The forms to time at ``batch``: each as given, and above ``micro`` images each that may accumulate
    also as micro-batches of ``micro``."""
    out = list(forms)
    if batch > micro:
        out += [replace(f, micro=micro) for f in forms if f.mode not in INDUCTOR_GRAPHS]
    return out


def fastest(results: dict, names) -> str | None:
    """The name among ``names`` with the lowest us_per_step in ``results`` (a form that failed has none)."""
    timed = {n: results[n]["us_per_step"] for n in names if "us_per_step" in results.get(n, {})}
    return min(timed, key=timed.get) if timed else None


# ---------------------------------------------------------------------- on the GPU

def set_flags(form: Form) -> None:
    """The backend flags a form runs under (set before building it and before every timed run)."""
    import torch

    torch.backends.cudnn.benchmark = form.benchmark
    torch.backends.cudnn.allow_tf32 = form.tf32
    torch.backends.cuda.matmul.allow_tf32 = form.tf32
    torch.set_float32_matmul_precision("high" if form.tf32 else "highest")


class TorchStep:
    """One form's training step at ``batch`` images: PyTorch's LeNet with our initialization (seed 0), SGD
    momentum 0.9 (Nesterov, weight decay where given), cross-entropy (label-smoothed where given); ``inputs()`` gives the step's (images, labels), by default fixed random
    tensors (a benchmark's), or whatever the caller reads (an epoch's gather from a device index buffer).
    Built and warmed up on construction (compile and cudnn.benchmark's search there, timed as build_s);
    ``step()`` runs one; ``stream`` is where its work goes."""

    def __init__(self, form: Form, batch: int, inputs=None, weight_decay: float = 0.0, lr: float = LR,
                 nesterov: bool = False, label_smoothing: float = 0.0):
        import torch

        from lenet.params import init_host
        from torch_lenet import from_state

        self.form, self.batch, self.label_smoothing = form, batch, label_smoothing
        set_flags(form)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        self.model = from_state(init_host(0))
        self.run_model = self.model if form.compile_mode is None else \
            torch.compile(self.model, mode=form.compile_mode, dynamic=False)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay,
                                   nesterov=nesterov, **{form.optimizer: True})
        if inputs is None:
            g = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(batch, 1, 28, 28, device="cuda", generator=g)
            y = torch.randint(0, 10, (batch,), device="cuda", generator=g)
            inputs = lambda: (x, y)   # noqa: E731
        self.inputs = inputs
        self.graph = None
        # A captured form warms up on a side stream (what capture needs) and replays there; the others run
        # on the current stream, where inductor's own graphs expect them.
        self.stream = torch.cuda.Stream() if form.captured else torch.cuda.current_stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(5):
                self._step()
        torch.cuda.synchronize()
        if form.captured:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.stream):
                self._step()
            torch.cuda.synchronize()
        self.build_s = time.perf_counter() - t0
        self.peak = torch.cuda.max_memory_allocated() - base

    def _step(self):
        import torch
        import torch.nn.functional as F

        if self.form.mode in INDUCTOR_GRAPHS:
            torch.compiler.cudagraph_mark_step_begin()
        # a captured step keeps its gradient buffers (set_to_none would free what the graph wrote into)
        self.opt.zero_grad(set_to_none=not self.form.captured)
        x, y = self.inputs()
        ls = self.label_smoothing
        if self.form.micro is None:
            F.cross_entropy(self.run_model(x), y, label_smoothing=ls).backward()
        else:   # the mean over the whole batch, accumulated micro-batch by micro-batch
            for s in range(0, self.batch, self.form.micro):
                xs, ys = x[s:s + self.form.micro], y[s:s + self.form.micro]
                (F.cross_entropy(self.run_model(xs), ys, reduction="sum", label_smoothing=ls) / self.batch).backward()
        self.opt.step()

    def step(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()

    def close(self):
        del self.model, self.run_model, self.opt, self.graph, self.inputs
        release()


def release() -> None:
    """What a closed (or failed) form held: its compiled graphs and inductor's graph pools, its memory."""
    import gc

    import torch

    gc.collect()
    torch.compiler.reset()
    if torch.cuda.is_available():   # inductor's graph pools (torch.compiler.reset frees them too from 2.13 on)
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()
    torch.cuda.empty_cache()


def time_steps(v: TorchStep, k: int) -> float:
    """Microseconds per step over k steps of ``v``, CUDA events on its stream."""
    import torch

    set_flags(v.form)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(v.stream):
        s.record()
        for _ in range(k):
            v.step()
        e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1000 / k
