"""Python objects that own cuDNN's descriptors and graphs, over ctypes and cuDNN's graph-API
frontend, and the one search that chooses between them. Nothing here knows LeNet.

    from descriptors import Handle, TensorDescriptor, FilterDescriptor, ConvolutionDescriptor
    from descriptors import ConvSpec, AlgoPolicy, Search      # a convolution, chosen over both engines
"""

from ._base import live_objects
from ._lib import library_path, version, version_string
from .activation import ActivationDescriptor
from .algorithms import (ALGORITHM_NAMES, AlgoPolicy, AlgoResult, AlgorithmNotSupportedError, Direction,
                         UnknownAlgorithmError, Workspace, supported_algorithms)
from .convolution import ConvolutionDescriptor
from . import engines as _engines
from .engines import Candidate, ConvSpec, engines_for
from .errors import CudnnError, CudnnLoadError, NoGpuError
from .graph import ConvGraph, GraphUnavailable
from .handle import Handle, gpu_status, require_gpu
from .pooling import PoolingDescriptor
from .search import ConvChoice, Search, Timed
from .tensor import FilterDescriptor, TensorDescriptor, add_tensor



def clear_caches() -> None:
    """Close every descriptor and graph the engines cache (a search's own state is its Search object's)."""
    _engines.clear_caches()


__all__ = [
    "ActivationDescriptor", "AlgoPolicy", "AlgoResult", "AlgorithmNotSupportedError", "ALGORITHM_NAMES",
    "Candidate", "ConvChoice", "ConvGraph", "ConvSpec", "ConvolutionDescriptor", "CudnnError", "CudnnLoadError",
    "Direction", "FilterDescriptor", "GraphUnavailable", "Handle", "NoGpuError", "PoolingDescriptor",
    "Search", "TensorDescriptor", "Timed", "UnknownAlgorithmError", "Workspace", "add_tensor",
    "clear_caches", "engines_for", "gpu_status", "library_path", "live_objects", "require_gpu",
    "supported_algorithms", "version", "version_string",
]
