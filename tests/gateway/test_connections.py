"""Idle, half-sent and excess connections are closed by the server: file descriptors come back, and
the server keeps answering. A real server on loopback with short timeouts."""

import asyncio
import os
import random
import socket
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from benchmarks.instant_engine import InstantEngine
from gateway.app import create_app
from gateway.config import GatewayConfig
from tenants.migrate import upgrade
from tests.gateway.tenant_keys import new_tenant_key


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _read_until_closed(sock: socket.socket, deadline: float) -> bytes | None:
    """What the server sent on ``sock`` once it closed it (a read returns EOF or a reset); None if it is still
    open at ``deadline``."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    received = b""
    while time.monotonic() < deadline:
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 0.5)
        except TimeoutError:
            continue
        except ConnectionError:
            return received
        if not data:
            return received
        received += data
    return None


@pytest.mark.timeout(120)
def test_idle_half_sent_and_excess_connections_are_closed(tmp_path):
    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)
    config = GatewayConfig(database_url=url, data_dir=str(tmp_path / "data"), keepalive_timeout_s=1.0,
                           body_timeout_s=1.0, max_connections=500)
    app = create_app(config, InstantEngine())

    async def scenario():
        key = await new_tenant_key(url)
        server = TestServer(app, host="127.0.0.1")
        # As `moegate serve` passes it to aiohttp (TestServer's constructor would drop it).
        await server.start_server(keepalive_timeout=config.keepalive_timeout_s)
        async with server:
            loop = asyncio.get_running_loop()
            baseline = _open_fds()
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                    "Content-Type: application/json\r\nContent-Length: 100\r\n").encode()
            socks = []
            for i in range(500):  # 300 idle, 100 with half a header, 100 with headers and half a body
                s = socket.socket()
                s.setblocking(False)
                await loop.sock_connect(s, ("127.0.0.1", server.port))
                if 300 <= i < 400:
                    await loop.sock_sendall(s, head[: random.randrange(5, len(head))])
                elif i >= 400:
                    await loop.sock_sendall(s, head + b"\r\n" + b'{"prompt": "hel')
                socks.append(s)
            await asyncio.sleep(0.2)
            # Over the cap: closed at once.
            extra = []
            for _ in range(220):
                s = socket.socket()
                s.setblocking(False)
                await loop.sock_connect(s, ("127.0.0.1", server.port))
                extra.append(s)
            deadline = time.monotonic() + 5
            closed_extra = await asyncio.gather(*(_read_until_closed(s, deadline) for s in extra))
            assert None not in closed_extra, closed_extra.count(None)  # past 500 open: closed at once
            # Every idle or half-sent connection is closed by the server within the timeouts (1 s each, and
            # slack for a loaded machine): a stalled body gets its 408 and its connection is closed then,
            # not after aiohttp's 10 s lingering read of the rest of the body.
            deadline = time.monotonic() + 8
            closed = await asyncio.gather(*(_read_until_closed(s, deadline) for s in socks))
            assert None not in closed, f"{closed.count(None)} connections still open"
            stalled = [reply for reply in closed[400:] if not reply.startswith(b"HTTP/1.1 408 ")]
            assert not stalled, stalled[:1]
            for s in socks + extra:
                s.close()
            await asyncio.sleep(0.5)
            assert _open_fds() <= baseline + 5, (_open_fds(), baseline)
            # Still serving.
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
                async with http.post(server.make_url("/v1/completions"),
                                     json={"model": "instant", "prompt": "hi", "max_tokens": 2}) as r:
                    assert r.status == 200

    asyncio.run(scenario())
