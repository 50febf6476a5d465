"""Hostile bodies and headers get a 4xx naming what is wrong, never a 500, and leave the engine serving."""

import asyncio
import json
import logging
import random
import socket

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from engine.serving.async_engine import AsyncEngine
from engine.core.config import EngineConfig
from engine.loading.demo_model import write_demo_model
from gateway.app import create_app
from gateway.config import GatewayConfig
from tenants.migrate import upgrade
from tests.gateway.tenant_keys import new_tenant_key


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("demo"))
    write_demo_model(path, seed=random.randrange(1000))
    return path


def _raw_request(port: int, head: bytes, body: bytes = b"") -> bytes:
    """Send bytes as they are (clients refuse to send some of these) and read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + body)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


BIG = 2**70


@pytest.mark.timeout(300)
def test_hostile_bodies_and_headers_are_4xx(demo_dir, tmp_path, caplog):
    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)
    engine = AsyncEngine(EngineConfig(model=demo_dir, num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=64))
    app = create_app(GatewayConfig(served_model_name="demo", database_url=url, data_dir=str(tmp_path / "data")), engine)

    async def scenario():
        key = await new_tenant_key(url)
        auth = {"Authorization": f"Bearer {key}"}
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession(headers=auth) as http:
            pid = engine._process.pid

            async def post(path: str, data: bytes) -> tuple[int, dict]:
                async with http.post(server.make_url(path), data=data,
                                     headers={"Content-Type": "application/json"}) as r:
                    return r.status, await r.json(content_type=None)

            cases = [  # (path, body, the field the error must name or None)
                ("/v1/completions", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}', None),
                ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', None),
                ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": BIG}).encode(), "max_tokens"),
                ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2, "top_k": BIG}).encode(), "top_k"),
                ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2, "seed": 2**64}).encode(), "seed"),
                ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2, "seed": -(2**64)}).encode(), "seed"),
                ("/v1/completions", json.dumps({"prompt": [1, BIG], "max_tokens": 2}).encode(), "prompt"),
                ("/v1/completions", json.dumps({"prompt": [1, -5], "max_tokens": 2}).encode(), "prompt"),
                ("/v1/completions", json.dumps({"prompt": [1, 10**7], "max_tokens": 2}).encode(), "prompt"),
                ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None),
                ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
                ("/v1/chat/completions", b'{"messages": ' + b"{" * 50_000, None),
                ("/v1/batches", b"[" * 100_000 + b"]" * 100_000, None),
            ]
            for path, body, param in cases:
                status, answer = await post(path, body)
                assert status == 400, (path, body[:80], status, answer)
                assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
                if param is not None:
                    assert (answer["error"]["param"] or "").startswith(param), (body[:80], answer)

            # A body its Content-Encoding does not decode: a 400 that says so, on JSON routes and uploads alike.
            upload = aiohttp.FormData()
            upload.add_field("purpose", "batch")
            upload.add_field("file", b"{}", filename="in.jsonl")
            for path, data in [("/v1/completions", b"not gzip at all"), ("/v1/batches", b"\x1f\x8b not gzip either"),
                               ("/v1/files", upload)]:
                async with http.post(server.make_url(path), data=data, headers={"Content-Encoding": "gzip"}) as r:
                    answer = await r.json(content_type=None)
                    assert r.status == 400 and answer["error"]["code"] == "invalid_body", (path, r.status, answer)
                    assert "Content-Encoding" in answer["error"]["message"]

            port = server.port
            # Non-ASCII bytes in the Authorization header: a plain 401, not a 500.
            raw = await asyncio.to_thread(_raw_request, port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                               b"Authorization: Bearer mg-\xff\xfe\xe9\r\nContent-Type: application/json\r\n"
                               b"Content-Length: 2\r\n\r\n", b"{}")
            assert _status(raw) == 401, raw[:200]
            # A multipart part header with non-ASCII bytes on a file upload.
            boundary = b"XyZ"
            body = (b"--XyZ\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                    b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"\xff\xfe\xe9.jsonl\"\r\n"
                    b"Content-Type: application/\xe9\xff\r\n\r\n{}\r\n--XyZ--\r\n")
            raw = await asyncio.to_thread(_raw_request, port, b"POST /v1/files HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                               b"Authorization: Bearer " + key.encode() + b"\r\n"
                               b"Content-Type: multipart/form-data; boundary=" + boundary + b"\r\n"
                               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n", body)
            assert _status(raw) == 400 and b"UTF-8" in raw, raw[:300]

            # The engine never noticed: same process, still serving.
            assert engine._process.pid == pid and not engine.dead
            status, answer = await post("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2,
                                                                       "seed": 2**63 - 1, "top_k": 5}).encode())
            assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    # aiohttp meets an unreadable body again after the answer; that is one line, not an error's traceback.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records
                                                                           if r.levelno >= logging.ERROR]
    assert any("unreadable request body" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(120)
def test_a_malformed_header_line_does_not_echo_the_key(demo_dir, tmp_path, caplog):
    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)
    engine = AsyncEngine(EngineConfig(model=demo_dir, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=32))
    app = create_app(GatewayConfig(served_model_name="demo", database_url=url, data_dir=str(tmp_path / "data")), engine)
    secret = "mg-" + "".join(random.choices("abcdefghijklmnop", k=32))

    async def scenario():
        async with TestServer(app, host="127.0.0.1") as server:
            for bad in (b"Authorization: Bearer " + secret.encode() + b"\x01zz\r\n",
                        b"Authorization : Bearer " + secret.encode() + b"\r\n",
                        b"Authorization: Bearer " + secret.encode() + b"\r\nBad Header Line\r\n"):
                raw = await asyncio.to_thread(
                    _raw_request, server.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + bad + b"\r\n")
                assert _status(raw) == 400, raw
                assert secret.encode() not in raw and b"malformed HTTP request" in raw

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    logged = "\n".join(r.getMessage() + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "")
                       for r in caplog.records)
    assert "malformed HTTP request" in logged
    assert secret not in logged
