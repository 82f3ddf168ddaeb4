"""python -m lenet.predict --checkpoint CKPT INPUT...

Classifies images with a trained checkpoint. An INPUT is an IDX image file (all its
images) or a PNG/JPEG picture (converted to 8-bit gray and resized to 28x28). Pass
--labels with an IDX label file to get the accuracy as well. Runs on the GPU (our engines) where
one is usable, else on the CPU (NumPy: the same network, the same predictions), and says which in its
first line; --device picks.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import numpy as np

from . import checkpoint as ckpt
from . import cli, data, files

FASHION = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
           "Ankle boot")


def parser() -> cli.Parser:
    p = cli.Parser(prog=cli.prog("predict"), description=" ".join(__doc__.split("\n\n")[1].split()))
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="IDX image files or PNG/JPEG pictures")
    p.add_argument("--checkpoint", required=True, help="checkpoint.npz from python -m lenet.train")
    p.add_argument("--labels", metavar="IDX", help="IDX labels for a single IDX input: also print the accuracy")
    p.add_argument("--invert", action="store_true", help="invert pictures (dark drawing on a light background)")
    p.add_argument("--show", type=cli.nonneg_int, default=20, metavar="K",
                   help="print the first K predictions, 0 for none (default: 20)")
    p.add_argument("--batch-size", type=cli.batch_size, default=1000, metavar="N", help="(default: 1000)")
    p.add_argument("--tta", action=argparse.BooleanOptionalAction, default=None,
                   help="score each image on the mean of its logits and its left-right mirror's (default: as "
                        "the checkpoint's run was evaluated, its --tta)")
    p.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                   help="gpu: our engines on an NVIDIA GPU; cpu: NumPy, no GPU needed; auto: the GPU where one is "
                        "usable, else the CPU (default: auto)")
    cli.add_plan_cache_flag(p)
    return p


def conv_valid(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """conv2d, stride 1, no padding: x (N, C, H, W), w (K, C, R, S), b (K,) -> (N, K, H-R+1, W-S+1)."""
    win = np.lib.stride_tricks.sliding_window_view(x, w.shape[2:], axis=(2, 3))   # (N, C, H', W', R, S)
    return np.einsum("nchwrs,kcrs->nkhw", win, w, optimize=True) + b[None, :, None, None]


def maxpool2(x: np.ndarray) -> np.ndarray:
    n, c, h, w = x.shape
    return x.reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


def cpu_logits(state: dict, x: np.ndarray) -> np.ndarray:
    """LeNet's forward on the CPU in float32 (NumPy): x (N, 1, 28, 28) normalized -> logits (N, 10)."""
    f = {k: np.asarray(v, np.float32) for k, v in state.items()}
    p1 = maxpool2(np.maximum(conv_valid(x, f["conv1.weight"], f["conv1.bias"]), 0))
    p2 = maxpool2(np.maximum(conv_valid(p1, f["conv2.weight"], f["conv2.bias"]), 0))
    h1 = np.maximum(p2.reshape(len(x), -1) @ f["fc1.weight"].T + f["fc1.bias"], 0)
    return h1 @ f["fc2.weight"].T + f["fc2.bias"]


class CpuModel:
    """The checkpoint's weights scored on the CPU, batch by batch (``logits``)."""

    def __init__(self, weights: np.ndarray):
        from . import params as P

        self.state = P.unpack(weights)

    def logits(self, x: np.ndarray) -> np.ndarray:
        return cpu_logits(self.state, x)


class GpuModel:
    """The checkpoint's weights scored by our engines (lenet.model.LeNet), batch by batch (``logits``)."""

    def __init__(self, weights: np.ndarray, max_batch: int, plan_cache):
        from .model import LeNet

        self.model = LeNet(max_batch=max_batch, plan_cache=plan_cache)
        self.model.load_flat(weights, np.zeros_like(weights))

    def logits(self, x: np.ndarray) -> np.ndarray:
        m = self.model
        m.load_batch(x, np.zeros(len(x), np.int32))
        m.evaluate_begin()
        m.evaluate_batch(len(x))
        return m.logits()


def device(choice: str) -> tuple[str, str]:
    """("gpu" or "cpu", the first line saying which and why)."""
    try:
        from descriptors import gpu_status

        ok, why = gpu_status()
    except Exception as e:   # noqa: BLE001 - no GPU stack here (ImportError), or no cuDNN to load
        ok, why = False, f"the GPU stack is not usable here ({type(e).__name__}: {e})"
    if choice == "gpu" or (choice == "auto" and ok):
        if not ok:
            from descriptors.errors import NoGpuError

            raise NoGpuError(f"no usable NVIDIA GPU: {why} (--device cpu runs on the CPU)")
        return "gpu", f"device: GPU {why} (our engines)"
    reason = "--device cpu" if choice == "cpu" else f"no usable NVIDIA GPU: {why}"
    return "cpu", f"device: CPU (NumPy; {reason})"


MAX_PICTURE_PIXELS = 50_000_000   # a picture larger than this is refused before it is decoded


def read_picture(path: Path, invert: bool) -> np.ndarray:
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ValueError("reading pictures needs Pillow (pip install Pillow)") from None
    too_big = f"pictures of at most {MAX_PICTURE_PIXELS:,} pixels are read (they are shrunk to 28x28)"
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)   # Pillow's size warning: refused, once
        try:
            with Image.open(path) as im:   # reads the header only: the size is known before decoding
                w, h = im.size
                if w * h > MAX_PICTURE_PIXELS:
                    raise data.DataError(f"{files.show(path)}: a {w}x{h} picture ({w * h:,} pixels); {too_big}")
                g = im.convert("L").resize((28, 28), Image.BILINEAR)
        except (Image.DecompressionBombWarning, Image.DecompressionBombError):
            raise data.DataError(f"{files.show(path)}: a picture larger than Pillow reads safely; {too_big}") from None
        except (UnidentifiedImageError, OSError) as e:
            why = "not a picture Pillow knows" if isinstance(e, UnidentifiedImageError) else files.escaped(str(e))
            raise data.DataError(f"{files.show(path)}: not a readable picture ({why})") from None
    a = np.asarray(g, dtype=np.uint8)
    return 255 - a if invert else a


PICTURES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def load_inputs(paths: list[str], invert: bool) -> tuple[np.ndarray, list[str]]:
    """Every input read and checked: a regular file each (files.check_input_file), a picture by its name's
    suffix (PICTURES), else an IDX image file by its content."""
    images, names = [], []
    for s in paths:
        p = files.check_input_file(s, "", "IDX image file or PNG/JPEG picture", data.DataError)
        if p.suffix.lower() in PICTURES:
            images.append(read_picture(p, invert)[None])
            names.append(files.show(p.name))
            continue
        with files.open_input(p, "", "IDX image file or PNG/JPEG picture", data.DataError) as f:
            head = f.read(4)
        if head[:2] == b"\x1f\x8b" or head[:2] == b"\x00\x00":
            a = data.read_idx(p, ndim=3)
            if a.dtype != np.uint8 or a.shape[1:] != (28, 28):
                raise data.DataError(f"{files.show(p)}: IDX images must be uint8 28x28, got {a.dtype} {a.shape[1:]}")
            images.append(a)
            names.append((files.show(p.name), len(a)))   # listed as name[i] only where shown (main)
        else:
            images.append(read_picture(p, invert)[None])
            names.append(files.show(p.name))
    return np.concatenate(images), names


def shown_names(names: list, k: int) -> list[str]:
    """The first ``k`` images' names: a picture's name, an IDX file's images as name[i]; never more built than
    shown (an IDX file may hold millions)."""
    out = []
    for n in names:
        if len(out) >= k:
            break
        if isinstance(n, tuple):
            out += [f"{n[0]}[{i}]" for i in range(min(n[1], k - len(out)))]
        else:
            out.append(n)
    return out


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    params, _, meta = ckpt.load(args.checkpoint, "--checkpoint")
    ckpt.check_meta(args.checkpoint, meta)
    images, names = load_inputs(args.inputs, args.invert)
    labels = None
    if args.labels is not None:
        labels = data.read_idx(args.labels, ndim=1, label="--labels")
        shown = f"--labels {files.show(args.labels)}"
        if len(args.inputs) != 1 or len(labels) != len(images):
            raise data.DataError(f"{shown}: {len(labels)} labels for {len(images)} images "
                                 "(--labels goes with a single IDX input of the same count)")
        if len(labels) and int(labels.max()) >= 10:
            raise data.DataError(f"{shown}: labels from {int(labels.min())} to {int(labels.max())}; LeNet's "
                                 f"are 0 to 9")
    files.checks_passed()   # Note [nothing written before the checks] in lenet/files.py
    where, line = device(args.device)   # every check above needs no GPU
    print(line)
    cfg = meta["config"]
    classes = FASHION if "fashion" in str(cfg.get("dataset", "")) else tuple(str(i) for i in range(10))
    batch = min(args.batch_size, len(images))
    weights, _ = ckpt.weights(params, meta)   # the moving average when the run kept one
    model = GpuModel(weights, batch, args.plan_cache) if where == "gpu" else CpuModel(weights)
    x = ((images.astype(np.float32) / 255.0 - np.float32(cfg["mean"])) / np.float32(cfg["std"]))[:, None]
    tta = cfg.get("tta", False) if args.tta is None else args.tta
    preds = []
    for s in range(0, len(images), batch):
        xb = x[s: s + batch]
        lg = 0
        for view in ((xb, np.ascontiguousarray(xb[..., ::-1])) if tta else (xb,)):   # as training scored
            lg = lg + model.logits(view)
        lg = lg / 2 if tta else lg
        p = np.exp(lg - lg.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        preds.append(np.stack([p.argmax(1), p.max(1)], 1))
    pr = np.concatenate(preds)
    for name, (c, conf) in zip(shown_names(names, args.show), pr):
        print(f"{name}: {int(c)} {classes[int(c)]} (p={conf:.3f})")
    if len(images) > args.show:
        print(f"... {len(images) - args.show} more")
    if labels is not None:
        acc = float((pr[:, 0].astype(int) == labels).mean())
        print(f"accuracy {100 * acc:.2f}% on {len(labels)} images")
    return 0


def run() -> None:
    cli.run(main, cli.prog("predict"))


if __name__ == "__main__":
    run()
