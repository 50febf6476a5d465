"""The operator's tokens (metrics, admin) are checked against whatever bytes a client sends: a header that is not
UTF-8 (aiohttp hands such bytes on as surrogates) is a 401 like any wrong token, never a 500. Raw bytes over a
socket to a real aiohttp server with the gateway's error middleware."""

import asyncio
import json
import random

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.auth import require_token
from gateway.errors import error_middleware


async def _answer(port: int, authorization: bytes) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: " + authorization
                 + b"\r\nConnection: close\r\n\r\n")
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


@pytest.mark.parametrize("what", ["metrics", "admin"])
def test_a_token_header_that_is_not_utf8_is_a_401(what):
    token = f"tok{random.randrange(10**9)}"
    raw = bytes(random.randrange(0x80, 0x100) for _ in range(random.randint(1, 8)))

    async def guarded(request: web.Request) -> web.Response:
        require_token(request, token, what)
        return web.json_response({"ok": True})

    async def scenario():
        app = web.Application(middlewares=[error_middleware])
        app.router.add_get("/metrics", guarded)
        async with TestServer(app, host="127.0.0.1") as server:
            answers = [await _answer(server.port, b"Bearer " + given)
                       for given in (raw, token.encode() + raw, b"\xed\xb3\xbf" + token.encode(), b"\xff")]
            return answers, await _answer(server.port, b"Bearer " + token.encode())

    answers, right = asyncio.run(scenario())
    for status, body in answers:
        assert status == 401 and body["error"]["code"] == f"invalid_{what}_token", body
    assert right == (200, {"ok": True})
