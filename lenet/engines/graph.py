"""cuDNN's graph API as an engine (nvidia-cudnn-frontend 1.28): the execution plans of one graph per
convolution direction (6 to 9 exact plans for LeNet's shapes), the epilogue in the graph (fused) or
after it, as candidates for a convolution direction (a part of a stage on cuDNN: lenet/engines/cudnn.py).
``--engine graph`` runs it alone beside cuDNN's pooling and a cuBLAS head; without the frontend,
``--engine graph`` is a one-line error naming the package, and ``auto`` leaves this engine out and
says so once. Its graphs are the model's (descriptors.GraphConvs in ``planner.state``).
"""

from __future__ import annotations

import warnings

from descriptors.algorithms import POLICIES, is_graph_plan_name
from descriptors.candidates import GraphConvs
from descriptors.graph import available, frontend_version

from .base import ConvEngine


class Graph(ConvEngine):
    name = "graph"
    flag = "graph"
    runs = "cuDNN only, its graph API"
    Source = GraphConvs
    frontend = True   # may load nvidia-cudnn-frontend (lenet/startup.py imports it early where so)

    def refuses(self, op, policy) -> str | None:
        why = self.unavailable()
        if why is not None:   # --engine graph without it is refused with the flags (Policy.checked)
            warnings.warn(f"engine auto uses the descriptor API only: {why}", RuntimeWarning, stacklevel=2)
        return why

    def unavailable(self) -> str | None:
        ok, why = available()
        return None if ok else why

    def refuses_flags(self, policy) -> str | None:
        fixed = [c for c in policy.fixed_choices() if c not in POLICIES and not is_graph_plan_name(c)]
        if fixed:
            return f"offers only graph-API plans, and --algo names the descriptor-API algorithm {fixed[0]}"
        return None

    def version(self) -> str:
        return frontend_version() or "none"

