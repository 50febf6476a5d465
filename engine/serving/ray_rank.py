"""One rank of an engine as a Ray actor (``--distributed-executor-backend ray``): the same entry points a rank
runs as a local process, called inside the actor.

Rank 0 (``lead``) connects back to the gateway, proves it holds the engine's key, and runs the engine loop
(``engine.serving.engine_process.run_engine``) on that one connection, as an engine served over TCP does; its
other ranks are not its own processes but the group's other actors (``local_ranks`` 1). Every other rank
(``follow``) is ``engine.ranks.follower.run_follower``, as ``moegate engine-rank`` runs it. Each call blocks
for the rank's life: it returns when the engine stops, or raises when a peer or the gateway goes away.

Imports torch and the engine only inside the calls, so that the actor answers ``meeting_point`` as soon as its
worker has started. No Ray import here either: ``engine.serving.ray_group`` wraps this class with ``ray.remote``.
"""

import dataclasses
import os
import socket

from engine.core.config import EngineConfig


class RankActor:
    """A rank of an engine, placed by Ray in its bundle of the engine's placement group."""

    def meeting_point(self) -> tuple[str, int, str, int]:
        """(this node's address, a free port on it, Ray's id of this node, this process's id): rank 0's answer
        is where the group meets (``distributed_init_method``); the node ids say where Ray placed each rank."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return host, port, ray.get_runtime_context().get_node_id(), os.getpid()

    def lead(self, config: EngineConfig, gateway: tuple[str, int], authkey: bytes, connect_timeout_s: float) -> None:
        """Rank 0: serve the engine ``config`` describes to the gateway listening at ``gateway`` until it says
        Shutdown or goes away. ``config`` already names where the group meets and that no rank is local."""
        from multiprocessing.connection import Connection

        from engine.serving.engine_server import enable_keepalive
        from engine.serving.engine_process import run_engine
        from engine.serving.handshake import authenticate

        sock = socket.create_connection(gateway, timeout=connect_timeout_s)
        sock.settimeout(None)  # Connection reads the descriptor in blocking mode
        conn = Connection(sock.detach())
        try:
            authenticate(conn, authkey, listening_side=False, timeout_s=connect_timeout_s)
            enable_keepalive(conn)  # a gateway behind a dead link ends this engine too
            run_engine(config, conn, conn)
        finally:
            conn.close()

    def follow(self, rank: int, world_size: int, init_method: str, device_type: str, timeout_s: float) -> None:
        """Rank ``rank`` of ``world_size``: join the group at ``init_method`` and follow rank 0's plans until it
        says Stop (``run_follower``; CollectiveError when rank 0 or a peer goes away). Ray gives the actor its
        own GPU, so its local rank is 0."""
        from engine.distributed.groups import RankInfo
        from engine.ranks.follower import run_follower

        run_follower(RankInfo(rank, world_size, 0, init_method), device_type, timeout_s)


def rank_zero_config(config: EngineConfig, init_method: str, device_type: str, node_host: str) -> EngineConfig:
    """The config rank 0's actor runs: its group meets at ``init_method``, and none of its ranks is its own
    process (the others are actors too); ``device_type`` as the placement decided it. A decode engine with no
    ``kv_transfer_address`` waits for its prefill engines' KV at ``node_host`` (rank 0's node, as the cluster
    reaches it): its default, loopback, is another node's own."""
    kv_address = config.kv_transfer_address
    if config.role == "decode" and kv_address is None:
        kv_address = node_host
    return dataclasses.replace(config, distributed_executor_backend="mp", ray_address=None, local_ranks=1,
                               distributed_init_method=init_method, device=device_type,
                               kv_transfer_address=kv_address)
