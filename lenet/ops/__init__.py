"""LeNet's operations, each planned once per batch size into an object that holds its buffers,
descriptors or graphs, choices and chunks, and then runs with no arguments (so a step can be
captured in a CUDA graph):

    conv.py    conv + bias + ReLU: each direction chosen over every engine (descriptors.search)
    pool.py    2x2 max pooling, chunked
    fc.py      the fully connected layers (cuBLASLt epilogues, or cuBLAS)
    loss.py    softmax cross-entropy (our kernel)
    sgd.py     the SGD update (our kernel)

A planned layer has ``forward()``, ``backward()``, ``workspace_bytes`` and ``describe()``.
"""

from .conv import ConvLayer
from .fc import FullyConnected
from .loss import SoftmaxCrossEntropy
from .pool import MaxPool
from .sgd import SGD

__all__ = ["ConvLayer", "MaxPool", "FullyConnected", "SoftmaxCrossEntropy", "SGD"]
