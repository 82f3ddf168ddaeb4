"""What a program of ours does on its first line, before any other module of ours is compiled:
lenet/__init__.py imports this, and this imports nothing of ours. Kept small: it is compiled from
source in every run where Python writes no bytecode.

Note [bytecode from the first line]: where Python writes no bytecode (PYTHONDONTWRITEBYTECODE, the H100
machine's setting), keep_bytecode (lenet/startup.py) sends the compiled modules to a cache folder of
ours; it ran in lenet.startup.begin, after python -m lenet.train had compiled lenet/train.py (runpy
compiles the module it runs) and lenet/__init__, interrupt, files, plot and startup from source: 30
ms of every run here (13 of them train.py), before the start-up threads began. So the package's
__init__ points Python at that folder at once (``keep_bytecode_early``) when the process is one of our
programs and the folder exists: runpy finds lenet/train.py's bytecode there. A first run, whose
folder does not exist yet, makes it in keep_bytecode as before (with the checks of Note [cache
folders] in lenet/files.py, which this does not repeat: it only uses a writable folder that is there).
"""

import os
import sys

KEPT: list = []   # the folder keep_bytecode_early gave Python, if it gave one


def is_program_start() -> bool:
    """Whether this process was started as one of our programs (python -m lenet..., or a lenet command):
    what lenet/__init__.py asks before guarding a process from its first line."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 == "-m":   # python -m lenet.PROGRAM, while its module is being found
        return True
    return os.path.basename(argv0).split(".")[0] in ("lenet", "lenet-train", "lenet-train-step", "lenet-export",
                                                     "lenet-predict", "lenet-sweep")


def cache_base() -> str | None:
    """The folder our cache root lives in (Note [cache folders] in lenet/files.py): $XDG_CACHE_HOME when it
    is an absolute path, else $HOME/.cache when HOME is a folder that exists; None: neither."""
    xdg = os.environ.get("XDG_CACHE_HOME") or ""
    home = os.environ.get("HOME") or ""
    if os.path.isabs(xdg):
        return xdg
    if os.path.isabs(home) and os.path.isdir(home):
        return os.path.join(home, ".cache")
    return None


def bytecode_setting() -> tuple[bool, str | None]:
    """(whether to keep bytecode at all, $LENET_BYTECODE_CACHE when it names a folder)."""
    where = os.environ.get("LENET_BYTECODE_CACHE")
    if where is not None and where.strip().lower() in ("", "0", "off", "no", "false"):
        return False, None
    return True, where or None


def keep_bytecode_early() -> None:
    """Note [bytecode from the first line]."""
    if not sys.dont_write_bytecode or sys.pycache_prefix is not None or not is_program_start():
        return
    keep, folder = bytecode_setting()
    if keep and folder is None:
        base = cache_base()
        folder = None if base is None else os.path.join(base, "lenet", "bytecode")
    if keep and folder and os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK):
        sys.pycache_prefix, sys.dont_write_bytecode = folder, False
        KEPT.append(folder)
