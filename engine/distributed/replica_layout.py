"""How a node's engine replicas are laid out: each one's config and devices (no torch: the command line uses it)."""

import dataclasses
import socket

from engine.core.config import EngineConfig, meeting_address


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


def replica_configs(config: EngineConfig, replicas: int, remote: int = 0) -> list[EngineConfig]:
    """The config of each of ``replicas`` engines on this node: the same config, or with
    ``enable_expert_parallel`` data-parallel ranks 0 to ``replicas`` - 1 of one expert-parallel group meeting at
    ``distributed_init_method`` (a free local port if unset), whose ranks ``replicas`` and up are the ``remote``
    engines other nodes serve (``moegate engine --data-parallel-rank``). ValueError for a combination not
    supported."""
    if not config.enable_expert_parallel or replicas + remote <= 1:
        if replicas > 1 and config.engine_ranks > 1 and config.distributed_init_method:
            # Independent replicas split over ranks each meet on their own: replica i at the given port + i.
            return [dataclasses.replace(config, distributed_init_method=_port_plus(config.distributed_init_method, i))
                    for i in range(replicas)]
        return [config] * replicas
    if remote and not config.distributed_init_method:
        raise ValueError("replicas on other nodes that share the experts meet this node's at "
                         "--distributed-init-method tcp://HOST:PORT (an address of this node they can reach)")
    init = config.distributed_init_method or f"tcp://127.0.0.1:{free_port()}"
    size = replicas + remote
    return [dataclasses.replace(config, data_parallel_size=size, data_parallel_rank=i, distributed_init_method=init)
            for i in range(replicas)]


def _port_plus(init_method: str, offset: int) -> str:
    """``tcp://HOST:PORT`` with PORT + ``offset``; ValueError past the last port."""
    port = meeting_address(init_method)[1] + offset
    if port > 65535:
        raise ValueError(f"--distributed-init-method {init_method}: replica {offset} would meet at port {port}, "
                         "past 65535 (independent replicas meet at the port given + their index)")
    return f"{init_method.rsplit(':', 1)[0]}:{port}"


def replica_devices(config: EngineConfig, replica: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` of local replica ``replica``: the GPUs of its ranks on this node (``local_ranks``,
    or all ``engine_ranks``), after the previous replicas' (ignored on the CPU)."""
    n = config.local_ranks or config.engine_ranks
    return ",".join(str(replica * n + i) for i in range(n))
