"""What the programs share: flags for algorithms and sizes, one-line errors, the GPU facts.

A floor below the engines and the model: what it needs of them (the --engine choices, the Policy that
checks --algo and is made from the flags, the model whose facts it prints) the program hands it."""

from __future__ import annotations

import argparse
import os
import re
import sys

from . import __version__

_invoked_as: str | None = None   # set by the `lenet` command: "lenet train"
_leaves_fast = False   # set by lenet.startup.start_gpu: its threads may be inside an import or a CUDA call


def leave_without_teardown() -> None:
    """From now on the parser's exits (--help, a bad flag) go through ``leave``: threads started before the
    flags were parsed (lenet.startup.start_gpu) may be inside an import or a CUDA call."""
    global _leaves_fast
    _leaves_fast = True


def invoked_as(name: str) -> None:
    """Name the program as the `lenet` command ran it (its usage lines and errors say so)."""
    global _invoked_as
    _invoked_as = name


def prog(module: str) -> str:
    """The program's name as it was run: `lenet train`, `lenet-train`, or `python -m lenet.train`."""
    if _invoked_as:
        return _invoked_as
    base = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return base if base.startswith("lenet-") else f"python -m lenet.{module}"


class _Formatter(argparse.HelpFormatter):
    """Help text wrapped at spaces only: flag names and algorithm specs stay whole."""

    def _split_lines(self, text, width):
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2), no usage block, help wrapped at spaces; a value
    that starts with '-' (``--workspace-limit -5M``) reaches its flag's check instead of being
    taken for a flag."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        # A value of a many-valued flag that starts with '-' and a digit (``lenet sweep --cutout -1:4``, a range,
        # or ``--lr -0.1 0.1``) is a value to check, not a flag: Python 3.13's own rule, whose earlier one took
        # only plain negative numbers (our flags never look like numbers).
        self._negative_number_matcher = re.compile(r"-\.?\d")
        self.add_argument("--version", action="version", version=f"%(prog)s (lenet-cudnn {__version__})")

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        takes_value = {s for a in self._actions if isinstance(a, argparse._StoreAction) and a.nargs is None
                       for s in a.option_strings}
        out, i = [], 0
        while i < len(args):
            if args[i] == "--":   # the rest are inputs, whatever they start with
                out += args[i:]
                break
            if args[i] in takes_value and i + 1 < len(args) and args[i + 1].startswith("-") \
                    and args[i + 1] not in self._option_string_actions:
                out.append(f"{args[i]}={args[i + 1]}")
                i += 2
                continue
            if self._unknown_flag(args[i]):
                from .files import show

                near = self._nearest([args[i]])
                self.error(f"unrecognized argument '{show(args[i])}': none of this program's flags"
                           + (f" (did you mean {near}?)" if near else "")
                           + f"; an input whose name starts with '-' is given as ./{show(args[i])}")
            out.append(args[i])
            i += 1
        return super().parse_known_args(out, namespace)

    def _unknown_flag(self, arg: str) -> bool:
        """Whether ``arg`` looks like a flag and is none of ours, in a program that takes inputs: argparse
        would take it for a flag and say an input is missing (predict -dash.png: "required: INPUT")."""
        if not any(not a.option_strings for a in self._actions) or not arg.startswith("-") or arg in ("-", "--"):
            return False
        if self._negative_number_matcher.match(arg):
            return False
        name = arg.split("=", 1)[0]
        return name not in self._option_string_actions and not (
            name.startswith("--") and any(o.startswith(name) for o in self._option_string_actions))

    def error(self, message: str):  # noqa: D102
        from .files import escaped

        self.exit(2, f"{self.prog}: error: {escaped(message)}{self._did_you_mean(message)}\n")

    def _did_you_mean(self, message: str) -> str:
        """For argparse's "unrecognized arguments: ...": this program's flags nearest to the unknown ones
        (``--batchsize`` -> --batch-size, sweep's ``--seed`` -> --seeds), or nothing."""
        head = "unrecognized arguments: "
        near = self._nearest(message[len(head):].split()) if message.startswith(head) else ""
        return f" (did you mean {near}?)" if near else ""

    def _nearest(self, words) -> str:
        """This program's flags nearest to the unknown ones among ``words``, space-separated ('' for none)."""
        import difflib

        ours = [o for o in self._option_string_actions if o.startswith("--")]
        near = [m for word in words if word.startswith("--")
                for m in difflib.get_close_matches(word.split("=", 1)[0], ours, n=1, cutoff=0.75)]
        return " ".join(dict.fromkeys(near))

    def exit(self, status=0, message=None):  # noqa: D102
        from .interrupt import last_line

        if message:
            last_line(message, status)   # one last line, whatever signal comes (lenet/interrupt.py)
        if not _leaves_fast:
            super().exit(status)
        leave(status)   # start_gpu's threads may be inside an import or a CUDA call


def byte_size(text: str) -> int:
    """'1048576', '64M', '1.5G', '512k' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use a size >= 0 in bytes or with K, M or G "
                                         f"(e.g. 64M)")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()])


def _int_at_least(text: str, low: int) -> int:
    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or v < low:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be an integer >= {low}")
    return v


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def int_from_to(low: int, high: int, unit: str = ""):
    """An argparse type: an integer from low to high, its error naming both ends."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or not low <= v <= high:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be an integer from {low} to {high}{unit}")
        return v
    parse.__name__ = "integer"
    return parse


MAX_BATCH = 1 << 20   # images in one batch: its buffers alone take ~45 GB of GPU memory at this size


def batch_size(text: str) -> int:
    """A batch size: an integer from 1 to MAX_BATCH (checked before any memory is taken)."""
    v = _int_at_least(text, 1)
    if v > MAX_BATCH:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: at most {MAX_BATCH} images a batch")
    return v


def nonneg_int(text: str) -> int:
    return _int_at_least(text, 0)


def nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be a number >= 0") from None
    if not (v >= 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be a finite number >= 0")
    return v


def unit_interval(text: str, *, closed_low: bool = True) -> float:
    """A number in [0, 1) (or (0, 1) when not closed_low)."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    ok = (0.0 <= v < 1.0) if closed_low else (0.0 < v < 1.0)
    if not ok:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be a number in "
                                         f"{'[0, 1)' if closed_low else '(0, 1)'}")
    return v


def open_unit_interval(text: str) -> float:
    return unit_interval(text, closed_low=False)


def accuracy(text: str) -> float:
    """An accuracy as a fraction: '0.91', '91' or '91%' -> 0.91."""
    t = text.strip().rstrip("%")
    try:
        v = float(t)
    except ValueError:
        v = float("nan")
    if text.strip().endswith("%") or v > 1.0:
        v /= 100.0
    if not (0.0 < v <= 1.0):
        raise argparse.ArgumentTypeError(f"invalid accuracy {text!r}: use a fraction in (0, 1] or a percentage "
                                         f"in (0, 100], e.g. 0.91 or 91%")
    return v


def algo_spec(parse):
    """--algo's type: the text, once ``parse`` (lenet.engines.Policy.parse) takes it. Names are checked here,
    without a GPU; support for the shapes is checked when the model is built."""
    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    return check


def add_algorithm_flags(p: argparse.ArgumentParser, flags: tuple, parse, algo: str | None = "heuristic",
                        algo_default: str = "") -> None:
    """The engine and algorithm flags: ``flags``, --engine's choices, and ``parse``, what checks an --algo
    spec (lenet.engines' FLAGS and Policy.parse, passed by the program); ``algo``: --algo's default (None: the
    program resolves it after the parse, as ``algo_default`` says)."""
    g = p.add_argument_group("stages and convolutions: engines, algorithms, chunks")
    g.add_argument("--engine", choices=flags, default="auto",
                   help="auto: every engine competes and the fastest measured wins, per stage and batch size "
                        "(our fused kernels, and cuDNN's descriptor API and graph API for each convolution); "
                        "ours: our fused stage kernels only; legacy: cuDNN's descriptor API only; graph: "
                        "cuDNN's graph API only (needs nvidia-cudnn-frontend) (default: auto)")
    g.add_argument("--algo", type=algo_spec(parse), default=algo, metavar="SPEC",
                   help="heuristic (each engine's first-ranked candidate, timed against the others'; on an "
                        "H100 or H200 our kernels for one model's stages and head, untimed where they pass their "
                        "check), "
                        "exhaustive (time every candidate), one cuDNN algorithm or graph plan name for every "
                        "direction that has it (e.g. fft, implicit_gemm, eng0; the stages then run on cuDNN), "
                        f"or per direction: fwd=NAME,bwd-data=NAME,bwd-filter=NAME (default: {algo_default or algo})")
    g.add_argument("--chunk", type=positive_int, default=None, metavar="N",
                   help="run every convolution and pooling in calls of at most N images (default: chosen by "
                        "timing: the whole batch or chunks of 1024 to 16384)")
    g.add_argument("--workspace-limit", type=byte_size, default=None, metavar="BYTES",
                   help="largest convolution workspace a candidate may use, e.g. 64M (default: no limit)")
    g.add_argument("--deterministic", action="store_true",
                   help="only deterministic candidates, chosen by rule rather than timing (bit-identical reruns)")
    g.add_argument("--allow-winograd", action="store_true",
                   help="let heuristic/exhaustive pick the Winograd algorithms, which are off by up to "
                        "~1e-3 relative in float32 (naming one in --algo always works)")
    add_plan_cache_flag(g)
    g.add_argument("--allow-tf32", action="store_true",
                   help="let candidates use TF32 tensor cores (off by up to ~3e-3 relative; PyTorch's default "
                        "for convolutions); default: exact float32")


def add_plan_cache_flag(p) -> None:
    p.add_argument("--no-plan-cache", dest="plan_cache", action="store_false",
                   help="neither read nor write the plan cache, the choices of earlier runs kept in "
                        "$LENET_PLAN_CACHE or ~/.cache/lenet/plans.json (default: use it, so a second run does "
                        "not search)")


def add_data_cache_flag(p) -> None:
    p.add_argument("--no-data-cache", dest="data_cache", action="store_false",
                   help="inflate gzipped IDX files on every run instead of keeping inflated copies in "
                        "$LENET_DATA_CACHE or ~/.cache/lenet/data (default: keep them, so a second run starts "
                        "sooner)")


def add_split_flags(p) -> None:
    """How much of the dataset a run reads (run_splits) and the evaluation's batch size."""
    p.add_argument("--train-size", type=positive_int, default=None, metavar="N",
                   help="train on the first N training images only (default: all)")
    p.add_argument("--test-size", type=positive_int, default=None, metavar="N",
                   help="evaluate on the first N test images only (default: all)")
    p.add_argument("--eval-batch-size", type=batch_size, default=1000, metavar="N", help="(default: 1000)")
    add_data_cache_flag(p)


def data_cache(args):
    """The folder of inflated dataset copies the flags ask for, or None."""
    from .data import cache_dir

    return cache_dir() if args.data_cache else None


def run_splits(args):
    """The dataset a run's flags name (--data-dir, --train-size, --test-size, the data cache), read and
    checked: (root, (train images, labels), (test images, labels), cache, pending cache entries, written
    by the caller once it is satisfied: Note [dataset cache] in lenet/data.py). One-line DataErrors."""
    from . import data

    root = data.find_dataset(args.data_dir)
    if root is None:
        raise data.DataError(data.not_found_message(args.data_dir))
    cache, pending = data_cache(args), []   # cache entries are written once the whole dataset validated
    (train_x, train_y), (test_x, test_y) = data.load_splits(root, ("train", "test"), cache, pending)
    for flag, want, have in (("--train-size", args.train_size, len(train_x)), ("--test-size", args.test_size,
                                                                             len(test_x))):
        if want is not None and want > have:
            raise data.DataError(f"{flag} {want} is more than the {have} images of {data.files.show(root)}'s "
                                 f"{'training' if flag == '--train-size' else 'test'} split; give at most {have}")
    return root, (train_x[: args.train_size], train_y[: args.train_size]), \
        (test_x[: args.test_size], test_y[: args.test_size]), cache, pending


def add_speed_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speed")
    g.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="capture the whole step in a CUDA graph and replay it (default: on)")
    g.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                   help="let operations fuse: our fused stage kernels (conv+bias+ReLU+pool), conv+bias+ReLU in one "
                        "cuDNN call where that is fastest, the fully connected layers as cuBLASLt matmuls with "
                        "bias/ReLU/bias-gradient epilogues (default: on)")


def policy_from(args, Policy):
    """The Policy (lenet.engines.Policy, passed by the program) the flags ask for; a one-line ValueError where
    the engine they name cannot run under the rest (the engines' own rules: lenet.engines.registry.flag_errors),
    or cannot run here (Policy.checked)."""
    return Policy.parse(args.algo, workspace_limit=args.workspace_limit, deterministic=args.deterministic,
                        allow_winograd=args.allow_winograd, engine=args.engine, allow_tf32=args.allow_tf32,
                        chunk=args.chunk, fused=args.fused).checked()


def run(main, name: str = "") -> None:
    """Run a program's main; known failures become one plain sentence, "NAME: error: ...", and
    exit status 2 (NAME as the program was run, as argparse's own errors say it)."""
    head = f"{name}: error:" if name else "error:"
    from . import files, interrupt

    interrupt.guard(name)   # Note [signals from the first line] in lenet/interrupt.py
    files.hold_writes()     # Note [nothing written before the checks] in lenet/files.py
    files.library_caches()  # before CuPy's import: Note [cache folders] in lenet/files.py
    for stream in (sys.stdout, sys.stderr):   # a name of bad bytes is printed escaped, never a traceback
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except Exception as e:  # only the failures a user can act on are turned into one line
        line = known_failure(e)
        if line is None:
            raise
        interrupt.last_line(f"{head} {files.escaped(line)}", 2)   # one line, whatever a name in it holds
        code = 2
    leave(code or 0)


# The import names of the GPU stack's packages (what pip install '.[cu13]' brings).
GPU_STACK = ("cupy", "cupy_backends", "cuda", "nvmath", "cudnn", "nvidia")


def known_failure(e: Exception) -> str | None:
    """The one line a failure a user can act on becomes, or None (a bug: its traceback stays)."""
    from .data import DataError

    known = (ValueError, DataError)
    try:   # the GPU stack's own errors, where it can be imported at all
        from descriptors.algorithms import AlgorithmNotSupportedError
        from descriptors.errors import CudnnLoadError, NoGpuError
        from descriptors.graph import GraphUnavailable

        known += (NoGpuError, CudnnLoadError, AlgorithmNotSupportedError, GraphUnavailable)
    except ImportError:
        pass
    if isinstance(e, known):
        return str(e)
    if isinstance(e, ImportError):
        missing = (e.name or "").split(".")[0]
        if missing in GPU_STACK:
            return f"a package of the GPU stack is missing ({e}); install it with pip install '.[cu13]'"
        return f"the Python package {missing or '?'} is missing ({e}); install it with pip install {missing}"
    if isinstance(e, OSError):   # a name the system refuses, a file that went away: one line
        from .files import os_error

        return os_error(e)
    return None


def leave(code: int) -> None:
    """End the program now: flush stdout and stderr, then exit without the interpreter's teardown.

    Note [fast exit]: when a program's main returns, every file it wrote is complete (the writer
    thread was waited for, each write atomic) and the GPU has finished. What Python's teardown
    would still do is release memory the process is about to lose anyway: CuPy's pools, the
    cuDNN and cuBLAS handles, the modules' globals, one by one: a share of a run's wall clock worth
    saving (docs/model.md, "Fast exit"). Only a program's entry point (cli.run)
    calls this; the leak check frees everything itself (scripts/profile_step.py) and never comes
    here, and an unexpected exception still leaves through the interpreter with its traceback.
    A cache entry still being written (files.write_later, a compiled module) is waited for first."""
    from .files import discard_temporaries, wait_for_writes
    from .interrupt import last_line

    for stream in (sys.stdout, sys.stderr):   # its last line out before the writes are waited for
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    last_line(None, code)   # a signal from here on ends it with this status, without a second line
    wait_for_writes()
    if "lenet.kernels.nvrtc" in sys.modules:   # compiles may still run on their threads
        sys.modules["lenet.kernels.nvrtc"].hold_writes()
    discard_temporaries()   # none is being written now: this run's own files (a kernel it could not cache)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed pipe (| head) or a closed stream: nothing to keep
            pass
    os._exit(code)


def device_facts(model) -> dict:
    import descriptors
    from descriptors.graph import available, frontend_version

    v = model.blas.version()
    if "cudnn" in sys.modules or frontend_version() is None:   # the frontend is loaded (a graph plan was built,
        ok, why = available()                                      # or its engine was named), or not installed
    else:   # no graph plan was needed (a stored choice, say): name the package without loading it
        ok, why = True, f"{frontend_version()} (not loaded: no graph plan in use)"
    return {"gpu": model.handle.gpu_name, "cudnn": descriptors.version_string(),
            "cublas": f"{v // 10000}.{v % 10000 // 100}.{v % 100}",
            "graph_api": f"nvidia-cudnn-frontend {why}" if ok else f"unavailable: {why}"}


def conv_rows(rows: list[dict]) -> list[dict]:
    """The rows of the stages' directions: fwd, bwd-data, bwd-filter of each cuDNN convolution, or fwd and bwd
    of a stage of ours."""
    return [r for r in rows if r["op"].split("+")[0] in ("fwd", "bwd", "bwd-data", "bwd-filter") and r["layer"][:4] == "conv"]


def format_rows(rows: list[dict], workspace: int) -> str:
    """The planned operations as a table: what runs each, in how many calls, measured time."""
    lines = [f"{'layer':<7} {'op':<18} {'engine':<8} {'plan / algorithm':<24} {'fused':<5} {'chunk':>12} "
             f"{'time':>10} {'workspace':>11}  error"]
    for r in rows:
        t = f"{r['time_ms'] * 1000:.1f} us" if r.get("time_ms") is not None else "-"
        chunk = f"{r['chunk']} x {r['chunks']}" if r.get("chunk") else "-"
        fused = {True: "yes", False: "no"}.get(r.get("fused"), "-")
        err = f"{r['error']:.1e}" if r.get("error") is not None else "-"
        algo = r["algo"] + (f" (rest: {r['rest']})" if r.get("rest") else "")
        lines.append(f"{r['layer']:<7} {r['op']:<18} {r['engine']:<8} {algo:<24} {fused:<5} {chunk:>12} {t:>10} "
                     f"{r.get('workspace_bytes', 0):>9} B  {err}")
    lines.append(f"workspace total: {workspace} B (one buffer shared by all convolutions); time: measured at plan "
                 f"time for the whole batch")
    return "\n".join(lines)
