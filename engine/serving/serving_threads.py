"""Torch's CPU threads in the engine process, sized by what the engine is serving.

The gateway process shares the machine with the engine process. While live
(foreground) work is about, the gateway is busy streaming and admitting, and
with as many torch threads as cores each of its wakeups stalls a thread of the
step's parallel regions, so a step, however small, waits a scheduler time
slice: on 2 cores, steps of 10 ms measured 30-50 ms beside a busy gateway. So
the engine then leaves one core to the gateway. With only background work (the
Batch API's lines) and no foreground work for ``background_window_s``, the
gateway does little (a result write per wave of finished lines), and the engine
takes every core: the batch's throughput is then what the offline engine's is.

A ``cpu_threads`` set in ``EngineConfig`` is kept as it is, whatever is served.
"""

from collections.abc import Callable

from engine.core.config import EngineConfig


class ServingThreads:
    """Chooses torch's intra-op thread count before each step (CPU only)."""

    def __init__(self, config: EngineConfig, cores: int, set_threads: Callable[[int], None]) -> None:
        fixed = config.cpu_threads
        self.shared = fixed or max(1, cores - 1)  # foreground work present or recent: a core for the gateway
        self.alone = fixed or cores  # background work only
        self._set_threads = set_threads
        self.current: int | None = None

    def before_step(self, foreground_recent: bool) -> None:
        want = self.shared if foreground_recent else self.alone
        if want != self.current:  # changing it costs little (measured: no slower than steady state)
            self._set_threads(want)
            self.current = want


def serving_threads(config: EngineConfig) -> ServingThreads | None:
    """The engine process's policy, or None off the CPU (the model's threads then do not matter)."""
    import torch

    from engine.llm_engine import resolve_device

    if resolve_device(config.device).type != "cpu":
        return None
    return ServingThreads(config, torch.get_num_threads(), torch.set_num_threads)
