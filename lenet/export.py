"""python -m lenet.export CHECKPOINT --to model.safetensors

Writes the parameters under PyTorch's state_dict names and shapes: a torch.nn LeNet
loads them with load_state_dict. .safetensors (needs the safetensors package) or .npz.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import checkpoint as ckpt
from . import cli


def parser() -> cli.Parser:
    p = cli.Parser(prog="python -m lenet.export", description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("checkpoint", help="a checkpoint.npz written by python -m lenet.train")
    p.add_argument("--to", required=True, metavar="PATH", help="output file: .safetensors or .npz")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    to = Path(args.to)
    if to.suffix not in (".safetensors", ".npz"):
        raise ValueError(f"--to must end in .safetensors or .npz, got {to.name!r}")
    params, _, meta = ckpt.load(args.checkpoint)
    from . import params as P

    state = P.unpack(params)
    info = {"format": "lenet-cudnn", "epoch": str(meta["epoch"]), "mean": repr(meta["config"]["mean"]),
            "std": repr(meta["config"]["std"]), "dataset": meta["config"]["dataset"]}
    tmp = to.with_name(f".{to.name}.tmp")
    try:
        if to.suffix == ".safetensors":
            try:
                from safetensors.numpy import save_file
            except ImportError:
                raise ValueError("writing .safetensors needs the safetensors package "
                                 "(pip install '.[train]'), or export to .npz") from None
            save_file(state, str(tmp), metadata=info)
        else:
            ckpt.save_npz_atomic(tmp.with_suffix(".npz"), {**state, "meta": json.dumps(info)})
            tmp = tmp.with_suffix(".npz")
        os.replace(tmp, to)
    finally:
        if tmp.exists():
            tmp.unlink()
    print(f"wrote {to}: {', '.join(f'{k} {tuple(v.shape)}' for k, v in state.items())}")
    return 0


if __name__ == "__main__":
    cli.run(main)
