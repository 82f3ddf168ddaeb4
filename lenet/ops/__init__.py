"""LeNet's operations besides its stages (lenet/stages/), each planned once per batch size into an
object that holds its buffers, descriptors or graphs, choices and chunks, and then runs with no
arguments (so a step can be captured in a CUDA graph):

    context.py  PlanContext: what planning needs besides an operation's tensors; SideStream
    conv.py     a stage's conv + bias + ReLU on cuDNN: each direction chosen over cuDNN's engines
    pool.py     a stage's 2x2 max pooling on cuDNN, chunked
    fc.py       the head: fully connected layers (cuBLASLt epilogues, cuBLAS, or our kernels)
    loss.py     softmax cross-entropy (our kernel)
    sgd.py      the SGD update (our kernel)

A planned operation has ``forward()``, ``backward()``, ``workspace_bytes`` and ``describe()``.
"""

from .fc import FullyConnected, HeadTensors
from .loss import LossTensors, SoftmaxCrossEntropy
from .sgd import SGD

__all__ = ["FullyConnected", "HeadTensors", "LossTensors", "SoftmaxCrossEntropy", "SGD"]
