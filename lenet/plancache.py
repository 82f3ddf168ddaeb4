"""The plan cache: the planner's choices of earlier runs (engines, candidates, launch shapes, chunks), on
disk, so that a second run starts without searching (PyTorch's cudnn.benchmark cache, kept across
processes).

Where: $LENET_PLAN_CACHE (a file), else $XDG_CACHE_HOME/lenet/plans.json, else
~/.cache/lenet/plans.json. ``--no-plan-cache`` neither reads nor writes it.

Each entry's key is the planner's key of the choice (lenet/plan.py: the operation with its batch
size, the policy, the competing engines' versions, the device, capture; see Note [stored choices]
there) together with what the choice depends on outside it: the GPU's name, the driver's CUDA
version, cuDNN's version and nvidia-cudnn-frontend's. Any of these changing gives other keys, so
an old entry is never used; the file keeps at most MAX_ENTRIES, the newest. A file of another
format (an older version of this package's) is set aside without a word and replaced at the next
write; one that cannot be read or parsed gets a one-line warning and is treated as empty (then
replaced). Writes are atomic (lenet/files.py), once per planned batch size (``flush``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from .files import cache_path

FORMAT = 2
MAX_ENTRIES = 5000


def default_path() -> Path | None:
    """$LENET_PLAN_CACHE, else plans.json in our cache folder; None where there is none."""
    if os.environ.get("LENET_PLAN_CACHE"):
        return Path(os.environ["LENET_PLAN_CACHE"])
    return cache_path("plans.json")


_READ: dict = {}   # (path, size, mtime) -> the parsed file: the one read ``_document`` keeps


def _document(path: Path):
    """The plan cache file at ``path``, parsed; read once while it is unchanged (its size and modification
    time): the start-up thread's look at it (``stored_engines``) serves the model's own read (PlanCache).
    Raises OSError (FileNotFoundError where there is none) and ValueError (not JSON, not UTF-8)."""
    from .files import read_input, what_is

    if what_is(path)[0] == "missing":
        raise FileNotFoundError(path)
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    doc = _READ.get(key)
    if doc is None:   # a regular file only: a pipe there is refused (a ValueError), never waited on
        from .files import json_of

        doc = json_of(read_input(path, "plan cache", "plan cache file").decode())
        _READ.clear()
        _READ[key] = doc
    return doc


def stored_engines(path=None) -> set | None:
    """The engines the stored choices of the plan cache file name (each entry's "engine", where it has
    one), read with nothing but this module: None where there is no file, none readable, or no entry.
    lenet/startup.py's preload asks whether any names cuDNN's (Note [a first graph only where one
    runs] there)."""
    path = path or default_path()
    try:
        doc = _document(Path(path))
    except (OSError, ValueError, TypeError):
        return None
    entries = doc.get("entries") if isinstance(doc, dict) and doc.get("format") == FORMAT else None
    if not isinstance(entries, dict) or not entries:
        return None
    return {v.get("engine") for v in entries.values() if isinstance(v, dict)} - {None}


def environment(gpu: str, driver: int, cudnn: str, frontend: str | None) -> dict:
    """What every choice depends on besides its operation."""
    return {"gpu": gpu, "driver": int(driver), "cudnn": cudnn, "frontend": frontend, "format": FORMAT}


def current_environment(handle) -> dict:
    """The environment of ``handle``'s GPU, without importing the frontend (its version comes
    from the installed package's metadata)."""
    from cupy_backends.cuda.api import runtime

    import descriptors
    from descriptors.graph import frontend_version

    return environment(handle.gpu_name, runtime.driverGetVersion(), descriptors.version_string(), frontend_version())


class PlanCache:
    """A JSON file of {key: choice}, read once, written by ``flush`` when something was added."""

    def __init__(self, path, env: dict, warn=None):
        self.path, self.env = Path(path), env
        self._say = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
        self._warned = False
        self._entries: dict[str, dict] | None = None
        self._lock = threading.Lock()
        self.dirty = False
        self.hits = self.misses = self.searched = 0

    def _warn(self, msg: str) -> None:
        if not self._warned:   # one line per run, whatever else goes wrong with the file
            self._warned = True
            self._say(msg)

    def _key(self, op: dict) -> str:
        return json.dumps({"env": self.env, "op": op}, sort_keys=True, separators=(",", ":"))

    def _load(self) -> dict:
        if self._entries is None:
            self._entries = {}
            try:
                doc = _document(self.path)
                if isinstance(doc, dict) and isinstance(doc.get("format"), int) and doc["format"] != FORMAT:
                    return self._entries   # another version's cache: its keys would never match; replaced
                if not (isinstance(doc, dict) and doc.get("format") == FORMAT and isinstance(doc.get("entries"), dict)):
                    raise ValueError("not a plan cache of this version")
                self._entries = {k: v for k, v in doc["entries"].items() if isinstance(v, dict)}
            except FileNotFoundError:
                pass
            except OSError as e:
                self._warn(f"plan cache {self.path} cannot be read ({e.strerror}); searching instead")
            except ValueError as e:
                self._warn(f"plan cache {self.path} is not a readable cache ({str(e).splitlines()[0][:80]}); "
                           f"searching instead, and it will be replaced")
        return self._entries

    def get(self, op: dict) -> dict | None:
        v = self._load().get(self._key(op))
        if v is None:
            self.misses += 1
        else:
            self.hits += 1
        return v

    def put(self, op: dict, value: dict) -> None:
        entries = self._load()
        k = self._key(op)
        with self._lock:
            entries.pop(k, None)
            entries[k] = value   # newest last
            self.searched += 1
            while len(entries) > MAX_ENTRIES:
                entries.pop(next(iter(entries)))
            self.dirty = True

    def flush(self) -> None:
        """Write the file if anything was added; a failure is a warning (the run goes on). In a program
        whose checks have not passed yet, once they have (Note [nothing written before the checks] in
        lenet/files.py: a model planned beside them, Note [the model beside the data] in lenet/train.py)."""
        from . import files

        if not files.writes_allowed():
            files.write_later(self.flush)   # held back until then, and written on a thread
            return
        with self._lock:   # the checks' thread may flush while the planning one puts
            if not self.dirty:
                return
            self.dirty = False
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                files.write_atomic(self.path, json.dumps({"format": FORMAT, "entries": self._entries}).encode())
            except (OSError, files.OutputError) as e:   # write_atomic's one-line error names the path too
                self._warn(f"plan cache {self.path} cannot be written ({getattr(e, 'strerror', None) or e}); the "
                           f"next run searches again")

    def summary(self) -> dict:
        return {"path": str(self.path), "hits": self.hits, "misses": self.misses, "searched": self.searched}


def open_cache(handle, enabled: bool = True, path=None) -> PlanCache | None:
    """The plan cache for the GPU and libraries of ``handle`` (a model's planner keeps it as its store:
    lenet.plan.Planner), or None when disabled."""
    path = path or (default_path() if enabled else None)
    if path is None:
        return None
    return PlanCache(path, current_environment(handle))
