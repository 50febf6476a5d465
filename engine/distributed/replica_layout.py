"""How a node's engine replicas are laid out: each one's config and devices (no torch: the command line uses it)."""

import dataclasses
import socket

from engine.core.config import EngineConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_world_ranks(data_parallel_size: int, tensor_parallel_size: int) -> list[list[int]]:
    """The world ranks of each replica of an expert-parallel group of ``data_parallel_size`` replicas, each
    split over ``tensor_parallel_size`` ranks: replica d holds ranks [d*T, (d+1)*T), its rank 0 (d*T) the
    process that schedules for it."""
    t = tensor_parallel_size
    return [list(range(d * t, (d + 1) * t)) for d in range(data_parallel_size)]


def replica_configs(config: EngineConfig, replicas: int) -> list[EngineConfig]:
    """The config of each of ``replicas`` engines on this node: the same config, or with
    ``enable_expert_parallel`` data-parallel ranks of one expert-parallel group meeting at
    ``distributed_init_method`` (a free local port if unset). ValueError for a combination not supported."""
    if replicas <= 1 or not config.enable_expert_parallel:
        return [config] * replicas
    init = config.distributed_init_method or f"tcp://127.0.0.1:{free_port()}"
    return [dataclasses.replace(config, data_parallel_size=replicas, data_parallel_rank=i, distributed_init_method=init)
            for i in range(replicas)]


def replica_devices(config: EngineConfig, replica: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` of local replica ``replica``: its ``tensor_parallel_size`` GPUs, after the
    previous replicas' (ignored on the CPU)."""
    n = config.tensor_parallel_size
    return ",".join(str(replica * n + i) for i in range(n))
