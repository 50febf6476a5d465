"""An engine on another machine (``moegate engine --listen``) as the gateway's ``AsyncEngine``.

Everything but the transport is ``AsyncEngine``'s: the protocol, the reader,
the failure handling. Prompts are prepared here, so the gateway needs the
tokenizer files (``--model`` on the gateway's side names them).
"""

import socket
import threading
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from engine.core.config import EngineConfig
from engine.serving.async_engine import AsyncEngine, EngineError
from engine.serving.engine_server import enable_keepalive
from engine.serving.protocol import Ready


CONNECT_TIMEOUT_S = 10.0


def _shut(conn: Connection) -> None:
    """End both directions of the connection's socket: a thread blocked reading it gets EOF."""
    try:
        sock = socket.socket(fileno=conn.fileno())  # the same socket, not a copy
    except OSError:  # already closed
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


class RemoteEngine(AsyncEngine):
    def __init__(self, config: EngineConfig, address: tuple[str, int], authkey: bytes,
                 stall_timeout_s: float | None = None, group_place: tuple[int, int] | None = None) -> None:
        """``group_place``: (rank, size) this engine must hold in the gateway's group of replicas that divide
        the experts (None: an independent replica); one that reports another place fails its start."""
        super().__init__(config, stall_timeout_s=stall_timeout_s)
        self.address = address
        self._authkey = authkey
        self.group_place = group_place

    async def start(self) -> Ready:
        ready = await super().start()
        place = (ready.data_parallel_rank, ready.data_parallel_size)
        if self.group_place is not None and place != self.group_place:
            await self.shutdown()
            rank, size = self.group_place
            raise EngineError(f"{self.describe()} is data-parallel rank {place[0]} of {place[1]}, but this gateway "
                              f"needs it as rank {rank} of {size} of its expert group: start it with "
                              f"--enable-expert-parallel --data-parallel-size {size} --data-parallel-rank {rank}")
        return ready

    def describe(self) -> str:
        return f"the engine at {self.address[0]}:{self.address[1]}"

    async def _open(self) -> tuple[Connection, Connection]:
        conn = await self._loop.run_in_executor(None, self._connect)
        return conn, conn

    def _connect(self) -> Connection:
        """Connect and authenticate within ``CONNECT_TIMEOUT_S``: a listener that accepts TCP but never
        answers (a frozen engine: the kernel still completes the handshake) fails this start instead of
        holding the supervisor forever, as ``multiprocessing.connection.Client`` would."""
        try:
            sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT_S)
        except OSError as e:  # refused, unreachable
            raise EngineError(f"cannot reach {self.describe()}: {e.strerror or e}") from None
        sock.settimeout(None)  # Connection reads the descriptor in blocking mode
        conn = Connection(sock.detach())
        timer = threading.Timer(CONNECT_TIMEOUT_S, _shut, (conn,))
        timer.start()
        try:
            answer_challenge(conn, self._authkey)  # what Client does, in this order
            deliver_challenge(conn, self._authkey)
        except Exception as e:  # a wrong key (AuthenticationError), or cut by the timer (EOFError)
            conn.close()
            raise EngineError(f"cannot connect to {self.describe()}: {type(e).__name__}: {e or 'no answer'}") from None
        finally:
            timer.cancel()
        enable_keepalive(conn)
        return conn

    def _cut_off(self) -> None:
        _shut(self._replies)  # the reader's recv ends

    async def _close(self, replies: Connection) -> None:
        # The engine stays up for the next gateway. Shut the socket down, not only close it: our reader thread
        # is blocked reading it, which keeps it open (no FIN) until the engine's side closes, so the server
        # would not see this gateway leave until its engine had ended.
        _shut(replies)
