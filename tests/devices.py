"""``DEVICES``: parametrize a test over the CPU and, where there is one, the GPU.

The CUDA case is skipped on a machine without CUDA, so CI runs the CPU case alone, and the first GPU session
(benchmarks/gpu_session.sh, stage tests-paths) runs the same assertions through the CUDA-only code: compiled
Triton kernels, decode CUDA graphs, device-side masks and sampling.
"""

import pytest
import torch

DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")))
