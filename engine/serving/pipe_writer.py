"""Writing to an engine's request pipe from a thread of its own, so that the gateway's event loop never waits
on it.

A pipe holds 64 KB on Linux. An engine process that stops reading (frozen: a stopped process, a stalled host
behind a socket) fills it with a few requests' token ids, and the next write waits until the engine reads
again: written on the event loop, that wait held every request of every engine (measured: the whole wait, 3 s
in the test, with six long prompts sent to a stopped engine). Here the event loop only queues the encoded
message; the writer thread sends the queue in order, one message at a time. A write that fails (the engine is
gone) ends the thread: the reader of the engine's replies sees its end and fails the requests in flight.

The connection is closed once no write can be under way on it (``close``): a descriptor closed while the thread
is inside a write would make that write's next part use a closed connection (a TypeError from deep inside
``multiprocessing``) or, worse, a descriptor number the process has since given to another file.
"""

import logging
import queue
import threading
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)

_FINISH = object()  # after what was queued before it: end the thread


class PipeClosedError(RuntimeError):
    """A message given to a ``PipeWriter`` after ``finish`` or ``close``: it would never be written."""


class PipeWriter:
    """Sends bytes on ``conn`` in the order given, from its own thread; ``close`` closes ``conn`` (after
    ``finish``: the thread may still be blocked writing to a frozen engine, until that engine is ended)."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders send/finish/close against each other and the thread's end
        self._finished = False  # no more messages: _FINISH is queued
        self._close_on_end = False  # ``close`` was called while the thread still ran: it closes ``conn``
        self._ended = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, data: bytes) -> None:
        """Queue one message (never blocks); PipeClosedError after ``finish`` or ``close``."""
        with self._lock:
            if self._finished:
                raise PipeClosedError("the engine's request pipe is closed")
            self._queue.put(data)

    def finish(self) -> None:
        """End the thread once what was queued has been written (or could not be); later sends are refused."""
        with self._lock:
            if not self._finished:
                self._finished = True
                self._queue.put(_FINISH)

    def join(self, timeout_s: float) -> bool:
        """Wait (blocking) up to ``timeout_s`` for the thread to end after ``finish``; whether it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def close(self) -> None:
        """``finish``, and close ``conn`` now if the thread has ended, else as soon as its write in progress ends
        (it fails once the engine is gone); never blocks."""
        self.finish()
        with self._lock:
            if not self._ended:
                self._close_on_end = True
                return
        self.conn.close()

    def _run(self) -> None:
        try:
            while (data := self._queue.get()) is not _FINISH:
                try:
                    self.conn.send_bytes(data)
                except (OSError, ValueError) as e:  # the engine is gone (or the connection closed)
                    logger.debug("request pipe: %s", e)
                    return
        finally:
            with self._lock:
                self._ended = True
                close = self._close_on_end
            if close:
                self.conn.close()
