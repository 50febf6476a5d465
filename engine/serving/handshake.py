"""Mutual challenge-response on the shared engine key, under a deadline, for the engine's TCP port.

Both sides prove they hold ``MOEGATE_ENGINE_KEY`` without sending it: each sends
a random challenge and checks the other's HMAC-SHA256 of it with a constant-time
comparison (``hmac.compare_digest``). The stdlib's ``multiprocessing.connection``
handshake compares with ``==`` over HMAC-MD5 and waits forever for a silent
peer; here the whole exchange has a deadline, after which the socket is shut
down (a peer that sent half a frame cannot hold a reader either).
"""

import hmac
import os
import socket
import threading
from multiprocessing.connection import AuthenticationError, Connection

CHALLENGE = b"#MOEGATE-CHALLENGE-SHA256#"
WELCOME = b"#WELCOME#"
FAILURE = b"#FAILURE#"
NONCE_BYTES = 32
MAX_FRAME = 256  # a longer answer is refused unread
HANDSHAKE_TIMEOUT_S = 10.0


def shut(conn: Connection) -> None:
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


def _digest(authkey: bytes, nonce: bytes) -> bytes:
    return hmac.new(authkey, nonce, "sha256").digest()


def _recv(conn: Connection) -> bytes:
    # Connection.recv_bytes raises OSError for an over-long frame without reading it
    return conn.recv_bytes(MAX_FRAME)


def _check_peer(conn: Connection, authkey: bytes) -> None:
    nonce = os.urandom(NONCE_BYTES)
    conn.send_bytes(CHALLENGE + nonce)
    if hmac.compare_digest(_recv(conn), _digest(authkey, nonce)):
        conn.send_bytes(WELCOME)
        return
    conn.send_bytes(FAILURE)
    raise AuthenticationError("the peer's digest was wrong (another MOEGATE_ENGINE_KEY)")


def _prove(conn: Connection, authkey: bytes) -> None:
    challenge = _recv(conn)
    if not challenge.startswith(CHALLENGE) or len(challenge) != len(CHALLENGE) + NONCE_BYTES:
        raise AuthenticationError("the peer does not speak moegate's handshake (another moegate version?)")
    conn.send_bytes(_digest(authkey, challenge[len(CHALLENGE):]))
    if _recv(conn) != WELCOME:
        raise AuthenticationError("the peer refused our digest (another MOEGATE_ENGINE_KEY)")


def authenticate(conn: Connection, authkey: bytes, *, listening_side: bool,
                 timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Run both challenges (the listening side checks first, the connecting side proves first).

    Raises AuthenticationError for a wrong key or a foreign protocol, EOFError or OSError for a peer
    that left or did not finish within ``timeout_s`` (its socket is then shut down).
    """
    timer = threading.Timer(timeout_s, shut, (conn,))
    timer.daemon = True
    timer.start()
    try:
        if listening_side:
            _check_peer(conn, authkey)
            _prove(conn, authkey)
        else:
            _prove(conn, authkey)
            _check_peer(conn, authkey)
    finally:
        timer.cancel()
