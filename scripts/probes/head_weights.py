"""Probe (GPU): the head's weight gradients (head_weights.cu) on whole steps. Each variant, KERNEL/PLACE,
rebuilds our kernels with that kernel and times the captured step of a LeNet of ``--engine ours`` under the
heuristic, back to back as training runs (heuristic_rows.time_steps), in a process of its own:

    KERNEL  tree        head_weights.cu as it is
            aN          the same with N images' loads in flight a chunk (head_weight_sums<N, ...>), e.g. a16
            PATH        another source of the whole file (e.g. `git show REV:lenet/kernels/head_weights.cu`)
    PLACE   side        where the model puts it (the side stream where its grid fits: Note [side stream])
            main        on the main stream, between the head's data gradients and the stages' backwards
            rN          ranges of N images (several partial rows, then stage_reduce; on the main stream
                        where the grid does not fit beside)

    python3 scripts/probes/head_weights.py --batch 128 150 256 --variants tree/side a16/side tree/main

Note [the weights' loads in flight] in head_weights.cu has what it measured; docs/kernels.md, "head_weights.cu".
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def kernel_text(kernel: str, tree: str) -> str:
    """head_weights.cu's text under KERNEL (see the docstring)."""
    if kernel == "tree":
        return tree
    if kernel[:1] == "a" and kernel[1:].isdigit() and int(kernel[1:]) >= 1:
        return tree.replace("head_weight_sums<8,", f"head_weight_sums<{int(kernel[1:])},")
    if not Path(kernel).is_file():
        raise SystemExit(f"kernel {kernel!r}: tree, aN (N >= 1) or a file's path")
    return Path(kernel).read_text()


def child(variant: str, batches: list[int], steps: int) -> None:
    import lenet.kernels as K
    from chain import print_steps
    from lenet.kernels import head as H

    kernel, _, place = variant.rpartition("/")
    tree = (K.FOLDER / "head_weights.cu").read_text()
    text, source = kernel_text(kernel, tree), K.source
    K.source = lambda name: source(name).replace(tree, text) if name.removesuffix("__pack") == "head_weights" \
        else source(name)
    if place == "main":   # only the head's weight gradients: handed a side stream that never fits
        weights = H.HeadLaunches._weight_gradients

        class Main:
            fits = staticmethod(lambda blocks: False)

        H.HeadLaunches._weight_gradients = staticmethod(
            lambda t, n, per, ranges, part, stream, side, *rest: weights(t, n, per, ranges, part, stream, Main, *rest))
    elif place[:1] == "r" and place[1:].isdigit() and int(place[1:]) >= 1:
        H.HEAD_PER = (int(place[1:]),) + H.HEAD_PER
    elif place != "side":
        raise SystemExit(f"variant {variant!r}: KERNEL/PLACE, PLACE side, main or rN (N >= 1)")
    print_steps(variant, batches, steps)


def main() -> int:
    from chain import probe_main

    return probe_main(__file__, __doc__, child, [128, 150, 256],
                      ["tree/side", "a16/side", "a4/side", "tree/main", "tree/r32"], 2)


if __name__ == "__main__":
    sys.exit(main())
