"""Stage 2's backward, versions 1 and 2 (conv2_backward_v1_v2.cu: each pooled gradient routed through its
argmax, a block of one part, 160 threads, or two, 320), checked against cuDNN's exact result and timed
beside the versions that ship (3: the same kernel in four parts; 4, 5: dense; 7, 8: tensor cores). Why
they moved: docs/kernels.md, "Stage 2's backward".

    python dev/conv2_backward_v1_v2.py [--batch 64 1024 8192 65536] [--check-only]
"""

import sys

from common import main

if __name__ == "__main__":
    sys.exit(main("conv2_backward_v1_v2.cu", "conv2", __doc__))
