"""LeNet-5 trained on cuDNN + cuBLAS from Python: the network and its programs."""

__version__ = "0.1.0"
