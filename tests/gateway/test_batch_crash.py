"""kill -9 the server in the middle of a batch, start it again: the batch completes with exactly one
output line per custom_id, and every line is billed exactly once.

The server killed is a real ``moegate serve`` process; the one started again runs in this process
(``tests.gateway.in_process``: the same app over the same database and data directory, so its start takes over
the dead server's leases as a restarted ``moegate serve`` does), without a second interpreter importing torch
and the gateway (a real restart of the command: tests/gateway/test_stream_usage_crash.py)."""

import asyncio
import io
import json
import random
import signal
import time

import openai

from engine.loading.demo_model import write_demo_model
from tenants.store import TenantStore

from .in_process import in_process_server
from .serve_process import free_port, start_server, wait_ready

N = 16


def test_kill_9_mid_batch_then_restart_completes_exactly_once(tmp_path):
    model = str(tmp_path / "model")
    write_demo_model(model, seed=random.randrange(1000))
    db_url = f"sqlite:///{tmp_path / 'policy.db'}"
    port = free_port()
    flags = ("--data-dir", str(tmp_path / "data"), "--batch-lease-seconds", "2", "--batch-max-inflight", "4",
             "--served-model-name", "demo")
    url = f"http://127.0.0.1:{port}"
    lines = [{"custom_id": f"job-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "demo", "prompt": f"line {i} {random.randrange(10**6)}", "max_tokens": 16,
                       "temperature": 0, "ignore_eos": True}} for i in range(N)]
    proc, key = start_server(model, db_url, port, *flags)
    try:
        async def first_life() -> str:
            await wait_ready(url)
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            data = ("\n".join(json.dumps(l) for l in lines) + "\n").encode()
            f = await client.files.create(file=("jobs.jsonl", io.BytesIO(data)), purpose="batch")
            batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
            while (await client.batches.retrieve(batch.id)).request_counts.completed < 6:
                await asyncio.sleep(0.05)
            return batch.id

        batch_id = asyncio.run(first_life())
        proc.send_signal(signal.SIGKILL)  # mid-batch: lines in flight, leases held, nothing flushed
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    async def second_life(base_url: str):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
        deadline = time.monotonic() + 180
        while (b := await client.batches.retrieve(batch_id)).status != "completed":
            assert time.monotonic() < deadline and b.status in ("in_progress", "finalizing"), b.status
            await asyncio.sleep(0.2)
        out = (await client.files.content(b.output_file_id)).text.splitlines()
        return b, [json.loads(l) for l in out]

    # Started again on the same database (tmp_path/policy.db), data directory and checkpoint, with the same
    # settings as the first life's flags.
    with in_process_server(tmp_path, dict(max_num_seqs=8), gateway=dict(batch_lease_s=2, batch_max_inflight=4),
                           checkpoint=model) as srv:
        batch, out = srv.run(second_life(srv.base_url))
    ids = [o["custom_id"] for o in out]
    assert sorted(ids) == sorted(l["custom_id"] for l in lines) and len(ids) == len(set(ids)) == N
    assert batch.request_counts.completed == N and batch.request_counts.failed == 0
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 16 for o in out)

    async def ledger():
        store = TenantStore.open(db_url)
        try:
            return await store.usage_summary("default", by="tenant")
        finally:
            await store.close()

    rows = [r for r in asyncio.run(ledger()) if r["kind"] == "batch"]
    assert rows[0]["requests"] == N and rows[0]["completion_tokens"] == 16 * N  # billed once per line
