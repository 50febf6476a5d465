"""An engine that serves a gateway on another machine: ``moegate engine --listen HOST:PORT``.

The gateway reaches it over TCP with ``multiprocessing.connection``'s
``Connection`` (the same API as the local pipes, after a mutual
challenge-response on a shared key: ``engine.serving.handshake``), and the
engine loop is ``run_engine_process`` unchanged, with one duplex connection for both directions. One gateway at a time: a second one is
told so (``Fatal``) and closed at once, so its start fails instead of hanging.
Before anything is built the engine says where it belongs (``Hello``: its place
in a group of replicas that divide the experts, and where that group meets);
the gateway attaches it only if that is the place it needs it in.
Each connection's engine runs in a process of its own, which ends with the
connection (the gateway stopped, the network broke, or the engine failed) or
with the server: the gateway's supervisor reconnects a replica it lost, and
the new engine starts in a fresh process from an empty cache, as a restarted
local replica does (an engine split over several ranks, or one rank of
replicas sharing their experts, meets its peers again from scratch).

Each connection is authenticated on a thread of its own, under a deadline, at most
``MAX_HANDSHAKES`` at a time: a peer that connects and says nothing (no key needed
for that) costs one thread for ``HANDSHAKE_TIMEOUT_S`` and never holds up a gateway.

TCP keepalive (probes after 5 s idle, every 2 s, 3 lost) turns a peer that
stopped answering at the network level into a closed connection within about
11 s on either side, so a replica behind a dead link leaves the rotation.
"""

import dataclasses
import logging
import multiprocessing
import os
import queue
import select
import socket
import threading
import time
from multiprocessing.connection import Connection

import msgspec

from engine.core.config import EngineConfig
from engine.serving.engine_process import run_engine_process
from engine.processes.process_start import start_process
from engine.serving.handshake import authenticate
from engine.serving.protocol import PROTOCOL_VERSION, Attach, Fatal, Hello, attach_decoder, encoder

logger = logging.getLogger(__name__)

AUTHKEY_ENV = "MOEGATE_ENGINE_KEY"
WIND_DOWN_S = 30.0  # how long an engine may take to end once its gateway has left
# How long a gateway's Attach may be awaited once its turn has come: it checks every engine it needs first.
ATTACH_TIMEOUT_S = 60.0
MAX_HANDSHAKES = 16  # connections being authenticated at once; more are closed unanswered


def enable_keepalive(conn: Connection) -> None:
    """Probe an idle TCP connection so that a silent peer closes it (see the module's docstring)."""
    sock = socket.socket(fileno=conn.fileno())  # the same socket, not a copy: options apply to conn
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, name):  # Linux; elsewhere the system's defaults apply
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    finally:
        sock.detach()  # conn keeps the descriptor


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as an address; ValueError naming what is wrong."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"an engine address is HOST:PORT, got {text!r}")
    return host, int(port)


def serve_engine(config: EngineConfig, address: tuple[str, int], authkey: bytes, on_listening=None,
                 process_main=run_engine_process) -> None:
    """Serve the engine to one gateway at a time, forever. ``on_listening((host, port))`` is called once
    the socket is bound (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    listener = socket.create_server(address, family=family, backlog=64)
    if on_listening is not None:
        on_listening(listener.getsockname()[:2])
    arrivals: queue.Queue[Connection] = queue.Queue()
    lock = threading.Lock()
    busy = [False]
    serving: list = []  # (engine process, gateway socket) of the connection being served, once started
    handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)

    def admit(conn: Connection, peer) -> None:
        """Authenticate one connection, then greet it or tell it another gateway is being served."""
        try:
            try:
                authenticate(conn, authkey, listening_side=True)
            except Exception as e:  # a wrong key (AuthenticationError), silent past the deadline, or gone
                logger.warning("refused a connection from %s: %s: %s", peer[0], type(e).__name__, e or "no answer")
                conn.close()
                return
        finally:
            handshakes.release()
        with lock:
            # Busy, unless the gateway being served has just gone and the main loop has not yet seen it
            # (a gateway reconnecting at once must not be told another one is being served): then this one
            # takes its turn (``serving`` emptied: the main loop leaves ``busy`` set for it).
            if busy[0]:
                if not (serving and _gateway_gone(*serving, wait=False)):
                    try:
                        conn.send_bytes(encoder.encode(Fatal("this engine is serving another gateway")))
                    except OSError:
                        pass
                    finally:
                        conn.close()
                    return
                serving.clear()
            busy[0] = True
        # Said at once, even while the last gateway's engine is still ending (up to WIND_DOWN_S): the
        # gateway decides with this whether to attach, within its connect timeout.
        if _greet(conn, config):
            arrivals.put(conn)
        else:
            conn.close()
            with lock:
                busy[0] = False

    threading.Thread(target=_accept_forever, args=(listener, handshakes, admit), name="moegate-engine-accept",
                     daemon=True).start()
    while True:
        conn = arrivals.get()
        enable_keepalive(conn)
        attach = _attached(conn)
        if attach is None:
            conn.close()
            with lock:
                busy[0] = False
            continue
        logger.info("serving a gateway")
        # Each gateway gets an engine in a fresh process, as a local replica does: whatever a failed or
        # dropped engine leaves (process groups, device memory) ends with its process, which also ends the
        # follower ranks it started.
        gateway = os.dup(conn.fileno())  # watched, never read: tells when the gateway's side has closed
        try:
            # The gateway's deployment: the disk tier keeps only its blocks (engine.kv_tiers.disk_dir).
            served = dataclasses.replace(config, deployment_id=attach.deployment_id)
            engine = start_process(_serve_one_gateway, (process_main, served, conn), "moegate-engine")
        finally:
            conn.close()  # the engine process holds its own copy
        with lock:
            serving[:] = [engine, gateway]
        try:
            _wind_down(engine, gateway, lock, busy, serving)
        finally:
            os.close(gateway)


def _accept_forever(listener: socket.socket, handshakes: threading.BoundedSemaphore, admit) -> None:
    """Accept connections and hand each to ``admit(conn, peer)`` on its own thread, at most ``MAX_HANDSHAKES``
    authenticating at once."""
    while True:
        try:
            sock, peer = listener.accept()
        except OSError as e:  # out of descriptors, say: keep serving the connections already made
            logger.warning("accept failed: %s", e)
            time.sleep(0.1)
            continue
        if not handshakes.acquire(blocking=False):  # a flood of connections: refuse the excess unanswered
            logger.warning("refused a connection from %s: %d others are authenticating", peer[0], MAX_HANDSHAKES)
            sock.close()
            continue
        conn = Connection(sock.detach())  # blocking descriptor: accept() sockets have no timeout
        threading.Thread(target=admit, args=(conn, peer), name="moegate-engine-handshake", daemon=True).start()


def _wind_down(engine, gateway: int, lock: threading.Lock, busy: list[bool], serving: list) -> None:
    """Wait until the served gateway leaves or its engine ends, free the turn (unless the next gateway has
    taken it already), then give the engine ``WIND_DOWN_S`` to end before killing it."""
    _gateway_gone(engine, gateway, wait=True)
    with lock:
        if serving:  # no gateway has taken its turn yet: the next may connect while this engine winds down
            busy[0] = False
            serving.clear()
    logger.info("the gateway has left or its engine has ended; serving the next gateway once it has")
    engine.join(WIND_DOWN_S)
    if engine.is_alive():  # stuck (in a collective, say): the next gateway gets a fresh one now
        logger.warning("the engine did not end within %g s of its gateway leaving; killed", WIND_DOWN_S)
        engine.kill()
        engine.join()


def _greet(conn: Connection, config: EngineConfig) -> bool:
    """Tell a gateway that just connected this engine's place (``Hello``), before anything is built; False if it
    is gone already."""
    try:
        conn.send_bytes(encoder.encode(Hello(PROTOCOL_VERSION, config.data_parallel_rank, config.data_parallel_size,
                                             config.distributed_init_method)))
        return True
    except OSError as e:
        logger.warning("a gateway left as it connected: %s", e)
        return False


def _attached(conn: Connection) -> Attach | None:
    """The gateway's ``Attach`` answer to ``Hello``, or None. One that needs this engine elsewhere closes the
    connection and says why on its side: nothing was started, so a misplaced engine is refused at once instead
    of after its rendezvous timed out."""
    try:
        if conn.poll(ATTACH_TIMEOUT_S):
            return attach_decoder.decode(conn.recv_bytes())
        logger.warning("the gateway did not attach this engine within %g s", ATTACH_TIMEOUT_S)
    except (EOFError, OSError):
        logger.warning("the gateway closed the connection without attaching this engine (its log says why)")
    except msgspec.DecodeError as e:
        logger.warning("the gateway answered with something other than Attach: %s", e)
    return None


def _gateway_gone(engine: multiprocessing.process.BaseProcess, gateway: int, wait: bool) -> bool:
    """Whether the gateway's side of the connection has closed (Shutdown, or gone) or the engine process has
    ended; with ``wait``, returns once one has."""
    poller = select.poll()
    poller.register(gateway, select.POLLRDHUP | select.POLLHUP)
    poller.register(engine.sentinel, select.POLLIN | select.POLLHUP)
    while not (events := poller.poll(None if wait else 0)) and wait:
        pass
    return bool(events)


def _serve_one_gateway(process_main, config: EngineConfig, conn: Connection) -> None:
    """The engine process of one gateway's connection; it ends with the connection, or with the server (the
    engine process watches its parent: ``engine.processes.parent_watch``)."""
    try:
        process_main(config, conn, conn)
    except (EOFError, OSError) as e:
        logger.warning("the gateway went away (%s); waiting for the next one", type(e).__name__)
    finally:
        conn.close()
