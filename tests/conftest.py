"""Run the Triton kernels in Triton's CPU interpreter when there is no GPU.

TRITON_INTERPRET must be set before any module defining a Triton kernel is first
imported (``triton.jit`` chooses compiled or interpreted at decoration), so it
is set here, before pytest collects any test module: then no order of test
files can import a kernel first. Only without CUDA: with a GPU the same tests run
the compiled kernels. The torch tests never look at it; on a CPU-only machine
nothing else can run Triton, so the rest of the suite is unaffected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
