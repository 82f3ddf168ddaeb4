"""Checkpoints: one .npz holding the flat parameters, the momentum buffer and a JSON record
(epoch, iteration, config, normalization, metrics so far). Written atomically."""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from . import params as P

FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit."""


def save_npz_atomic(path, arrays: dict) -> None:
    """Write an .npz through a temporary file in the same folder and a rename: an
    interrupted write leaves the previous file as it was, never a broken one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save(path, params_flat: np.ndarray, velocity_flat: np.ndarray, meta: dict) -> None:
    save_npz_atomic(path, {"params": params_flat.astype(np.float32), "velocity": velocity_flat.astype(np.float32),
                           "meta": np.array(json.dumps({"format": FORMAT, **meta}))})


def load(path) -> tuple[np.ndarray, np.ndarray, dict]:
    """(params flat, velocity flat, meta); CheckpointError for anything that is not ours."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            params, velocity, meta = z["params"], z["velocity"], json.loads(str(z["meta"]))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable LeNet checkpoint ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, this version reads {FORMAT}")
    if params.shape != (P.TOTAL,) or velocity.shape != (P.TOTAL,):
        raise CheckpointError(f"{path}: parameter buffer of {params.shape}, LeNet's is ({P.TOTAL},)")
    if not np.all(np.isfinite(params)):
        raise CheckpointError(f"{path}: parameters hold non-finite values")
    return params, velocity, meta


def state_dict(path) -> dict[str, np.ndarray]:
    return P.unpack(load(path)[0])
