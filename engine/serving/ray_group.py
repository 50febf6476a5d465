"""An engine's ranks as Ray actors in one placement group (``--distributed-executor-backend ray``).

One bundle per rank (a GPU and a CPU on GPUs, ``cpu_threads`` CPUs on the CPU), reserved together under Ray's
PACK strategy: on as few nodes as have room, all on one where one has room for all of them, spread over several
where none has. Rank r runs in bundle r (``engine.serving.ray_rank.RankActor``): rank 0 connects back to the
gateway and runs the engine loop, the others follow it; torch.distributed joins them as it joins local processes
(gloo on the CPU, NCCL on GPUs) at a free port of rank 0's node.

The group lives and dies whole: ``watch`` reports the first rank whose call ended (its node left the cluster,
its process died, a collective failed), and ``stop`` or ``kill`` removes the placement group, which ends every
actor in it. A restart is a fresh group, placed wherever Ray has room at that moment.
"""

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from engine.core.config import EngineConfig
from engine.serving.ray_rank import RankActor, rank_zero_config

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0  # how long Ray may take to find room for every rank of the engine
CONNECT_TIMEOUT_S = 60.0  # how long rank 0's actor may take to start and connect back to the gateway
# Data-parallel replicas start at once, each from a thread of its own: one of them joins Ray, the others find it
# joined (two ray.init calls at once: the second fails with "called ray.init twice").
_JOINING = threading.Lock()


class RayGroupError(RuntimeError):
    """The group could not be placed or started (no room on the cluster, an actor that died starting)."""


def connect_ray(address: str | None) -> None:
    """Join the Ray cluster at ``address`` (None: ``RAY_ADDRESS``, else a local Ray), unless this process already
    has (a program that called ``ray.init`` itself keeps its connection)."""
    import ray

    with _JOINING:
        if not ray.is_initialized():
            ray.init(address=address, logging_level=logging.WARNING)


def reclaim_sigterm() -> None:
    """Give SIGTERM back to this process's own handler (asyncio's, which drains the gateway) after joining Ray:
    a Ray driver (one that started Ray itself, at least) installs a crash handler for it that prints a stack
    trace and aborts the process, so a gateway told to stop would end at once, its requests cut and its last
    usage unwritten. Only the main thread may set handlers: elsewhere this does nothing."""
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGTERM)
        if handler is not None:  # None: set outside Python, nothing of ours to put back
            signal.signal(signal.SIGTERM, handler)  # installs CPython's handler again, which calls ``handler``


class RayRankGroup:
    """The placement group and actors of one start of one engine; ``start`` places them and returns the
    gateway's connection to rank 0."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.size = config.engine_ranks
        self.placement: list[tuple[str, int]] = []  # (Ray node id, process id) of each rank, once started
        self._pg = None
        self._actors: list = []
        self._refs: list = []  # each rank's running call (lead, follow...), in rank order
        self._stopping = False

    def start(self, authkey: bytes) -> Connection:
        """Reserve a bundle per rank, start the actors, have rank 0 connect back and authenticate; the
        connection (both directions of the engine's protocol). Blocks; RayGroupError when any of it fails
        (what was started is removed)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from engine.serving.handshake import authenticate

        started = time.monotonic()
        connect_ray(self.config.ray_address)
        device = self._device_type(ray.cluster_resources())
        cpus = 1 if device == "cuda" else max(1, self.config.cpu_threads or 1)
        bundle = {"CPU": cpus, **({"GPU": 1} if device == "cuda" else {})}
        self._pg = placement_group([dict(bundle) for _ in range(self.size)], strategy="PACK")
        try:
            try:
                ray.get(self._pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise RayGroupError(f"Ray found no room for the engine's {self.size} ranks ({bundle} each) within "
                                    f"{PLACEMENT_TIMEOUT_S:.0f} s: add nodes or lower the ranks' needs") from None
            reserved = time.monotonic()
            actor = ray.remote(RankActor)
            self._actors = [actor.options(num_cpus=cpus, num_gpus=bundle.get("GPU", 0), max_restarts=0,
                                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                                              self._pg, placement_group_bundle_index=rank)).remote()
                            for rank in range(self.size)]
            points = ray.get([a.meeting_point.remote() for a in self._actors], timeout=CONNECT_TIMEOUT_S)
            self.placement = [(node, pid) for _, _, node, pid in points]
            up = time.monotonic()
            host, port = points[0][0], points[0][1]
            init = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
            gateway_host = ray.util.get_node_ip_address()  # this process's node, as the cluster reaches it
            with socket.create_server((gateway_host, 0), family=socket.AF_INET6 if ":" in gateway_host
                                      else socket.AF_INET) as listener:
                self._refs = [self._actors[0].lead.remote(rank_zero_config(self.config, init, device, host),
                                                          listener.getsockname()[:2], authkey, CONNECT_TIMEOUT_S)]
                self._refs += [a.follow.remote(rank, self.size, init, device, self.config.distributed_timeout_s)
                               for rank, a in enumerate(self._actors[1:], start=1)]
                sock = self._accept(listener)
            conn = Connection(sock.detach())
            try:
                authenticate(conn, authkey, listening_side=True)
            except BaseException:
                conn.close()
                raise
        except BaseException:
            self.kill()
            raise
        logger.info("engine ranks placed by Ray: %s; bundles reserved in %.1f s, actors up in %.1f s, rank 0 "
                    "connected in %.1f s", ", ".join(f"rank {r} on node {node[:8]} (pid {pid})"
                                                      for r, (node, pid) in enumerate(self.placement)),
                    reserved - started, up - reserved, time.monotonic() - up)
        return conn

    def watch(self, on_end: Callable[[str], None]) -> None:
        """Call ``on_end(why)`` from a thread of its own when the first rank's call ends (unless ``stop`` or
        ``kill`` came first): the engine is then incomplete, and its connection must be cut."""
        import ray

        def run() -> None:
            while not self._stopping:
                try:
                    done, _ = ray.wait(self._refs, num_returns=1, timeout=1.0)
                except Exception as e:  # this process lost Ray itself: the ranks cannot be watched any more
                    if not self._stopping:
                        on_end(f"the connection to Ray was lost ({e})")
                    return
                if done:
                    if not self._stopping:
                        on_end(self._ended(done[0]))
                    return

        threading.Thread(target=run, name="moegate-ray-ranks-watch", daemon=True).start()

    def stop(self, timeout_s: float) -> None:
        """After the engine was told to shut down: wait up to ``timeout_s`` for rank 0 to finish, then remove the
        group (which ends every actor left)."""
        import ray

        self._stopping = True
        if self._refs and timeout_s > 0:
            try:
                ray.wait(self._refs[:1], timeout=timeout_s)
            except Exception as e:  # Ray itself is gone: nothing left to wait for
                logger.warning("waiting for the engine's rank 0 actor: %s", e)
        self.kill()

    def kill(self) -> None:
        """Remove the placement group and its actors now."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self._stopping = True
        pg, self._pg = self._pg, None
        actors, self._actors = self._actors, []
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone with its node
                pass
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception as e:
                logger.warning("removing the engine's placement group: %s", e)

    def _device_type(self, resources: dict) -> str:
        if self.config.device != "auto":
            return self.config.device
        return "cuda" if resources.get("GPU", 0) >= 1 else "cpu"

    def _accept(self, listener: socket.socket) -> socket.socket:
        """Rank 0's connection, within CONNECT_TIMEOUT_S; RayGroupError as soon as any rank's call has ended."""
        import ray

        listener.settimeout(1.0)
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                sock, _ = listener.accept()
                sock.settimeout(None)
                return sock
            except TimeoutError:
                pass
            done, _ = ray.wait(self._refs, num_returns=1, timeout=0)
            if done:
                raise RayGroupError(f"the engine's ranks did not start: {self._ended(done[0])}")
            if time.monotonic() > deadline:
                raise RayGroupError(f"rank 0's Ray actor did not connect within {CONNECT_TIMEOUT_S:.0f} s")

    def _ended(self, ref) -> str:
        """Why a rank's call ended, in one line naming the rank."""
        import ray

        rank = self._refs.index(ref)
        where = f"rank {rank} of {self.size} (node {self.placement[rank][0][:8]})" if self.placement else f"rank {rank}"
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError as e:  # its process or node is gone
            return f"{where} was lost: {_one_line(e, last=False)}"
        except Exception as e:  # its call raised (a collective failed when a peer left)
            return f"{where} failed: {_one_line(e)}"
        return f"{where} ended"


def _one_line(error: BaseException, last: bool = True) -> str:
    """One line of Ray's error text: a failed call's last (the exception raised), a lost actor's first."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return (lines[-1] if last else lines[0])[:300] if lines else type(error).__name__
