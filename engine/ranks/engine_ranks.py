"""An engine process's side of an engine that runs as several processes: start this node's other ranks, join
them, form the groups, stop them.

The world is ``data_parallel_size`` replicas of ``tensor_parallel_size`` ranks
each (one replica and its split ranks, or several replicas sharing their
experts): replica d is world ranks [d*T, (d+1)*T), and its rank 0 is the engine
process that schedules for it. A pipelined engine (one replica) is
``pipeline_parallel_size`` stages of T ranks: stage s is world ranks [s*T, (s+1)*T). The other ranks run
``engine.ranks.follower`` with the standard ``torchrun`` variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``):
this node's are forked from the engine process's forkserver
(``engine.processes.process_start``, imports paid once however many ranks),
ranks on other nodes are started by ``torchrun`` or by hand
(``moegate engine-rank``). Once the ranks have met they check together that
the world fits (``engine.distributed.world``), and each replica's engine
process sends its ``EngineConfig`` to its other ranks: every rank of a replica
builds the same model the same way, whatever its own command line said.
"""

import logging
import os
from multiprocessing.process import BaseProcess

import torch

from engine.core.config import EngineConfig, meeting_address
from engine.distributed.groups import RankGroups, RankInfo
from engine.distributed.parallel_groups import parallel_groups
from engine.distributed.replica_layout import free_port
from engine.distributed.world import ReplicaClaim, agree_on_world
from engine.core.model_config import ModelConfig
from engine.processes.process_start import run_main, start_process
from engine.worker.rank_messages import Stop, send_message

# The engine process's id, given to the follower ranks it starts itself: they end when it does.
EXIT_WITH_PARENT_ENV = "MOEGATE_EXIT_WITH_PARENT"

logger = logging.getLogger(__name__)


class EngineRanks:
    """The ranks of one engine process (a replica's rank 0): started when ``tensor_parallel_size`` > 1 or when
    ``data_parallel_size`` replicas share their experts. It starts this replica's other ranks on this node,
    meets every rank of the world, checks with them that the world fits together, forms the groups and sends
    its config to its replica's other ranks. Replicas step together: ``any_busy`` once per loop, then a step on
    every replica (a dummy one where there is no work)."""

    def __init__(self, config: EngineConfig, device: torch.device, model_config: ModelConfig,
                 dtype: torch.dtype) -> None:
        init = config.distributed_init_method or f"tcp://127.0.0.1:{free_port()}"
        host, port = meeting_address(init)
        split = config.engine_ranks  # this replica's ranks: its stages of tensor-parallel ranks
        world = self.world_size = config.data_parallel_size * split
        first = self.first_rank = config.data_parallel_rank * split  # this replica's ranks: [first, first + split)
        env = {"WORLD_SIZE": str(world), "MASTER_ADDR": host, "MASTER_PORT": str(port),
               EXIT_WITH_PARENT_ENV: str(os.getpid())}
        argv = ["--device", device.type, "--timeout", str(config.distributed_timeout_s)]
        # Forked from this process's forkserver (engine.processes.process_start): imports paid once, however many.
        self.processes: list[BaseProcess] = [
            start_process(run_main, ("engine.ranks.follower", argv), f"moegate-rank-{first + local}",
                          {**env, "RANK": str(first + local), "LOCAL_RANK": str(local)})
            for local in range(1, config.local_ranks or split)]
        try:
            self.groups = RankGroups(RankInfo(first, world, 0, init), device, config.distributed_timeout_s,
                                     starting=self.exited_rank)
        except BaseException:
            self._end_processes(0)
            raise
        try:
            claim = ReplicaClaim.of(config, model_config, str(dtype))
            parts = parallel_groups(self.groups, agree_on_world(self.groups, claim))
            parts.plans.broadcast_object(config)  # this replica's other ranks build what this process builds
        except BaseException:
            self.abort()
            raise
        self.tp, self.drivers, self.plans, self.stage = parts.tp, parts.drivers, parts.plans, parts.stage
        logger.info("engine ranks joined: %d of %d (%d on this node) at %s, replica %d of %d", split, world,
                    len(self.processes) + 1, init, config.data_parallel_rank, config.data_parallel_size)

    def any_busy(self, busy: bool) -> bool:
        """Whether any replica of the group has work (then every replica steps): one collective among the
        replicas' rank-0 processes, on each of them; ``busy`` itself when this engine is the only replica."""
        if self.drivers is None:
            return busy
        return bool(self.drivers.max_over_ranks(int(busy), "agreeing whether to step"))

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell this replica's other ranks to stop (``Stop``), wait for this node's, and leave the group."""
        try:
            send_message(self.plans, Stop())
        except Exception as e:  # a rank already gone: the rest end when their connections close
            logger.warning("could not tell every rank to stop: %s", e)
        self._end_processes(timeout_s)
        self.groups.close()

    def abort(self) -> None:
        """Leave the group without a word (the other ranks may be inside a collective) and end this node's ranks."""
        self.groups.close()  # their pending collectives fail as the connections close
        self._end_processes(5.0)

    def exited_rank(self) -> str | None:
        """Which rank this node started has exited already, if one has (None: all alive)."""
        for rank, process in enumerate(self.processes, start=self.first_rank + 1):
            if not process.is_alive():
                return f"rank {rank} of {self.world_size} exited with code {process.exitcode}"
        return None

    def _end_processes(self, timeout_s: float) -> None:
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                process.kill()
                process.join()

