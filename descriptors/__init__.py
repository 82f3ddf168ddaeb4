"""Python objects that own cuDNN's descriptors and graphs, over ctypes and cuDNN's graph-API
frontend, and the one search that chooses between them. Nothing here knows LeNet.

    from descriptors import Handle, TensorDescriptor, FilterDescriptor, ConvolutionDescriptor
    from descriptors import ConvSpec, AlgoPolicy, choose      # a convolution, chosen over both engines
"""

from ._base import live_objects
from ._lib import library_path, version, version_string
from .activation import ActivationDescriptor
from .algorithms import (ALGORITHM_NAMES, AlgoPolicy, AlgoResult, AlgorithmNotSupportedError, Direction,
                         UnknownAlgorithmError, Workspace, supported_algorithms)
from .convolution import ConvolutionDescriptor, backward_bias
from . import engines as _engines
from . import search as _search
from .engines import Candidate, ConvSpec, engines_for
from .errors import CudnnError, CudnnLoadError, NoGpuError
from .graph import ConvGraph, GraphUnavailable
from .handle import Handle, gpu_status, require_gpu
from .pooling import PoolingDescriptor
from .search import ConvChoice, Timed, choose, table
from .tensor import FilterDescriptor, TensorDescriptor, add_tensor



def clear_caches() -> None:
    """Forget every search result and close every descriptor and graph the engines cache."""
    _search.clear_cache()
    _engines.clear_caches()


__all__ = [
    "ActivationDescriptor", "AlgoPolicy", "AlgoResult", "AlgorithmNotSupportedError", "ALGORITHM_NAMES",
    "Candidate", "ConvChoice", "ConvGraph", "ConvSpec", "ConvolutionDescriptor", "CudnnError", "CudnnLoadError",
    "Direction", "FilterDescriptor", "GraphUnavailable", "Handle", "NoGpuError", "PoolingDescriptor",
    "TensorDescriptor", "Timed", "UnknownAlgorithmError", "Workspace", "add_tensor", "backward_bias", "choose",
    "clear_caches", "engines_for", "gpu_status", "library_path", "live_objects", "require_gpu",
    "supported_algorithms", "table", "version", "version_string",
]
