"""Rank 0's side of an engine that runs as several processes: start this node's other ranks, join them, stop them.

The other ranks are ordinary processes running ``engine.distributed.follower``
with the standard ``torchrun`` variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so ranks on other nodes are
started the same way, by ``torchrun`` or by hand (``moegate engine-rank``).
Once the ranks have met, rank 0 sends them its ``EngineConfig``: every rank
builds the same model the same way, whatever its own command line said.
"""

import logging
import os
import subprocess
import sys

import torch

from engine.core.config import EngineConfig
from engine.distributed.collectives import TensorParallel
from engine.distributed.expert_parallel import ExpertParallel
from engine.distributed.groups import RankGroups, RankInfo
from engine.distributed.replica_layout import free_port

logger = logging.getLogger(__name__)

def parallel_group(groups: RankGroups, config: EngineConfig) -> TensorParallel:
    """The collectives of an engine's group of ranks, with experts divided among them if the config says so."""
    tp = TensorParallel(groups)
    if config.enable_expert_parallel:
        tp.expert_parallel = ExpertParallel(tp, config.expert_dispatch)
    return tp


class EngineRanks:
    """Started by rank 0 (the engine process) when ``tensor_parallel_size`` > 1."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        init = config.distributed_init_method or f"tcp://127.0.0.1:{free_port()}"
        host, port = init[len("tcp://"):].rsplit(":", 1)
        world = config.tensor_parallel_size
        env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": host, "MASTER_PORT": port}
        command = [sys.executable, "-m", "engine.distributed.follower", "--device", device.type,
                   "--timeout", str(config.distributed_timeout_s)]
        self.processes: list[subprocess.Popen] = []
        for rank in range(1, config.local_ranks or world):
            self.processes.append(subprocess.Popen(command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
        try:
            self.groups = RankGroups(RankInfo(0, world, 0, init), device, config.distributed_timeout_s,
                                     starting=self._exited)
        except BaseException:
            self._end_processes(0)
            raise
        self.tp = parallel_group(self.groups, config)
        self.tp.broadcast_object(config)
        logger.info("engine ranks joined: %d (%d on this node) at %s", world, len(self.processes) + 1, init)

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the other ranks to stop (an empty plan), wait for this node's, and leave the group."""
        try:
            self.tp.broadcast_object(None)
        except Exception as e:  # a rank already gone: the rest end when their connections close
            logger.warning("could not tell every rank to stop: %s", e)
        self._end_processes(timeout_s)
        self.groups.close()

    def abort(self) -> None:
        """Leave the group without a word (the other ranks may be inside a collective) and end this node's ranks."""
        self.groups.close()  # their pending collectives fail as the connections close
        self._end_processes(5.0)

    def _exited(self) -> str | None:
        """Which rank this node started has exited already (while the ranks meet), if one has."""
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                return f"rank {rank} exited with code {process.returncode}"
        return None

    def _end_processes(self, timeout_s: float) -> None:
        for process in self.processes:
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class DataParallelPeers:
    """This engine's place among ``data_parallel_size`` whole engines whose MoE layers share one
    expert-parallel group; they step together (``any_busy`` once per loop, then a step on every engine)."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        info = RankInfo(config.data_parallel_rank, config.data_parallel_size, 0, config.distributed_init_method)
        self.groups = RankGroups(info, device, config.distributed_timeout_s)
        self.peers = TensorParallel(self.groups)
        self.tp = TensorParallel()  # this engine's own model is whole; only its experts are divided
        self.tp.expert_parallel = ExpertParallel(self.peers, config.expert_dispatch, tokens_replicated=False)
        logger.info("data-parallel engine %d of %d joined at %s", info.rank, info.world_size, info.init_method)

    def any_busy(self, busy: bool) -> bool:
        """Whether any engine of the group has work (then every engine steps): one collective, on every engine."""
        return bool(self.peers.max_over_ranks(int(busy), "agreeing whether to step"))

    def close(self) -> None:
        self.groups.close()

    abort = close

