"""Run the Triton kernels in Triton's CPU interpreter when there is no GPU.

TRITON_INTERPRET must be set before ``moe_kernels.triton_backend`` is first
imported (``triton.jit`` chooses compiled or interpreted at decoration), so it
is set here, at collection. Only without CUDA: with a GPU the same tests run
the compiled kernels. The torch tests never look at it; on a CPU-only machine
nothing else can run Triton, so the rest of the suite is unaffected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
