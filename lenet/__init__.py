"""LeNet-5 trained on cuDNN + cuBLAS from Python: the network and its programs."""

__version__ = "0.1.0"

from . import _early

_early.keep_bytecode_early()   # before any other module of ours is compiled (Note [bytecode from the first line])

from . import interrupt as _interrupt  # noqa: E402

if _early.is_program_start():   # one of our programs: signals handled from here on (lenet/interrupt.py)
    _interrupt.guard()
