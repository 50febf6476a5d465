"""The soak's abusive tenants and its realtime probe (``benchmarks/soak.py``).

* ``hoarder``: streams it never reads (n=4, 20 top logprobs, 400 tokens, a 4 kB receive buffer), 4 open at a time,
  each held 20 s then dropped;
* ``schemer``: a flood of JSON schemas, each new (200 properties with fresh names), with a 20,000-value enum and a
  schema with no finite value among them, under a 120 requests/minute limit;
* ``probe``: a tenant of the realtime class streaming short completions one at a time; the time to its first token
  is measured alone before the load starts (idle) and under the whole load.
"""

import asyncio
import json
import random
import socket
import time

import aiohttp


class AbuseTally:
    def __init__(self) -> None:
        self.unread_streams = 0
        self.schema_statuses: dict[int, int] = {}
        self.ttft_ms: list[float] = []


async def _never_read(host: str, port: int, key: str) -> None:
    body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": f"tell {random.random()}"}],
                       "stream": True, "n": 4, "logprobs": True, "top_logprobs": 20, "max_tokens": 400}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    _, writer = await asyncio.open_connection(sock=sock)
    writer.write(head + body)
    await writer.drain()
    await asyncio.sleep(20)  # nothing read
    writer.close()


async def hoarder(host: str, port: int, key: str, tally: AbuseTally, stop: float) -> None:
    async def lane():
        while time.monotonic() < stop:
            tally.unread_streams += 1
            await _never_read(host, port, key)

    await asyncio.gather(*(lane() for _ in range(4)))


def _flood_schema(i: int) -> dict:
    if i % 8 == 3:
        return {"enum": [f"v{j}-{random.random()}" for j in range(20_000)]}  # too large: refused unread
    if i % 8 == 5:  # no finite value
        return {"$defs": {"n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"]}},
                "$ref": "#/$defs/n"}
    tag = f"f{random.randrange(10**9)}_"
    return {"type": "object", "properties": {f"{tag}{j}": {"type": "integer"} for j in range(200)}}


async def schemer(url: str, key: str, tally: AbuseTally, stop: float) -> None:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
        i = 0
        while time.monotonic() < stop:
            body = {"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": _flood_schema(i)}}}
            async with http.post(f"{url}/v1/chat/completions", json=body) as r:
                await r.read()
                tally.schema_statuses[r.status] = tally.schema_statuses.get(r.status, 0) + 1
            i += 1
            await asyncio.sleep(0.05)


async def realtime_probe(url: str, key: str, tally: AbuseTally, stop: float) -> None:
    body = {"model": "demo", "prompt": "ping", "max_tokens": 4, "stream": True}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
        while time.monotonic() < stop:
            started = time.perf_counter()
            async with http.post(f"{url}/v1/completions", json=body) as r:
                first = None
                async for line in r.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter()
                if first is not None and r.status == 200:
                    tally.ttft_ms.append(1000 * (first - started))
            await asyncio.sleep(0.2)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)
