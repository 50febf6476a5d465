"""Building the gateway's engine from the command line's settings: local engine processes, remote engines
(``moegate engine --listen``) and the router over them; the key a gateway and its remote engines share."""

import dataclasses
import os

from engine.core.config import EngineConfig
from engine.distributed.replica_layout import replica_configs, replica_devices


def engine_authkey() -> bytes:
    """The key a gateway and its remote engines share (``$MOEGATE_ENGINE_KEY``); ValueError if unset."""
    from engine.serving.engine_server import AUTHKEY_ENV

    key = os.environ.get(AUTHKEY_ENV, "")
    if len(key) < 16:
        raise ValueError(f"set {AUTHKEY_ENV} to the same secret (16 characters or more) on the gateway and its engines")
    return key.encode()


def build_engines(engine_config: EngineConfig, local: int, remote: list[tuple[str, int]], authkey: bytes,
                  policy: str, stall_timeout_s: float, group_remotes: int = 0, fleet_fairness: bool = False):
    """The gateway's engine: one local engine process, or a router over ``local`` of them and the
    ``remote`` engines (``moegate engine --listen``); each is cut off after ``stall_timeout_s`` of silence
    with requests waiting. ``group_remotes``: how many of the remote engines are ranks of the local replicas'
    expert group (all of them or none). ``fleet_fairness``: the router's weighted-fair queue over the replicas
    (``gateway.fleet_fairness``)."""
    from engine.serving.remote_engine import RemoteEngine
    from gateway.replica_router import ReplicaRouter
    from gateway.routing_policy import RouterConfig

    if local == 1 and not remote:
        return local_engine(engine_config, None, stall_timeout_s)
    # On GPUs each local replica takes its own devices (on the CPU the variable is ignored); with
    # --enable-expert-parallel the replicas form one group that divides the experts.
    replicas = [local_engine(config, {"CUDA_VISIBLE_DEVICES": replica_devices(config, i)}, stall_timeout_s)
                for i, config in enumerate(replica_configs(_cpu_share(engine_config, local), local, group_remotes))]
    group_size = local + group_remotes
    replicas += [RemoteEngine(engine_config, address, authkey, stall_timeout_s,
                              group_place=(local + i, group_size) if group_remotes else None)
                 for i, address in enumerate(remote)]
    names = [str(i) for i in range(local)] + [f"{host}:{port}" for host, port in remote]
    return ReplicaRouter(replicas, names, RouterConfig(policy=policy, fleet_fairness=fleet_fairness))


def local_engine(config: EngineConfig, process_env: dict[str, str] | None, stall_timeout_s: float):
    """One engine the gateway starts itself: an engine process on this node (its ``process_env``: its GPUs), or
    with ``--distributed-executor-backend ray`` Ray actors placed by the cluster (which gives them their GPUs)."""
    if config.distributed_executor_backend == "ray":
        from engine.serving.ray_engine import RayEngine

        return RayEngine(config, stall_timeout_s=stall_timeout_s)
    from engine.serving.async_engine import AsyncEngine

    return AsyncEngine(config, process_env=process_env, stall_timeout_s=stall_timeout_s)


def _cpu_share(engine_config: EngineConfig, local: int) -> EngineConfig:
    """Replicas on the CPU share its cores: each rank process of ``local`` replicas gets its share, not all of them
    (oversubscribed threads wait at every parallel region's barrier for a descheduled peer)."""
    on_this_node = engine_config.distributed_executor_backend == "mp"
    if local > 1 and engine_config.cpu_threads is None and engine_config.device != "cuda" and on_this_node:
        processes = local * engine_config.engine_ranks
        return dataclasses.replace(engine_config, cpu_threads=max(1, (os.cpu_count() or 1) // processes))
    return engine_config


def build_scalable(engine_config: EngineConfig, local: int, most: int, policy: str, stall_timeout_s: float,
                   fleet_fairness: bool = False):
    """``local`` local replicas behind a router, and the ``ReplicaScaler`` that grows them up to ``most`` while
    the gateway serves: each replica, at the start or later, is built the same way (local replica *k*: its GPUs,
    ports and disk-tier directory; on the CPU a share of the cores for ``most`` replicas)."""
    from gateway.replica_router import ReplicaRouter
    from gateway.replica_scaling import ReplicaScaler
    from gateway.routing_policy import RouterConfig

    configs = replica_configs(_cpu_share(engine_config, most), most)

    def build(k: int):
        return local_engine(configs[k], {"CUDA_VISIBLE_DEVICES": replica_devices(configs[k], k)}, stall_timeout_s)

    router = ReplicaRouter([build(k) for k in range(local)], [str(k) for k in range(local)],
                           RouterConfig(policy=policy, fleet_fairness=fleet_fairness))
    return router, ReplicaScaler(router, build, most)
