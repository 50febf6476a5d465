"""An engine on another machine (``moegate engine --listen``) as the gateway's ``AsyncEngine``.

Everything but the transport is ``AsyncEngine``'s: the protocol, the reader,
the failure handling. Prompts are prepared here, so the gateway needs the
tokenizer files (``--model`` on the gateway's side names them).
"""

import asyncio
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection

import msgspec

from engine.core.config import EngineConfig, meeting_address
from engine.serving.async_engine import AsyncEngine, EngineError
from engine.serving.engine_server import enable_keepalive
from engine.serving.handshake import authenticate, shut
from engine.serving.protocol import PROTOCOL_VERSION, Attach, Fatal, Hello, encoder, greeting_decoder


CONNECT_TIMEOUT_S = 10.0


def _close_made(connecting: Future) -> None:
    """Close the connection a cancelled start made after all (the engine server then starts nothing for it)."""
    if not connecting.cancelled() and connecting.exception() is None:
        connecting.result().close()


_CONNECTS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="moegate-connect")  # a few remote engines at once


class RemoteEngine(AsyncEngine):
    def __init__(self, config: EngineConfig, address: tuple[str, int], authkey: bytes,
                 stall_timeout_s: float | None = None, group_place: tuple[int, int] | None = None) -> None:
        """``group_place``: (rank, size) this engine must hold in the gateway's group of replicas that divide
        the experts (None: an independent replica); one that reports another place fails its start."""
        super().__init__(config, stall_timeout_s=stall_timeout_s)
        self.address = address
        self._authkey = authkey
        self.group_place = group_place
        self._greeted: Connection | None = None  # checked by preflight, not yet attached

    def describe(self) -> str:
        return f"the engine at {self.address[0]}:{self.address[1]}"

    async def preflight(self) -> None:
        """Connect and check the engine's place without attaching it (nothing is built yet); the start then
        attaches on this connection. A gateway with several replicas checks them all before starting any, so
        one that is wrong or unreachable leaves no other engine building for a group that will not form."""
        self._greeted = await self._greeted_connection()

    async def shutdown(self) -> None:
        greeted, self._greeted = self._greeted, None
        if greeted is not None:  # checked, never attached: the engine server has started nothing for it
            greeted.close()
        await super().shutdown()

    async def _open(self) -> tuple[Connection, Connection]:
        conn, self._greeted = self._greeted, None
        if conn is None:
            conn = await self._greeted_connection()
        try:
            conn.send_bytes(encoder.encode(Attach(self.config.deployment_id)))
        except OSError as e:
            conn.close()
            raise EngineError("the engine stopped", detail=f"{self.describe()} left before it was attached ({e})"
                              ) from None
        enable_keepalive(conn)
        return conn, conn

    async def _greeted_connection(self) -> Connection:
        connecting = _CONNECTS.submit(self._connect)
        try:
            return await asyncio.wrap_future(connecting)
        except asyncio.CancelledError:  # the gateway is stopping: a connection made after all is closed at once
            connecting.add_done_callback(_close_made)
            raise

    def _connect(self) -> Connection:
        """Connect, authenticate and check the engine's ``Hello`` within ``CONNECT_TIMEOUT_S``: a listener that
        accepts TCP but never answers (a frozen engine: the kernel still completes the handshake) fails this
        start instead of holding the supervisor forever, as ``multiprocessing.connection.Client`` would."""
        try:
            sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT_S)
        except OSError as e:  # refused, unreachable
            raise EngineError(f"cannot reach {self.describe()}: {e.strerror or e}") from None
        sock.settimeout(None)  # Connection reads the descriptor in blocking mode
        conn = Connection(sock.detach())
        timer = threading.Timer(CONNECT_TIMEOUT_S, shut, (conn,))
        timer.start()
        try:
            authenticate(conn, self._authkey, listening_side=False, timeout_s=CONNECT_TIMEOUT_S)
            greeting = greeting_decoder.decode(conn.recv_bytes())
        except msgspec.DecodeError:  # a Hello of other fields
            conn.close()
            raise EngineError(f"{self.describe()} speaks another protocol: run the same moegate version on the "
                              "gateway and its engines") from None
        except Exception as e:  # a wrong key (AuthenticationError), or cut by the timer (EOFError)
            conn.close()
            raise EngineError(f"cannot connect to {self.describe()}: {type(e).__name__}: {str(e) or 'no answer'}"
                              ) from None
        finally:
            timer.cancel()
        try:
            if isinstance(greeting, Fatal):  # serving another gateway
                raise EngineError(f"{self.describe()}: {greeting.message}")
            if greeting.protocol != PROTOCOL_VERSION:
                raise EngineError(f"{self.describe()} speaks protocol {greeting.protocol}, this gateway "
                                  f"{PROTOCOL_VERSION}: run the same moegate version on the gateway and its engines")
            self._check_place(greeting)
        except BaseException:
            conn.close()  # the engine server sees this gateway leave, and has started nothing
            raise
        return conn

    def _check_place(self, hello: Hello) -> None:
        """EngineError, saying how to start the engine, unless it holds the place this gateway needs it in."""
        place = (hello.data_parallel_rank, hello.data_parallel_size)
        if self.group_place is None:
            if place != (0, 1):
                raise EngineError(
                    f"{self.describe()} is data-parallel rank {place[0]} of {place[1]} of an expert group, but this "
                    "gateway attaches it as an independent replica: attach the group's engines with "
                    "--engines-share-experts, or start this one without --data-parallel-size/--data-parallel-rank")
            return
        rank, size = self.group_place
        if place != self.group_place:
            held = (f"is data-parallel rank {place[0]} of {place[1]}" if place[1] > 1
                    else "was started as an independent engine")
            raise EngineError(f"{self.describe()} {held}, but this gateway needs it as data-parallel rank {rank} of "
                              f"{size} of its expert group: start it with "
                              f"--enable-expert-parallel --data-parallel-size {size} --data-parallel-rank {rank} "
                              f"--distributed-init-method {self.config.distributed_init_method}")
        # Only the ports must match: the host may be spelled differently on each side (a name, an address).
        ours, theirs = (meeting_address(m)[1] if m else None
                        for m in (self.config.distributed_init_method, hello.distributed_init_method))
        if theirs != ours:
            raise EngineError(f"{self.describe()} meets its expert group at {hello.distributed_init_method}, but "
                              f"this gateway's group meets at {self.config.distributed_init_method}: start it with "
                              f"--distributed-init-method {self.config.distributed_init_method}")

    def _cut_off(self, replies: Connection) -> None:
        shut(replies)  # the reader's recv ends

    async def _close(self, replies: Connection) -> None:
        # The engine stays up for the next gateway. Shut the socket down, not only close it: our reader thread
        # is blocked reading it, which keeps it open (no FIN) until the engine's side closes, so the server
        # would not see this gateway leave until its engine had ended.
        shut(replies)
