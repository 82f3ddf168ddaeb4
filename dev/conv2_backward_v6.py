"""Stage 2's backward, version 6 (conv2_backward_v6.cu: version 5's data gradient, the weight and bias
gradients on the tensor cores as three TF32 products; compute capability 8.0 and newer), checked against
cuDNN's exact result and timed beside the versions that ship (7 and 8 run its sums in two warp roles).
Why it moved: docs/kernels.md, "Stage 2's backward".

    python dev/conv2_backward_v6.py [--batch 64 1024 8192 65536] [--check-only]
"""

import sys

from common import main

if __name__ == "__main__":
    sys.exit(main("conv2_backward_v6.cu", "conv2", __doc__))
