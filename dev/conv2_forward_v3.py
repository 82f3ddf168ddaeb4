"""Stage 2's forward, versions 3 and 4 (conv2_forward_v3.cu: an implicit GEMM on the tensor cores, each product
three TF32 products, the image kept split or split where loaded; compute capability 8.0 and newer), checked
against cuDNN's exact result as the planner checks a forward candidate and timed beside the versions that
ship (1 and 2, float32 multiply-adds).

    python dev/conv2_forward_v3.py [--batch 64 1024 8192 65536] [--check-only]
"""

import sys

from common import main

if __name__ == "__main__":
    sys.exit(main("conv2_forward_v3.cu", "conv2", __doc__))
