"""Stage 2's forward, version 3 (conv2_forward_v3.cu: lenet/kernels/stage2_forward_mma.cu's implicit GEMM on the
tensor cores with the image kept as (big, small) pairs; compute capability 8.0 and newer), checked against
cuDNN's exact result as the planner checks a forward candidate and timed beside the versions that ship (1
and 2, float32 multiply-adds; 4, the same GEMM with each value split where it is loaded, which beat it).

    python dev/conv2_forward_v3.py [--batch 64 1024 8192 65536] [--check-only]
"""

import sys

from common import main

if __name__ == "__main__":
    sys.exit(main("conv2_forward_v3.cu", "conv2", __doc__))
