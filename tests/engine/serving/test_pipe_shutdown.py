"""Stopping an engine while its request pipe is busy: the writer thread is never left writing on a closed
connection, and a message racing the stop is written before Shutdown or refused, never lost.

Both interleavings are forced: the first by a write that cannot end until the test lets it (a message larger than
the pipe, of which the test reads one byte: the thread is then inside that write); the second by a message whose
encoding waits, with the send lock held, until Shutdown is encoded or a bounded time has passed."""

import asyncio
import multiprocessing
import os
import threading

import pytest

from engine.core.config import EngineConfig
from engine.serving import async_engine as async_engine_module
from engine.serving.async_engine import AsyncEngine, EngineError
from engine.serving.pipe_writer import PipeClosedError, PipeWriter
from engine.serving.protocol import AbortRequest, Shutdown, to_engine_decoder

RACE_WAIT_S = 1.0


def _engine_on_pipes(monkeypatch) -> tuple[AsyncEngine, multiprocessing.connection.Connection]:
    """An AsyncEngine whose requests go to a pipe the test reads (no engine process); the pipe's read end."""
    engine = AsyncEngine(EngineConfig(model="unused", device="cpu"))
    theirs, ours = multiprocessing.Pipe(duplex=False)
    replies, _replies_in = multiprocessing.Pipe(duplex=False)
    engine._requests = PipeWriter(ours, "test-writer")
    engine._replies = replies
    monkeypatch.setattr(async_engine_module, "SHUTDOWN_WRITE_S", 0.1)
    return engine, theirs


@pytest.mark.timeout(20)
def test_stop_while_a_write_is_blocked_closes_the_pipe_only_after_the_write(monkeypatch):
    thread_errors = []  # set here, in the test's call: pytest sets its own hook around it
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    engine, theirs = _engine_on_pipes(monkeypatch)
    writer = engine._requests
    writer.send(os.urandom(1 << 20))  # four times a Linux pipe's 64 KB: this write waits for the reader
    assert len(os.read(theirs.fileno(), 1)) == 1  # the thread is inside that write now

    async def stop():
        engine._loop = asyncio.get_running_loop()
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(stop(), 10))  # its Shutdown queued behind the blocked write
    assert not writer.conn.closed, "the connection was closed under a write in progress"
    with pytest.raises(PipeClosedError):
        writer.send(b"late")
    with pytest.raises(EngineError):
        engine._send(AbortRequest("r"))
    theirs.close()  # the engine is gone: the blocked write fails
    assert writer.join(10), "the writer thread did not end"
    assert writer.conn.closed  # by the thread, once its write ended
    assert thread_errors == [], [(e.exc_type, e.exc_value) for e in thread_errors]


@pytest.mark.timeout(20)
def test_a_message_queued_while_the_engine_stops_goes_before_shutdown_or_is_refused(monkeypatch):
    engine, theirs = _engine_on_pipes(monkeypatch)
    encode = async_engine_module.encoder.encode
    inside, shutdown_encoded = threading.Event(), threading.Event()

    class Encoder:
        def encode(self, msg):
            if isinstance(msg, AbortRequest):  # another thread's message: paused with the send lock held
                inside.set()
                shutdown_encoded.wait(RACE_WAIT_S)  # the stop may not take the lock meanwhile: then it times out
            if isinstance(msg, Shutdown):
                shutdown_encoded.set()
            return encode(msg)

    monkeypatch.setattr(async_engine_module, "encoder", Encoder())
    sent: list = []

    def other_thread():
        try:
            engine._send(AbortRequest("racing"))
            sent.append("queued")
        except EngineError:
            sent.append("refused")

    async def stop():
        engine._loop = asyncio.get_running_loop()
        thread = threading.Thread(target=other_thread)
        thread.start()
        assert await asyncio.to_thread(inside.wait, 10)
        await engine.shutdown()
        await asyncio.to_thread(thread.join, 10)

    asyncio.run(asyncio.wait_for(stop(), 10))
    received = []
    while theirs.poll(1):
        try:
            received.append(to_engine_decoder.decode(theirs.recv_bytes()))
        except EOFError:
            break
    assert sent == ["queued"], sent
    assert received == [AbortRequest("racing"), Shutdown()], received  # the racing message, then Shutdown
