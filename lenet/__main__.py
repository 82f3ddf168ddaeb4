"""The `lenet` command (and python -m lenet): `lenet PROGRAM [flags]` runs one of the programs below,
as `git` and `pip` run theirs; `lenet` alone lists them. python -m lenet.PROGRAM keeps working."""

from __future__ import annotations

import sys

from . import __version__

PROGRAMS = (
    ("train", "lenet-train", "train LeNet-5 on an IDX dataset (Fashion-MNIST, MNIST, ...) and evaluate every epoch"),
    ("train_step", "lenet-train-step", "one SGD step on one batch: engines, plans, chunks, times, losses"),
    ("export", "lenet-export", "a checkpoint's parameters as .safetensors or .npz, PyTorch's names and shapes"),
    ("predict", "lenet-predict", "classify IDX images or PNG/JPEG pictures with a checkpoint"),
    ("sweep", "lenet-sweep", "train many configurations at once, K models a step: a grid, or an Optuna study"),
)


def _list(out) -> None:
    print(f"LeNet-5 on cuDNN + cuBLAS (lenet-cudnn {__version__}). Programs (each takes --help):", file=out)
    for module, script, what in PROGRAMS:
        sub = module.replace("_", "-")
        print(f"  lenet {sub:<11} (or {script:<16} or python -m lenet.{module})  {what}", file=out)


def train() -> None:
    """The lenet-train command: python -m lenet.train's start-up (startup.begin) before its imports."""
    from . import plot, startup

    startup.begin(then=plot.start_early)
    from .train import run

    run()


def train_step() -> None:
    """The lenet-train-step command, started as python -m lenet.train_step is."""
    from . import startup

    startup.begin(reads=("train",))
    from .train_step import run

    run()


def sweep() -> None:
    """The lenet-sweep command, started as python -m lenet.sweep is."""
    from . import plot, startup

    startup.begin(then=plot.start_early)
    from .sweep import run

    run()


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        _list(sys.stdout)
        return 0
    if args[0] == "--version":
        print(f"lenet (lenet-cudnn {__version__})")
        return 0
    module = args[0].replace("-", "_")
    if module not in {m for m, _, _ in PROGRAMS}:   # one line, as every other error (the list: lenet --help)
        from .files import show

        names = ", ".join(m.replace("_", "-") for m, _, _ in PROGRAMS)
        given = f"unknown program '{show(args[0])}'" if args[0] else "the program's name is empty"
        print(f"lenet: error: {given}; run one of: {names} (lenet --help lists them)", file=sys.stderr)
        return 2
    from . import cli

    name = f"lenet {args[0]}"
    cli.invoked_as(name)
    sys.argv = [name, *args[1:]]
    if module == "train":       # these two start their GPU threads before their imports, as python -m does
        train()
    elif module == "train_step":
        train_step()
    elif module == "sweep":
        sweep()
    else:
        __import__(f"lenet.{module}", fromlist=["run"]).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
