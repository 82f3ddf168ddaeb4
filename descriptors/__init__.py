"""Python objects that own cuDNN's descriptors and graphs, over ctypes and cuDNN's graph-API
frontend; cuDNN's two APIs as sources of convolution candidates, and the exact reference they are
checked against. Nothing here knows LeNet, and nothing here chooses: the caller does.

    from descriptors import Handle, TensorDescriptor, FilterDescriptor, ConvolutionDescriptor
    from descriptors import ConvSpec, AlgoPolicy, LegacyConvs, GraphConvs   # a convolution's candidates
"""

from ._base import live_objects
from ._lib import library_path, version, version_string
from .activation import ActivationDescriptor
from .algorithms import (ALGORITHM_NAMES, AlgoPolicy, AlgoResult, AlgorithmNotSupportedError, Direction,
                         UnknownAlgorithmError, Workspace, supported_algorithms)
from .candidates import Candidate, ConvSpec, GraphConvs, LegacyConvs
from .convolution import ConvolutionDescriptor
from .errors import CudnnError, CudnnLoadError, NoGpuError
from .graph import ConvGraph, GraphUnavailable
from .handle import Handle, gpu_status, require_gpu
from .pooling import PoolingDescriptor
from .tensor import FilterDescriptor, TensorDescriptor, add_tensor

__all__ = [
    "ActivationDescriptor", "AlgoPolicy", "AlgoResult", "AlgorithmNotSupportedError", "ALGORITHM_NAMES",
    "Candidate", "ConvGraph", "ConvSpec", "ConvolutionDescriptor", "CudnnError", "CudnnLoadError",
    "Direction", "FilterDescriptor", "GraphConvs", "GraphUnavailable", "Handle", "LegacyConvs", "NoGpuError",
    "PoolingDescriptor", "TensorDescriptor", "UnknownAlgorithmError", "Workspace", "add_tensor", "gpu_status",
    "library_path", "live_objects", "require_gpu", "supported_algorithms", "version", "version_string",
]
