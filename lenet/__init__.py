"""LeNet-5 trained on cuDNN + cuBLAS from Python: the network and its programs."""

# Note [a signal before the handlers]: SIGINT and SIGTERM are held back (blocked) on the first line of a
# program of ours, before any import, even of the signal module (whose import of enum took long enough on
# a slow 2-CPU machine for a Ctrl-C to meet it: a KeyboardInterrupt traceback from inside lenet/interrupt.py's
# own `import signal`), with the builtin _signal alone: one system call. interrupt.guard() lets them through
# once its pipe, handlers and thread are in place, so a signal that came meanwhile is handled as any later
# one (Note [signals from the first line] in lenet/interrupt.py). Before this line only the interpreter's own
# start runs (site, its .pth files, runpy finding the module), which answers a signal as Python does.
import sys as _sys

_held_mask = None
if _sys.argv and (_sys.argv[0] == "-m" or _sys.argv[0].rsplit("/", 1)[-1].split(".")[0] in (
        "lenet", "lenet-train", "lenet-train-step", "lenet-export", "lenet-predict", "lenet-sweep")):
    try:
        import _signal

        _held_mask = _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT, _signal.SIGTERM})
    except (ImportError, AttributeError, OSError, ValueError):   # no such call here: Python's handling stays
        _held_mask = None

__version__ = "0.1.0"

from . import _early  # noqa: E402

_early.keep_bytecode_early()   # before any other module of ours is compiled (Note [bytecode from the first line])

from . import interrupt as _interrupt  # noqa: E402

if _early.is_program_start():   # one of our programs: signals handled from here on (lenet/interrupt.py)
    _interrupt.guard(restore=_held_mask)
elif _held_mask is not None:
    _signal.pthread_sigmask(_signal.SIG_SETMASK, _held_mask)
