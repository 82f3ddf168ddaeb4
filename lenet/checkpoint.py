"""Checkpoints: one .npz holding the flat parameters, the momentum buffer, the weights' moving
average when the run keeps one (``ema``), and a JSON record (epoch, step inside the epoch,
iteration, config, normalization, metrics so far). Written atomically (lenet/files.py).
Evaluation and export use the moving average when it is there (``weights``)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

from . import files
from . import params as P

FORMAT = 1
WHAT = "a LeNet checkpoint is the checkpoint.npz that python -m lenet.train writes (params, velocity, meta)"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit."""


def save(path, params_flat: np.ndarray, velocity_flat: np.ndarray, meta: dict, ema_flat: np.ndarray | None = None
         ) -> None:
    arrays = {"params": params_flat.astype(np.float32), "velocity": velocity_flat.astype(np.float32),
              "meta": np.array(json.dumps({"format": FORMAT, **meta}))}
    if ema_flat is not None:
        arrays["ema"] = ema_flat.astype(np.float32)
    files.save_npz(path, arrays)


def load(path, label: str = "") -> tuple[np.ndarray, np.ndarray, dict]:
    """(params flat, velocity flat, meta); the moving average, when saved, is meta["ema"] (a flat
    array). CheckpointError, one line, for anything that is not ours, the whole file checked before any
    of it is used (``label``: the flag that named it, for the message)."""
    path = Path(path)
    lead = files.show(path) if not label else f"{label} {files.show(path)}"
    try:
        with files.open_input(path, label, "checkpoint", CheckpointError) as f:
            z = np.load(f, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise CheckpointError(f"{lead} is a single NumPy array, not a checkpoint; {WHAT}")
            with z:
                missing = [k for k in ("params", "velocity", "meta") if k not in z.files]
                if missing:
                    raise CheckpointError(f"{lead} is an .npz without {', '.join(missing)}: not a checkpoint (an "
                                          f"export, perhaps); {WHAT}")
                files.check_npz(z, lead, {"params": 8 * P.TOTAL, "velocity": 8 * P.TOTAL, "ema": 8 * P.TOTAL,
                                          "meta": 256 << 20}, CheckpointError)
                params, velocity, meta = z["params"], z["velocity"], files.json_of(str(z["meta"]))
                ema = z["ema"] if "ema" in z.files else None
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, json.JSONDecodeError):
        # NumPy's own message for some of these invites unpickling: never pass it on.
        raise CheckpointError(f"{lead} is not a LeNet checkpoint (not a readable .npz); {WHAT}") from None
    path = lead
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: checkpoint format {got!r}, this version reads {FORMAT}")
    if params.shape != (P.TOTAL,) or velocity.shape != (P.TOTAL,):
        raise CheckpointError(f"{path}: parameter buffer of {params.shape}, LeNet's is ({P.TOTAL},)")
    arrays = {"parameters": params, "momentum buffer": velocity, "moving average": ema}
    for what, a in arrays.items():
        if a is not None and a.dtype.kind != "f":
            raise CheckpointError(f"{path}: the {what} are {a.dtype} values, not floating-point numbers; {WHAT}")
    for what, a in (("parameters", params), ("momentum buffer", velocity)):
        if not np.all(np.isfinite(a)):
            raise CheckpointError(f"{path}: non-finite values (NaN or infinity) in its {what}; {WHAT}")
    if ema is not None:
        if ema.shape != (P.TOTAL,) or not np.all(np.isfinite(ema)):
            raise CheckpointError(f"{path}: the moving average is not {P.TOTAL} finite values")
        meta["ema"] = ema
    return params, velocity, meta


def refuse_overwriting(path, flag: str) -> None:
    """An output (an export, a dump) never replaces a run's checkpoint, --overwrite or not: one line when
    ``path`` holds one (called after files.check_output_file, so ``path`` is a regular file or nothing)."""
    if not Path(path).is_file():
        return
    try:
        load(path)
    except CheckpointError:
        return
    raise files.OutputError(f"{flag} {files.show(path)} is a run's checkpoint: it is never replaced by this "
                            f"program; write to another file")


def check_meta(path, meta: dict, resuming: bool = False) -> dict:
    """``meta`` if it holds what the programs read from it, else a one-line CheckpointError:
    the run's configuration with its pixel normalization (finite mean, std > 0) and its epoch;
    to resume, also the iteration, the history and the position inside the epoch."""
    def bad(what):
        return CheckpointError(f"{files.show(path)}: its record {what}; {WHAT}")
    cfg = meta.get("config")
    if not isinstance(cfg, dict):
        raise bad("holds no run configuration")
    for k in ("mean", "std"):
        v = cfg.get(k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v) or (k == "std" and v <= 0):
            raise bad(f"has no usable pixel {k} ({v!r})")
    needs = ("epoch", "iteration") if resuming else ("epoch",)
    for k in needs + (("step",) if resuming and "step" in meta else ()):
        v = meta.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise bad(f"has no {k} count ({v!r})")
    if resuming and not isinstance(meta.get("history"), list):
        raise bad("has no history of its epochs")
    if resuming and not all(_epoch_record(h) for h in meta["history"]):
        raise bad("has a history whose records are not its epochs' (an epoch number and its losses and accuracy)")
    running = meta.get("running_loss", 0.0)
    if resuming and (isinstance(running, bool) or not isinstance(running, (int, float)) or not np.isfinite(running)):
        raise bad("has a non-finite running loss")
    return meta


def _epoch_record(h) -> bool:
    """Whether ``h`` is an epoch's record as lenet.train writes it (what its plot and report read)."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return isinstance(h, dict) and isinstance(h.get("epoch"), int) and not isinstance(h.get("epoch"), bool) and all(
        number(h[k]) for k in ("train_loss", "test_loss", "test_accuracy", "seconds", "wall_s") if k in h)


def weights(params_flat: np.ndarray, meta: dict) -> tuple[np.ndarray, str]:
    """(the flat weights to evaluate and export, which): the moving average when the checkpoint
    holds one, else the parameters."""
    ema = meta.get("ema")
    return (ema, "moving average") if ema is not None else (params_flat, "parameters")


def state_dict(path) -> dict[str, np.ndarray]:
    params, _, meta = load(path)
    return P.unpack(weights(params, meta)[0])
