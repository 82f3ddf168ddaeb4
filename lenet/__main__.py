"""python -m lenet: the programs of this package, one line each."""

from __future__ import annotations

import sys

PROGRAMS = (
    ("train", "lenet-train", "train LeNet-5 on an IDX dataset (Fashion-MNIST, MNIST, ...) and evaluate every epoch"),
    ("train_step", "lenet-train-step", "one SGD step on one batch: engines, plans, chunks, times, losses"),
    ("export", "lenet-export", "a checkpoint's parameters as .safetensors or .npz, PyTorch's names and shapes"),
    ("predict", "lenet-predict", "classify IDX images or PNG/JPEG pictures with a checkpoint"),
)


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] not in ("-h", "--help"):
        print(f"python -m lenet: unknown argument {args[0]!r}; run one of the programs below", file=sys.stderr)
        code = 2
    else:
        code = 0
    out = sys.stdout if code == 0 else sys.stderr
    print("LeNet-5 on cuDNN + cuBLAS. Programs (each takes --help):", file=out)
    for module, script, what in PROGRAMS:
        print(f"  python -m lenet.{module:<11} (or {script:<16})  {what}", file=out)
    return code


if __name__ == "__main__":
    sys.exit(main())
