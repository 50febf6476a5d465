"""Writing to an engine's request pipe from a thread of its own, so that the gateway's event loop never waits
on it.

A pipe holds 64 KB on Linux. An engine process that stops reading (frozen: a stopped process, a stalled host
behind a socket) fills it with a few requests' token ids, and the next write waits until the engine reads
again: written on the event loop, that wait held every request of every engine (measured: the whole wait, 3 s
in the test, with six long prompts sent to a stopped engine). Here the event loop only queues the encoded
message; the writer thread sends the queue in order, one message at a time. A write that fails (the engine is
gone) ends the thread: the reader of the engine's replies sees its end and fails the requests in flight.
"""

import logging
import queue
import threading
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)

_FINISH = object()  # after what was queued before it: end the thread


class PipeWriter:
    """Sends bytes on ``conn`` in the order given, from its own thread. The caller closes ``conn`` (after
    ``finish``: the thread may still be blocked writing to a frozen engine, until that engine is ended)."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, data: bytes) -> None:
        """Queue one message (never blocks)."""
        self._queue.put(data)

    def finish(self) -> None:
        """End the thread once what was queued has been written (or could not be)."""
        self._queue.put(_FINISH)

    def join(self, timeout_s: float) -> bool:
        """Wait (blocking) up to ``timeout_s`` for the thread to end after ``finish``; whether it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (data := self._queue.get()) is not _FINISH:
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError) as e:  # the engine is gone (or the connection closed)
                logger.debug("request pipe: %s", e)
                return
