"""The async client of the engine process: what the gateway talks to."""

import asyncio
import itertools
import logging
import multiprocessing
import threading
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.stats import SchedulerStats
from engine.engine_process import run_engine_process
from engine.protocol import (
    AbortRequest, AddRequest, ChatTurn, Delta, Fatal, Ready, RequestRejected, SamplingSpec, Shutdown, StepOutputs,
    encoder, from_engine_decoder,
)

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine process failed to start or died."""


class RequestRejectedError(ValueError):
    """The engine refused a request; the message says why, for the user."""


class AsyncEngine:
    """Runs the engine in its own process and streams per-request deltas to asyncio callers.

    ``generate`` yields ``Delta``s until the request finishes; cancelling the
    consumer (a client that went away) aborts the request in the engine.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.info: Ready | None = None
        self.stats: SchedulerStats | None = None  # the engine's latest step statistics
        self.messages_received = 0  # from the engine process (each woke this process twice)
        self._queues: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._process = None
        self._requests = None  # our end of the pipe to the engine process
        self._replies = None  # our end of the pipe from it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_lock = threading.Lock()
        self.dead: str | None = None

    async def restart(self) -> Ready:
        """Start a fresh engine process after the old one died; requests in flight have already failed."""
        await self.shutdown()
        self.dead = None
        self.stats = None
        return await self.start()

    async def start(self) -> Ready:
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads or CUDA state
        # Two one-way pipes, not one duplex socket: on a Unix socket pair the engine reading our requests
        # wakes our reader thread blocked on the same socket (a wakeup per request read, ten per message
        # received, measured), and every wakeup takes a core the engine's threads were using.
        requests_in, requests_out = ctx.Pipe(duplex=False)
        replies_in, replies_out = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=run_engine_process, args=(self.config, requests_in, replies_out),
                                    name="moegate-engine", daemon=True)
        self._process.start()
        requests_in.close()
        replies_out.close()  # so the reader sees EOF when the engine process dies
        self._requests, self._replies = requests_out, replies_in
        first = await self._loop.run_in_executor(None, self._recv)
        if isinstance(first, Fatal) or first is None:
            self._process.join(timeout=5)
            raise EngineError(first.message if first else "the engine process exited during start-up")
        self.info = first
        threading.Thread(target=self._reader, name="moegate-engine-reader", daemon=True).start()
        return first

    def _recv(self):
        try:
            return from_engine_decoder.decode(self._replies.recv_bytes())
        except (EOFError, OSError):
            return None

    def _reader(self) -> None:
        conn = self._replies  # this process's pipe; a restart makes a new one and a new reader
        while True:
            try:
                msg = from_engine_decoder.decode(conn.recv_bytes())
            except (EOFError, OSError):
                self._loop.call_soon_threadsafe(self._fail_all, "the engine process stopped", conn)
                return
            self._loop.call_soon_threadsafe(self._dispatch, msg)

    def _dispatch(self, msg) -> None:
        self.messages_received += 1
        if isinstance(msg, StepOutputs):
            if msg.stats is not None:
                self.stats = msg.stats
            for delta in msg.deltas:
                queue = self._queues.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)
        elif isinstance(msg, RequestRejected):
            queue = self._queues.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(RequestRejectedError(msg.message))

    def _fail_all(self, reason: str, conn) -> None:
        if self._process is None or conn is not self._replies:
            return  # an orderly shutdown (or a restart) closed this pipe
        self.dead = reason
        for queue in self._queues.values():
            queue.put_nowait(EngineError(reason))

    def _send(self, msg) -> None:
        with self._send_lock:
            try:
                self._requests.send_bytes(encoder.encode(msg))
            except OSError as e:  # the process died between our check and the write
                raise EngineError(f"the engine process stopped ({e})") from None

    async def generate(
        self,
        prompt: str | list[int],
        sampling: SamplingSpec,
        request_id: str | None = None,
        cache_salt: str | None = None,
        messages: list[ChatTurn] | None = None,
        priority: int = 1,
        tenant: str = "default",
        weight: float = 1.0,
        preemptible: bool = True,
        background: bool = False,
        stream: bool = True,
    ) -> AsyncIterator[Delta]:
        """Stream one request's deltas; RequestRejectedError if the engine refuses it, EngineError if it died.

        ``stream=False``: a single delta when the request finishes, with the whole output in it.
        """
        if self.dead:
            raise EngineError(self.dead)
        request_id = request_id or f"req-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            self._send(AddRequest(request_id, prompt, sampling, cache_salt, messages, priority, tenant, weight, preemptible,
                                  background, stream))
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            del self._queues[request_id]
            if not finished and not self.dead:
                self._send(AbortRequest(request_id))

    async def shutdown(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.is_alive():
            try:
                with self._send_lock:
                    self._requests.send_bytes(encoder.encode(Shutdown()))
            except OSError:
                pass
            await self._loop.run_in_executor(None, process.join, 10)
        if process.is_alive():
            process.kill()
            await self._loop.run_in_executor(None, process.join, 5)
        self._requests.close()
        self._replies.close()
