"""cuDNN's descriptor API as an engine: its convolution algorithms (5 to 8 per direction for LeNet's
shapes), each with its epilogue fused (cudnnConvolutionBiasActivationForward, forward only) or run
after it, as candidates for a convolution direction (a part of a stage on cuDNN: lenet/engines/cudnn.py).
``--engine legacy`` runs it alone beside cuDNN's pooling and a cuBLAS head. Its cuDNN objects are the
model's (descriptors.LegacyConvs in ``planner.state``).
"""

from __future__ import annotations

from descriptors.algorithms import is_graph_plan_name
from descriptors.candidates import LegacyConvs

from .base import ConvEngine


class Legacy(ConvEngine):
    name = "legacy"
    flag = "legacy"
    runs = "cuDNN only, its descriptor API"
    Source = LegacyConvs
    names_winograd = True

    def refuses_flags(self, policy) -> str | None:
        fixed = [c for c in policy.fixed_choices() if is_graph_plan_name(c)]
        if fixed:
            return f"offers only the descriptor API's algorithms, and --algo names the graph-API plan {fixed[0]}"
        return None

    def version(self) -> str:
        import descriptors

        return descriptors.version_string()
