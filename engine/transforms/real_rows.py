"""How many rows of a padded forward are real, for the MoE layers' expert-load counters.

The CUDA-graph transforms run the model over fixed-size static buffers: a step of n tokens (or n decodes) is
padded to a captured size B, and the rows [n, B) are routed through the MoE layers like any other. Counted, they
would add the padding's garbage tokens (and every warm-up run before a capture) to the expert-load statistics
and to what load balancing decides from. So the transforms keep the real row count in a [1] device tensor that
the layers' routing reads on the device (``moe_kernels.route``'s ``count_rows``): a captured graph reads each
replay's count, the host never waits, and a warm-up run (all padding) counts nothing.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.layers.moe import SparseMoeBlock


class RealRows:
    """The real row count of a transform's padded forwards, and the MoE blocks that count by it."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.count = torch.zeros(1, dtype=torch.int64, device=device)  # [1]: rows [0, count) are real

    def set(self, num_rows: int) -> None:
        """The next forward's (or replay's) real rows: a fill queued on the device, no host sync."""
        self.count.fill_(num_rows)

    @contextmanager
    def counted(self) -> Iterator[None]:
        """Within: the MoE blocks count only the first ``count[0]`` rows (a capture records the read of
        ``count``); outside, eager steps count every row again."""
        for block in self.blocks:
            block.count_rows = self.count
        try:
            yield
        finally:
            for block in self.blocks:
                block.count_rows = None
