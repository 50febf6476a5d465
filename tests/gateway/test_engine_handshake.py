"""The engine port's handshake: a silent or half-sent connection never holds a gateway up; keys are checked.

Regression: the stdlib login challenge ran inline in the engine server's only accept loop with no deadline,
so one idle TCP connection (no key needed) kept every gateway from attaching.
"""

import socket
import struct
import threading
import time
from multiprocessing.connection import AuthenticationError, Connection

import pytest

from engine.core.config import EngineConfig
from engine.serving.async_engine import EngineError
from engine.serving.engine_server import serve_engine
from engine.serving.handshake import authenticate
from engine.serving.remote_engine import RemoteEngine

pytestmark = pytest.mark.timeout(60)

KEY = b"handshake-test-key-0123456789"


def _pair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


def _both(key_a: bytes, key_b: bytes) -> tuple[BaseException | None, BaseException | None]:
    """Run both sides of one handshake; each side's exception (or None)."""
    listening, connecting = _pair()
    errors: list[BaseException | None] = [None, None]

    def side(i: int, conn: Connection, key: bytes) -> None:
        try:
            authenticate(conn, key, listening_side=(i == 0), timeout_s=5)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors[i] = e

    threads = [threading.Thread(target=side, args=(0, listening, key_a)),
               threading.Thread(target=side, args=(1, connecting, key_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    listening.close()
    connecting.close()
    return errors[0], errors[1]


def test_the_same_key_passes_and_another_key_fails_both_sides():
    assert _both(KEY, KEY) == (None, None)
    listening_error, connecting_error = _both(KEY, KEY + b"x")
    assert isinstance(listening_error, AuthenticationError)
    assert isinstance(connecting_error, AuthenticationError)


def test_a_silent_peer_is_cut_at_the_deadline():
    listening, silent = _pair()
    started = time.monotonic()
    with pytest.raises((EOFError, OSError)):
        authenticate(listening, KEY, listening_side=True, timeout_s=0.5)
    assert time.monotonic() - started < 3
    silent.close()
    listening.close()


@pytest.fixture(scope="module")
def engine_port() -> int:
    """An engine server on loopback (a daemon thread; no engine process is started: nothing attaches)."""
    bound: list[tuple[str, int]] = []
    ready = threading.Event()

    def listening(address) -> None:
        bound.append(address)
        ready.set()

    config = EngineConfig(model="unused", cpu_threads=1)
    threading.Thread(target=serve_engine, args=(config, ("127.0.0.1", 0), KEY, listening), daemon=True).start()
    assert ready.wait(10)
    return bound[0][1]


def _greeted(port: int, key: bytes = KEY) -> Connection:
    return RemoteEngine(EngineConfig(model="unused"), ("127.0.0.1", port), key)._connect()


def test_idle_and_half_sent_connections_do_not_keep_a_gateway_out(engine_port):
    silent = socket.create_connection(("127.0.0.1", engine_port))
    half = socket.create_connection(("127.0.0.1", engine_port))
    half.recv(4096)  # the challenge
    half.sendall(struct.pack("!i", 32) + b"\x00" * 5)  # a frame header promising 32 bytes, then 5 of them
    started = time.monotonic()
    conn = _greeted(engine_port)
    took = time.monotonic() - started
    try:
        assert took < 2.0, f"the gateway waited {took:.1f} s behind idle connections"
    finally:
        conn.close()  # never attached: the server starts nothing and takes the next gateway
        silent.close()
        half.close()


def test_a_wrong_key_is_refused_and_the_next_gateway_is_served(engine_port):
    with pytest.raises(EngineError, match="AuthenticationError"):
        _greeted(engine_port, KEY + b"wrong")
    deadline = time.monotonic() + 5
    while True:  # the refused connection's turn ends as the server notices it left
        try:
            conn = _greeted(engine_port)
            break
        except EngineError as e:
            if "serving another gateway" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    conn.close()
