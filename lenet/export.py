"""python -m lenet.export CHECKPOINT --to model.safetensors

Writes the parameters under PyTorch's state_dict names and shapes: a torch.nn LeNet
loads them with load_state_dict. .safetensors or .npz. Needs no GPU.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from . import checkpoint as ckpt
from . import cli, files

SUFFIXES = (".safetensors", ".npz")


def save(state: dict, to, info: dict | None = None) -> Path:
    """Write a state dict (PyTorch names and shapes, NumPy arrays) to ``to`` (.safetensors or
    .npz), atomically; ``info`` (strings) goes into the file's metadata."""
    from . import params as P

    to = Path(to)
    if to.suffix not in SUFFIXES:
        raise ValueError(f"an export is a .safetensors or .npz file, got {to.name!r}")
    state = P.unpack(P.pack(state))   # checks names, shapes and values
    info = {k: str(v) for k, v in (info or {}).items()}
    if to.suffix == ".safetensors":
        to_bytes = _safetensors()

        files.write_atomic(to, to_bytes(state, metadata=info))
    else:
        buf = io.BytesIO()
        np.savez(buf, **state, meta=np.array(json.dumps(info)))
        files.write_atomic(to, buf.getvalue())
    return to


def _safetensors():
    """safetensors' writer, or one line saying how to get it (it is no part of the GPU stack)."""
    try:
        from safetensors.numpy import save
    except ImportError:
        raise ValueError("writing .safetensors needs the Python package safetensors (pip install safetensors); "
                         "or export to .npz") from None
    return save


def parser() -> cli.Parser:
    p = cli.Parser(prog=cli.prog("export"), description=" ".join(__doc__.split("\n\n")[1].split()))
    p.add_argument("checkpoint", help="a checkpoint.npz written by python -m lenet.train")
    p.add_argument("--to", required=True, metavar="PATH", help="output file: .safetensors or .npz")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing file at --to (never a run's checkpoint)")
    return p


def check_target(to: Path, checkpoint, overwrite: bool) -> None:
    """--to is a file this program may write: never a run's checkpoint (its own input or another run's),
    and an existing file only with --overwrite. One line otherwise."""
    files.check_output_file(to, "--to", inputs=[checkpoint])
    ckpt.refuse_overwriting(to, "--to")
    files.check_output_file(to, "--to", overwrite=overwrite)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.to == "":
        raise files.OutputError("--to is empty: give a .safetensors or .npz file")
    to = Path(args.to)
    if to.suffix not in SUFFIXES:
        raise ValueError(f"--to must end in .safetensors or .npz, got {files.show(to.name)}")
    if to.suffix == ".safetensors":
        _safetensors()   # before anything is read
    files.check_input_file(args.checkpoint, "", "checkpoint", ckpt.CheckpointError)
    check_target(to, args.checkpoint, args.overwrite)
    params, _, meta = ckpt.load(args.checkpoint)
    ckpt.check_meta(args.checkpoint, meta)
    from . import params as P

    flat, which = ckpt.weights(params, meta)
    state = P.unpack(flat)
    cfg = meta["config"]
    save(state, to, {"format": "lenet-cudnn", "epoch": meta["epoch"], "mean": repr(cfg["mean"]),
                     "std": repr(cfg["std"]), "dataset": str(cfg.get("dataset", "")), "weights": which})
    print(f"wrote {files.show(to)} ({which}): {', '.join(f'{k} {tuple(v.shape)}' for k, v in state.items())}")
    return 0


def run() -> None:
    cli.run(main, cli.prog("export"))


if __name__ == "__main__":
    run()
