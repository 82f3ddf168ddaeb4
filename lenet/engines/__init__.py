"""The engines: every way this package runs an operation of the network, behind one protocol
(base.py), listed in one registry (registry.py), one file each; the policy (policy.py) says which
compete. The planner (lenet/plan.py) chooses among them; lenet/model.py never names one.

    base.py       the protocol: Engine, PlannedOp, Check
    registry.py   ENGINES, the --engine flags, who owns a candidate name, start-up's warm-up
    policy.py     Policy: --engine, --algo, the filters, chunks and fusion as one value
    ours.py       our kernels (lenet/kernels/): the stages fused, the head, the loss, the update
    cudnn.py      a stage by parts on cuDNN: convolutions (legacy, graph) in chunks, then max pooling
    legacy.py     cuDNN's descriptor API: convolution algorithms
    graph.py      cuDNN's graph API: convolution execution plans
    cublaslt.py   the head on cuBLASLt's epilogues, or cuBLAS with cuDNN's bias and ReLU
    fc.py         the head's cuBLASLt matmuls, which cublaslt.py and ours.py's tail form build from
    reference.py  the exact answer of a stage that our kernels are checked against
"""

from .policy import Policy
from .registry import (BY_NAME, ENGINES, FLAGS, cudnn_stages, flag_errors, offering, owner, pins, serving,
                       uses_frontend, warm)

__all__ = ["Policy", "ENGINES", "BY_NAME", "FLAGS", "flag_errors", "offering", "owner", "pins", "serving",
           "uses_frontend", "warm", "cudnn_stages"]
