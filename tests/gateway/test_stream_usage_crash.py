"""A gateway killed (SIGKILL) while streams run bills, at its next start, what each stream had delivered: one usage
row per stream, with at least the tokens its client received and no more than it asked for, and nothing left to
bill twice."""

import asyncio
import json
import os
import random
import signal
import sqlite3
import tempfile

import aiohttp
import pytest

from engine.loading.demo_model import write_demo_model
from tests.gateway.serve_process import free_port, start_server, wait_ready

pytestmark = pytest.mark.timeout(400)


def test_streams_cut_by_a_killed_gateway_are_billed_once_at_restart():
    tmp = tempfile.mkdtemp(prefix="stream-crash")
    model = os.path.join(tmp, "demo")
    write_demo_model(model, seed=random.randrange(1000))
    db = os.path.join(tmp, "policy.db")
    port = free_port()
    flags = ("--data-dir", os.path.join(tmp, "data"), "--served-model-name", "demo", "--max-model-len", "512")
    proc, key = start_server(model, f"sqlite:///{db}", port, *flags)
    url = f"http://127.0.0.1:{port}"
    received: dict[str, int] = {}  # request id -> tokens its client read before the kill
    max_tokens = 400

    async def read_some(http, wanted: int) -> None:
        body = {"model": "demo", "prompt": [random.randrange(10, 1000) for _ in range(8)], "max_tokens": max_tokens,
                "stream": True, "logprobs": 0, "ignore_eos": True}
        response = await http.post(f"{url}/v1/completions", json=body)
        assert response.status == 200
        read = 0
        async for line in response.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                received[chunk["id"]] = read = read + len(chunk["choices"][0]["logprobs"]["tokens"])
                if read >= wanted:
                    return  # the response stays open, unread, until the kill

    async def scenario():
        await wait_ready(url)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            await asyncio.gather(*(read_some(http, random.randrange(3, 12)) for _ in range(6)))
            proc.send_signal(signal.SIGKILL)  # streams mid-way: nothing of theirs settled
            proc.wait(timeout=30)

    try:
        asyncio.run(scenario())
        assert len(received) == 6
        proc, _ = start_server(model, f"sqlite:///{db}", port, *flags, expect_key=False)
        asyncio.run(wait_ready(url))
    finally:
        proc.kill()
        proc.wait(timeout=30)
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT request_id, completion_tokens, finish_reason, http_status FROM usage").fetchall()
    billed = {rid: tokens for rid, tokens, _, _ in rows}
    assert len(rows) == len(billed) == 6 and billed.keys() == received.keys(), rows
    for rid, got in received.items():
        assert got <= billed[rid] <= max_tokens, (rid, got, billed[rid])
    assert {(reason, status) for _, _, reason, status in rows} == {("abort", 503)}
    # Nothing is left to bill again at a later start.
    assert not list((os.path.join(tmp, "data", "usage-journal", f) for f in os.listdir(os.path.join(
        tmp, "data", "usage-journal")) if f.startswith("streams-") and not f.startswith(f"streams-{proc.pid}-")))
