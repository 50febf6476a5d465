"""The MoE layers' routed-token counters, read back for statistics without making the host wait.

Each MoE block counts, on the device, the tokens routed to each of its experts. On CUDA a plain read
would wait for the device to finish everything queued, including an overlapped step in flight. So
``ExpertLoadReader`` queues a copy into pinned host memory behind the last launched step (one stacked
copy every ``every`` steps, an event behind it) and hands the counts out from a later call, once the
event has passed; the host never waits. On the CPU the counters are read at once.
"""

import torch


class ExpertLoadReader:
    """Reads ``counters`` (one [E] int64 tensor per MoE layer) for ``poll``."""

    def __init__(self, counters: list[torch.Tensor], device: torch.device, every: int) -> None:
        self.counters = counters
        self.device = device
        self.every = every  # steps between copies (CUDA)
        self._started_at = -every  # the step count at the last copy queued
        self._pending: tuple[torch.Tensor, torch.cuda.Event] | None = None  # [L, E] pinned, and its event

    def poll(self, num_steps: int) -> list[list[int]] | None:
        """Tokens routed to each expert since start, per MoE layer ([L][E]) if a read is ready now, else None
        (CUDA: a queued copy not done yet, or none due). ``num_steps``: steps launched so far."""
        if not self.counters:
            return None
        if self.device.type != "cuda":
            return torch.stack(self.counters).tolist()
        if self._pending is not None:
            host, copied = self._pending
            if not copied.query():
                return None
            self._pending = None
            return host.tolist()  # pinned host memory the copy has filled: no device read
        if num_steps - self._started_at >= self.every:
            self._started_at = num_steps
            stacked = torch.stack(self.counters)  # [L, E], queued behind the last launched step
            host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            self._pending = (host, copied)
        return None
