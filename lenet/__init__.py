"""LeNet-5 trained on cuDNN + cuBLAS from Python: the network and its programs."""

__version__ = "0.1.0"

from . import interrupt as _interrupt

if _interrupt.is_program_start():   # one of our programs: signals handled from here on (lenet/interrupt.py)
    _interrupt.guard()
