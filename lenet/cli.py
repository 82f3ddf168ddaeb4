"""What the programs share: flags for algorithms and sizes, one-line errors, the GPU facts."""

from __future__ import annotations

import argparse
import re
import sys


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2), no usage block."""

    def error(self, message: str):  # noqa: D102
        self.exit(2, f"{self.prog}: error: {message}\n")


def byte_size(text: str) -> int:
    """'1048576', '64M', '1.5G', '512k' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes or a number with K, M or G")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()])


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be an integer >= 1") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be an integer >= 1")
    return v


def nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be a number >= 0") from None
    if not (v >= 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be a finite number >= 0")
    return v


def algo_spec(text: str) -> str:
    # Names are checked here, without a GPU; support for the shapes is checked when the model is built.
    from descriptors.algorithms import AlgoPolicy

    try:
        AlgoPolicy.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_algorithm_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("convolution algorithms")
    g.add_argument("--algo", type=algo_spec, default="heuristic", metavar="SPEC",
                   help="heuristic (cuDNN's ranked guess), exhaustive (time every candidate), one "
                        "algorithm name for every direction that has it (e.g. fft, implicit_gemm), or "
                        "per direction: fwd=NAME,bwd-data=NAME,bwd-filter=NAME (default: heuristic)")
    g.add_argument("--workspace-limit", type=byte_size, default=None, metavar="BYTES",
                   help="largest convolution workspace an algorithm may use, e.g. 64M (default: no limit)")
    g.add_argument("--deterministic", action="store_true",
                   help="only algorithms cuDNN marks deterministic (bit-identical reruns)")
    g.add_argument("--allow-winograd", action="store_true",
                   help="let heuristic/exhaustive pick the Winograd algorithms, which are off by up to "
                        "~1e-3 relative in float32 (naming one in --algo always works)")


def add_speed_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speed")
    g.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="capture the whole step in a CUDA graph and replay it (default: on)")
    g.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                   help="conv+bias+ReLU in one cuDNN call where cuDNN runs it, and the fully connected layers "
                        "as cuBLASLt matmuls with bias/ReLU/bias-gradient epilogues (default: on)")


def policy_from(args):
    from descriptors.algorithms import AlgoPolicy

    return AlgoPolicy.parse(args.algo, workspace_limit=args.workspace_limit, deterministic=args.deterministic,
                            allow_winograd=args.allow_winograd)


def run(main) -> None:
    """Run a program's main; known failures become one plain sentence and exit status 2."""
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except Exception as e:  # only the failures a user can act on are turned into one line
        from descriptors.algorithms import AlgorithmNotSupportedError
        from descriptors.errors import CudnnLoadError, NoGpuError

        from .data import DataError

        if isinstance(e, (NoGpuError, CudnnLoadError, AlgorithmNotSupportedError, DataError, ValueError)):
            print(f"error: {e}", file=sys.stderr)
            code = 2
        elif isinstance(e, ImportError):
            print(f"error: a GPU package is missing ({e}); install the GPU stack with "
                  f"pip install '.[cu13]'", file=sys.stderr)
            code = 2
        else:
            raise
    sys.exit(code or 0)


def device_facts(model) -> dict:
    import descriptors

    v = model.blas.version()
    return {"gpu": model.handle.gpu_name, "cudnn": descriptors.version_string(),
            "cublas": f"{v // 10000}.{v % 10000 // 100}.{v % 100}"}


def algorithm_rows(model, n: int) -> list[dict]:
    return [{"layer": layer, **r.as_dict()} for (layer, _), r in model.algorithms(n).items()]


def fused_line(model, n: int) -> str:
    pl = model.plan(n)
    fc = "cuBLASLt with bias/ReLU/bias-gradient epilogues" if pl.lt is not None else f"cuBLAS ({pl.lt_note})"
    def conv(layer):
        t = pl.fused_ms.get(layer)
        if t is None:
            return f"{layer} no" + (" (cuDNN cannot fuse this algorithm)" if model.fused else "")
        return f"{layer} {'yes' if pl.fused[layer] else 'no'} ({t[0] * 1000:.1f} us fused, {t[1] * 1000:.1f} us plain)"
    return "conv+bias+ReLU fused: " + ", ".join(conv(k) for k in pl.fused) + f"\nfully connected: {fc}"


def format_algorithms(rows: list[dict], workspace: int) -> str:
    lines = [f"{'layer':<6} {'direction':<10} {'algorithm':<22} {'policy':<10} {'time':>10} "
             f"{'workspace':>12}  {'det':<3} math"]
    for r in rows:
        t = f"{r['time_ms'] * 1000:.1f} us" if r["time_ms"] is not None else "-"
        lines.append(f"{r['layer']:<6} {r['direction']:<10} {r['algo']:<22} {r['policy']:<10} {t:>10} "
                     f"{r['workspace_bytes']:>10} B  {'yes' if r['deterministic'] else 'no':<3} "
                     f"{r['math_type']}")
    lines.append(f"workspace total: {workspace} B (one buffer shared by all convolutions)")
    return "\n".join(lines)
