"""Our CUDA kernels (this package's *.cu files), their declarations, and their launchers.

Note [module declarations]: each module (a unit NVRTC compiles, holding one kernel or one idea) is
declared once, in the .cu file its kernel is written in, by a line

    // module NAME: key=value ...

uses=A,B      the files compiled before it, in order (shared device functions, shapes)
arch=80       the lowest compute capability it runs on (cp.async and TF32 tensor-core products need
              80); without it, every generation we support (LOWEST_ARCH, 75). Candidates, the heuristic
              and the search offer a version only where the GPU (or LENET_KERNEL_ARCH: Note [kernel
              architecture] in lenet/kernels/nvrtc.py) is at least this; CI compiles each module for
              every architecture from there up (tests/test_modules_cpu.py).
define=M=V    a macro it is compiled with (one file, several versions: stage2_backward.cu)
stage=S direction=forward|backward version=V threads=T [images=1,2 smem=A+B*images | smem=A]
              a version of a stage kernel (lenet/engines/ours.py makes its candidates from these):
              T threads per image (forward) or per block (backward), the images a block takes at a
              time, and its dynamic shared memory in floats (the heuristic's choice among them:
              HEURISTIC in lenet/kernels/stages.py).
Every name, source list, macro and candidate elsewhere derives from these lines (``declared()``); a
module's kernel is named after it (``NAME_kernel``) where it holds one. The versions no GPU generation's
rows take are declared the same way in dev/'s files, read only by dev/'s scripts (``declare``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCE_THREADS = 256      # must match SCE_THREADS in softmax_ce_row.cu
SCE_MAX_BLOCKS = 64    # partial sums buffer size
SGD_THREADS = 256
# The modules every program may launch, whatever its engine (stage_reduce: the head's kernels sum
# their partial rows with it too).
COMMON_MODULES = ("head", "head_split", "head_weights", "softmax_ce", "sgd", "data", "stage_reduce")
PRELUDE = "griddep"   # compiled first in every module: griddep_entry(), Note [programmatic launch] in launch.py
FOLDER = Path(__file__).resolve().parent   # a plain path, not importlib.resources: see declared()


@dataclass(frozen=True)
class Module:
    """One module as its .cu file declares it (Note [module declarations])."""

    name: str
    file: str
    uses: tuple = ()
    defines: tuple = ()
    stage: str | None = None
    direction: str | None = None
    version: int = 0
    threads: int = 0
    images: tuple = ()
    smem: tuple = (0, 0)        # dynamic shared memory in floats: (fixed, per image)
    arch: int = 75              # the lowest compute capability it runs on (LOWEST_ARCH unless declared)
    folder: str | None = None   # where its file is: this package's (None), or dev/'s (``declare``)

    def runs_on(self, arch: int) -> bool:
        return int(arch) >= self.arch

    @property
    def kernel(self) -> str:
        return f"{self.name}_kernel"

    def smem_bytes(self, images: int) -> int:
        return 4 * (self.smem[0] + self.smem[1] * int(images))


_DECLARATION = re.compile(r"^// module (\w+):(.*)$", re.M)


def _parse(name: str, file: str, fields: str) -> Module:
    kw: dict = {}
    for item in fields.split():
        key, _, value = item.partition("=")
        if key == "uses":
            kw["uses"] = tuple(value.split(","))
        elif key == "define":
            kw["defines"] = kw.get("defines", ()) + (value,)
        elif key in ("stage", "direction"):
            kw[key] = value
        elif key in ("version", "threads", "arch"):
            kw[key] = int(value)
        elif key == "images":
            kw["images"] = tuple(int(v) for v in value.split(","))
        elif key == "smem":
            m = re.fullmatch(r"(?:(\d+)\+)?(\d+)\*images|(\d+)", value)
            if m is None:
                raise ValueError(f"{file}: module {name}: smem={value} is not A+B*images or A")
            kw["smem"] = (int(m.group(3)), 0) if m.group(3) else (int(m.group(1) or 0), int(m.group(2)))
        else:
            raise ValueError(f"{file}: module {name}: unknown key {key!r}")
    return Module(name, file[:-3], **kw)


@functools.lru_cache(maxsize=None)
def declared() -> dict[str, Module]:
    """Every module, by name, as the .cu files declare them (Note [module declarations]). Read with plain
    file reads: the flag parse imports this package while the start-up thread imports CuPy, and two
    threads importing importlib.resources met Python's import-deadlock guard (Note [overlapped start-up]
    in lenet/startup.py)."""
    out = {}
    for path in sorted(FOLDER.glob("*.cu")):
        for m in _DECLARATION.finditer(path.read_text()):
            out[m.group(1)] = _parse(m.group(1), path.name, m.group(2))
    return out


def declare(path) -> list[Module]:
    """The modules a .cu file outside this package declares (the versions dev/ keeps: dev/README.md), added
    to ``declared()`` for this process: compiled and launched as ours are, the files they use this package's.
    Stored choices never name them (``source_digest`` reads this package's files only)."""
    path = Path(path).resolve()
    out = []
    for m in _DECLARATION.finditer(path.read_text()):
        if m.group(1) in declared():
            raise ValueError(f"{path}: module {m.group(1)} is already declared (by {declared()[m.group(1)].file}.cu)")
        mod = _parse(m.group(1), path.name, m.group(2))
        out.append(declared().setdefault(mod.name, Module(**{**mod.__dict__, "folder": str(path.parent)})))
    return out


def stage_modules() -> tuple[str, ...]:
    """The modules of our stage kernels, every version, and the reduction they share."""
    return tuple(n for n, m in declared().items() if m.stage and m.folder is None) + ("stage_reduce",)


def __getattr__(name: str):
    if name == "STAGE_MODULES":
        return stage_modules()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


PACK = "__pack"   # a module's pack version: NAME__pack, compiled with LENET_PACK (Note [model from the grid])


def pack_module(name: str, models: int) -> str:
    """The module a launch for ``models`` models takes: ``name`` itself for one, its pack version else."""
    return name if models == 1 else name + PACK


def _declared(name: str):
    return declared()[name[: -len(PACK)] if name.endswith(PACK) else name]


def source(name: str) -> str:
    """The CUDA source module ``name`` is compiled from (its macros: ``options(name)``)."""
    m = _declared(name)
    own = Path(m.folder or FOLDER) / f"{m.file}.cu"
    return "\n".join([*((FOLDER / f"{part}.cu").read_text() for part in (PRELUDE, *m.uses)), own.read_text()])


def options(name: str) -> tuple[str, ...]:
    """NVRTC's options for module ``name`` (a pack version's: LENET_PACK too)."""
    pack = ("-DLENET_PACK",) if name.endswith(PACK) else ()
    return ("-std=c++17", *(f"-D{d}" for d in _declared(name).defines), *pack)


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """A digest of every kernel source of this package: stored choices of our kernels name it, so a
    changed kernel is searched and checked again (Note [checking a stage] in lenet/engines/reference.py)."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    for f in sorted(FOLDER.glob("*.cu")):   # the declarations, macros included, are in the files
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def every_module(arch: int) -> list[str]:
    """Every module a program may launch on a GPU of compute capability ``arch``: each declared in this package
    that runs there, then the pack versions of the stage and head modules (what lenet.engines' ours_stage and
    ours_head ask for a pack): what a wheel built on that GPU's machine holds compiled (Note [kernels built
    with the package] in lenet/kernels/nvrtc.py)."""
    own = [n for n, m in declared().items() if m.folder is None and m.runs_on(arch)]
    packed = set(stage_modules()) | {"head", "head_split", "head_weights", "head_tail"}
    return own + [n + PACK for n in own if n in packed]


def build_into(folder, arch: int) -> list[str]:
    """``every_module(arch)`` compiled into ``folder`` as the kernel cache names them; the files written."""
    from . import nvrtc

    return nvrtc.build_into(folder, arch, [(f"lenet.{n}", source(n), options(n)) for n in every_module(arch)])


def prefetch(names) -> None:
    """Start compiling (or reading from the kernel cache) these modules now, each on a thread of its
    own (Note [first run] in lenet/kernels/nvrtc.py); ``kernel`` finds them ready, or waits."""
    for name in names:
        _future(name)


def _future(name: str):
    from . import nvrtc

    return nvrtc.prefetch(f"lenet.{name}", functools.partial(source, name), options(name))


def _module(name: str):
    """The compiled module ``name``: compiled now, or by ``prefetch``'s thread (waited for)."""
    return _future(name).result()


def arch() -> int:
    """The compute capability our kernels are compiled for in this process: the GPU's, or LENET_KERNEL_ARCH's
    (Note [kernel architecture] in lenet/kernels/nvrtc.py)."""
    from . import nvrtc

    return nvrtc.kernel_arch()


def require_arch(gpu_name: str) -> None:
    """A one-line NoGpuError where the GPU is older than every generation our kernels support, and a
    ValueError where LENET_KERNEL_ARCH asks for what cannot run on it."""
    from . import nvrtc

    device = nvrtc.device_arch()
    if device < nvrtc.LOWEST_ARCH:
        from descriptors.errors import NoGpuError

        low = nvrtc.LOWEST_ARCH
        raise NoGpuError(f"no usable NVIDIA GPU: {gpu_name} is compute capability {device // 10}.{device % 10}; "
                         f"lenet-cudnn runs on {low // 10}.{low % 10} (Turing) and newer, and no extra of it supports "
                         f"older GPUs")
    nvrtc.kernel_arch(device)


_sm_count: int | None = None   # set by use_sm_count


def use_sm_count(sms: int) -> None:
    """The GPU's multiprocessors as the driver reported them (lenet/startup.py), before CuPy is imported."""
    global _sm_count
    _sm_count = int(sms)


def sm_count() -> int:
    """The current GPU's multiprocessors: launch shapes of ours are counted in blocks per SM."""
    global _sm_count
    if _sm_count is None:
        import cupy

        _sm_count = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
    return _sm_count


@functools.lru_cache(maxsize=None)
def kernel(module: str, name: str):
    """Kernel ``name`` of module ``module``, its module loaded onto the GPU on a first call.

    Note [a version removed under us]: a module's binary in the kernel cache is replaced by another
    version's (Note [first run] in lenet/kernels/nvrtc.py), and CuPy loads a module's file only when a
    first kernel of it is asked for: a run of another version of lenet (another checkout, an upgrade) that
    stored its binary in between left this run's path naming no file, and the load failed with
    CUDA_ERROR_FILE_NOT_FOUND (two checkouts' sweeps started together on one machine). The module is then
    built again, read from the cache or compiled, and loaded at once."""
    from . import nvrtc

    for attempt in range(3):
        built = _future(module)
        try:
            return built.result().get_function(name)
        except Exception as e:   # noqa: BLE001 (cupy_backends' CUDADriverError, by its message)
            if "CUDA_ERROR_FILE_NOT_FOUND" not in str(e) or attempt == 2:
                raise
            nvrtc.forget(f"lenet.{module}", built)   # not a build another thread started since


class SoftmaxCE:
    """Scratch for the softmax-CE kernel, or for a kernel that runs its reduction (the head's forward):
    one partial sum per block of up to ``blocks`` blocks, and the ticket (zeroed once)."""

    def __init__(self, blocks: int = SCE_MAX_BLOCKS, models: int = 1):
        import cupy

        self.blocks, self.models = int(blocks), int(models)
        self.partial_loss = cupy.zeros(self.blocks * self.models, dtype=cupy.float32)    # (models, blocks)
        self.partial_correct = cupy.zeros(self.blocks * self.models, dtype=cupy.int32)   # (models, blocks)
        self.ticket = cupy.zeros(self.models, dtype=cupy.uint32)                         # (models,)
        self._fn = kernel("softmax_ce", "softmax_ce_kernel")

    def forward_backward(self, logits, labels, dlogits, out, correct, n: int, *,
                         grad_scale: float, loss_scale: float, accumulate: bool = False, running=None,
                         label_smoothing=0.0, mean_with=None, models: int = 1) -> None:
        """out[0] = loss_scale * sum of row losses (+ out[0] when accumulating);
        dlogits = grad_scale * (softmax - target), unless dlogits is None;
        running[0] += the same loss, when running is given. The target is the one-hot label,
        smoothed by ``label_smoothing`` as PyTorch's cross_entropy does. With ``mean_with``
        (same shape as logits), the logits scored are (logits + mean_with) / 2. A pack of ``models``
        models has n rows each, one after another, and its own totals out[m], correct[m], running[m];
        its ``label_smoothing`` may be a device array (models,)."""
        classes = logits.shape[1]
        if models > self.models:
            raise ValueError(f"softmax-CE scratch made for {self.models} models, asked for {models}")
        blocks = max(1, min(self.blocks, (n + SCE_THREADS - 1) // SCE_THREADS))
        per_model = hasattr(label_smoothing, "data")
        self._fn((blocks, models), (SCE_THREADS,), (
            logits, np.uint64(mean_with.data.ptr if mean_with is not None else 0), labels,
            np.uint64(dlogits.data.ptr if dlogits is not None else 0), out, correct,
            self.partial_loss, self.partial_correct, self.ticket,
            np.uint64(running.data.ptr if running is not None else 0), np.int32(n), np.int32(classes),
            np.float32(grad_scale), np.float32(loss_scale), np.int32(1 if accumulate else 0),
            np.float32(0.0 if per_model else label_smoothing),
            np.uint64(label_smoothing.data.ptr if per_model else 0)))


def sgd_launch(stream, params, grads, velocity, lr_dev, momentum: float, weight_decay: float, nesterov: bool = False,
               ema=None, ema_decay: float = 0.0, models: int = 1, hyper=None):
    """A launch (lenet.kernels.launch.Launch) on ``stream`` of: params -= lr * (momentum-smoothed grads +
    weight_decay * params), Nesterov momentum when asked; and ema += (1 - ema_decay) * (params - ema)
    when ema is given. A pack of ``models`` models: the buffers are (models, size), lr_dev (models,),
    and ``hyper`` (models, 4) on the device their momentum, weight decay, nesterov, 1 - ema decay
    (sgd.cu)."""
    from .launch import Launch

    n = params.size // models
    blocks = max(1, min(-(-sm_count() // models), (n + SGD_THREADS - 1) // SGD_THREADS))   # one wave: Note [programmatic launch]
    return Launch(kernel("sgd", "sgd_kernel"), (blocks, models), (SGD_THREADS,), (
        params, grads, velocity, lr_dev, np.float32(momentum), np.float32(weight_decay), np.int32(bool(nesterov)),
        np.uint64(ema.data.ptr if ema is not None else 0), np.float32(1.0 - ema_decay), np.int32(n),
        np.uint64(hyper.data.ptr if hyper is not None else 0)), stream)


@dataclass(frozen=True)
class Augment:
    """Random translation by up to ``shift`` pixels each way, with ``flip`` a left-right mirror and
    with ``cutout`` a cutout x cutout square cleared to the background, drawn per image from (seed,
    epoch, position in the epoch): see lenet/kernels/data.cu. ``mirror`` mirrors every image instead
    (the second view of test-time augmentation)."""

    shift: int = 0
    flip: bool = False
    seed: int = 0
    mirror: bool = False
    cutout: int = 0

    def __post_init__(self):
        if not (isinstance(self.shift, int) and 0 <= self.shift <= 13):
            raise ValueError(f"augmentation shift must be an integer in 0..13 pixels, got {self.shift!r}")
        from ..data import CUTOUT_MAX

        if not (isinstance(self.cutout, int) and 0 <= self.cutout <= CUTOUT_MAX):
            raise ValueError(f"cutout must be an integer in 0..{CUTOUT_MAX} pixels, got {self.cutout!r}")

    @property
    def on(self) -> bool:
        return self.shift > 0 or self.flip or self.mirror or self.cutout > 0


NO_AUGMENT = Augment()
MIRROR = Augment(mirror=True)


def gather_batch(images, labels, order, start: int, n: int, mean: float, std: float, x, y,
                 lr: float | None = None, lr_out=None, augment: Augment | None = None, epoch: int = 0) -> None:
    """x[:n], y[:n] = normalized (augmented) images[order[start:start+n]], labels[...];
    lr_out[0] = lr if given. On CuPy's current stream.

    Note [the gather's launch]: a training loop launches this once a step, beside the step's graph.
    Through CuPy's kernel call its host time was more than a small batch's whole step on the GPU. The
    launch is prepared once for the arrays, the stream and the constants (lenet.kernels.launch.Launch,
    through the driver) and kept; a call sets the numbers that change (the order, its start, n and the grid,
    the rate, the epoch) and launches (docs/kernels.md, "Launches and compiles")."""
    import cupy

    from .launch import Launch

    a = augment or NO_AUGMENT
    stream = cupy.cuda.get_current_stream()
    key = (images.data.ptr, labels.data.ptr, x.data.ptr, y.data.ptr, stream.ptr, float(mean), float(std),
           a.shift, 2 if a.mirror else int(bool(a.flip)), a.seed & 0xFFFFFFFF, a.cutout)
    launch = _gathers.get(key)
    if launch is None:
        if len(_gathers) >= 32:
            _gathers.pop(next(iter(_gathers)))
        launch = _gathers[key] = Launch(
            kernel("data", "gather_batch_kernel"), (1,), (GATHER_THREADS,),
            (images, labels, np.uint64(0), np.int32(0), np.int32(0), np.float32(mean), np.float32(std), x, y,
             np.float32(0), np.uint64(0), np.int32(key[7]), np.int32(key[8]), np.uint32(key[9]), np.uint32(0),
             np.int32(key[10])),
            stream, programmatic=False)   # the kernel has no griddep_entry(): Note [programmatic launch]
    launch.set(2, order)
    launch.set(3, start)
    launch.set(4, n)
    launch.set(9, lr if lr is not None else 0.0)
    launch.set(10, lr_out.data.ptr if lr_out is not None else 0)
    launch.set(14, epoch & 0xFFFFFFFF)
    launch.set_grid(max(1, min(4096, (n * 784 + GATHER_THREADS - 1) // GATHER_THREADS)))
    launch()


GATHER_THREADS = 256
_gathers: dict = {}   # the prepared launches of gather_batch (Note [the gather's launch]), the newest last


def aug_rows(rows) -> np.ndarray:
    """A pack's augmentation table for gather_pack: one row (shift, flip, seed, cutout) a model, as data.cu's
    gather_pack_kernel reads it (flip 2 mirrors every image: test-time augmentation's second view); int32,
    the seed's 32 bits as they are."""
    table = np.array([[shift, flip, seed & 0xFFFFFFFF, cutout] for shift, flip, seed, cutout in rows], np.int64)
    return table.reshape(-1, AUG_FIELDS).astype(np.uint32).view(np.int32)


AUG_FIELDS = 4   # a row of aug_rows


def gather_pack(images, labels, orders, start: int, n: int, mean: float, std: float, x, y, aug, epochs,
                lr_table, lr_at, step: int, lr_out) -> None:
    """A pack's batch in one launch (data.cu's gather_pack_kernel): model m's rows [m n, (m + 1) n) of
    x and y from its own order orders[m], augmented by aug[m] = (shift, flip, seed, cutout) with the draws of
    epochs[m]; lr_out[m] = lr_table[lr_at[m] + step] (lr_out None: no rate, as an evaluation gathers)."""
    models, size = orders.shape
    if aug.shape != (models, AUG_FIELDS) or aug.dtype != np.int32 or not aug.flags.c_contiguous:
        raise ValueError(f"gather_pack's aug is one int32 row (shift, flip, seed, cutout) a model: ({models}, "
                         f"{AUG_FIELDS}), got {aug.dtype} {aug.shape} (lenet.kernels.aug_rows)")
    threads = 256
    blocks = max(1, min(-(-4096 // models), (n * 784 + threads - 1) // threads))
    def ptr(a):
        return np.uint64(0 if a is None else a.data.ptr)
    kernel("data", "gather_pack_kernel")((blocks, models), (threads,), (
        images, labels, orders, np.int32(size), np.int32(start), np.int32(n), np.float32(mean), np.float32(std),
        x, y, aug, epochs, ptr(lr_table), ptr(lr_at), np.int32(step), ptr(lr_out)))


DISTANCE_THREADS, DISTANCE_BLOCKS = 256, 264


def distance(out, ref) -> float:
    """|out - ref| / |ref| over two float32 device arrays of one size, accumulated in float64 in one pass
    (distance.cu), on CuPy's current stream; waits for it."""
    import math

    import cupy

    if out.size != ref.size or out.dtype != np.float32 or ref.dtype != np.float32:
        raise ValueError(f"distance takes two float32 arrays of one size, got {out.dtype} {out.shape} "
                         f"and {ref.dtype} {ref.shape}")
    out, ref = cupy.ascontiguousarray(out), cupy.ascontiguousarray(ref)
    n = out.size
    blocks = max(1, min(DISTANCE_BLOCKS, -(-n // DISTANCE_THREADS)))
    sums = cupy.empty(2 * blocks, dtype=cupy.float64)
    kernel("distance", "distance_kernel")((blocks,), (DISTANCE_THREADS,), (out, ref, np.int64(n), sums))
    d, r = sums.get().reshape(blocks, 2).sum(axis=0, dtype=np.float64)   # get(): waits for the stream
    num, den = math.sqrt(d), math.sqrt(r)
    return num / den if den > 0 else num


def count_nonfinite(x) -> int:
    """How many values of device array ``x`` are NaN or infinite (as float32: what the model trains
    on), counted by data.cu's kernel on CuPy's current stream; waits for it."""
    import cupy

    xf = cupy.ascontiguousarray(x, dtype=cupy.float32).ravel()
    count = cupy.zeros(1, dtype=cupy.uint64)
    threads = 256
    blocks = max(1, min(1024, -(-xf.size // threads)))
    kernel("data", "count_nonfinite_kernel")((blocks,), (threads,), (xf, np.int64(xf.size), count))
    return int(count.get()[0])


def device_copy(dst, src) -> None:
    """dst[...] = src on CuPy's current stream as one device-to-device copy: CuPy's own assignment
    runs a copy kernel, one more NVRTC compile on a first run (Note [first run] in
    lenet/kernels/nvrtc.py). Both contiguous, of one dtype and size; may be captured in a graph."""
    if not (dst.flags.c_contiguous and src.flags.c_contiguous and dst.dtype == src.dtype and dst.size == src.size):
        raise ValueError(f"device_copy takes two contiguous arrays of one dtype and size, got {dst.dtype} "
                         f"{dst.shape} and {src.dtype} {src.shape}")
    dst.data.copy_from_device_async(src.data, src.nbytes)


def copy_of(a):
    """A new device array holding a copy of contiguous ``a`` (device_copy)."""
    import cupy

    out = cupy.empty_like(a)
    device_copy(out, a)
    return out


def fill(a, value) -> None:
    """a[...] = value on CuPy's current stream, asynchronously and without CuPy's fill kernel (Note
    [first run] in lenet/kernels/nvrtc.py): a memset for 0, else sgd.cu's fill_kernel (contiguous
    float32 only). Either may be captured in a graph."""
    if value == 0:
        a.data.memset_async(0, a.nbytes)
        return
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise ValueError(f"fill sets contiguous float32 arrays to a nonzero value, got {a.dtype} {a.shape}")
    blocks = max(1, min(sm_count(), -(-a.size // SGD_THREADS)))
    kernel("sgd", "fill_kernel")((blocks,), (SGD_THREADS,), (a, np.float32(value), np.int32(a.size)))
