"""Python objects that own cuDNN's descriptors, over ctypes. Nothing here knows LeNet.

    from descriptors import Handle, TensorDescriptor, FilterDescriptor, ConvolutionDescriptor
"""

from ._base import live_objects
from ._lib import library_path, version, version_string
from .activation import ActivationDescriptor
from .algorithms import (ALGORITHM_NAMES, AlgoPolicy, AlgoResult, AlgorithmNotSupportedError, Direction,
                         UnknownAlgorithmError, Workspace, search, supported_algorithms)
from .convolution import ConvolutionDescriptor, backward_bias
from .errors import CudnnError, CudnnLoadError, NoGpuError
from .handle import Handle, gpu_status, require_gpu
from .pooling import PoolingDescriptor
from .tensor import FilterDescriptor, TensorDescriptor, add_tensor

__all__ = [
    "ActivationDescriptor", "AlgoPolicy", "AlgoResult", "AlgorithmNotSupportedError", "ALGORITHM_NAMES",
    "ConvolutionDescriptor", "CudnnError", "CudnnLoadError", "Direction", "FilterDescriptor", "Handle",
    "NoGpuError", "PoolingDescriptor", "TensorDescriptor", "UnknownAlgorithmError", "Workspace",
    "add_tensor", "backward_bias", "gpu_status", "library_path", "live_objects", "require_gpu", "search",
    "supported_algorithms", "version", "version_string",
]
