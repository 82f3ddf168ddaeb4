"""Stage 1's backward, version 1 (conv1_backward_v1.cu: a warp an output channel, each pooled gradient routed
through its argmax), checked against cuDNN's exact result and timed beside version 2, the dense one that
ships (lenet/kernels/stage1_backward_dense.cu). Why version 2 ships: docs/kernels.md, "Stage 1's backward".

    python dev/conv1_backward_v1.py [--batch 64 1024 8192 65536] [--check-only]
"""

import sys

from common import main

if __name__ == "__main__":
    sys.exit(main("conv1_backward_v1.cu", "conv1", __doc__))
