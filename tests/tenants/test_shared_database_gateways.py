"""Two gateways serving different models share one PostgreSQL database, each with its own data
directory: each runs only its own model's batch lines, and either serves every file."""

import asyncio
import io
import json
import time

import openai
import pytest
from aiohttp.test_utils import TestServer

from benchmarks.instant_engine import InstantEngine
from gateway.app import create_app
from gateway.config import GatewayConfig
from .helpers import tenant_key


def _batch_file(model: str, n: int) -> bytes:
    lines = [{"custom_id": f"{model}-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": f"line {i}", "max_tokens": 3}} for i in range(n)]
    return ("\n".join(json.dumps(line) for line in lines) + "\n").encode()


async def _run_batch(client: openai.AsyncOpenAI, model: str, n: int):
    f = await client.files.create(file=("in.jsonl", io.BytesIO(_batch_file(model, n))), purpose="batch")
    batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        await asyncio.sleep(0.1)
        batch = await client.batches.retrieve(batch.id)
    return batch


@pytest.mark.timeout(180)
def test_gateways_of_two_models_share_a_database(pg_migrated_url, tmp_path):
    from .conftest import _reset_pg

    _reset_pg(pg_migrated_url)

    async def scenario():
        key = await tenant_key(pg_migrated_url)
        apps = {model: create_app(GatewayConfig(served_model_name=model, database_url=pg_migrated_url,
                                                data_dir=str(tmp_path / model), batch_poll_s=0.05), InstantEngine())
                for model in ("alpha", "beta")}
        async with TestServer(apps["alpha"], host="127.0.0.1") as a, TestServer(apps["beta"], host="127.0.0.1") as b:
            clients = {m: openai.AsyncOpenAI(base_url=str(s.make_url("/v1")), api_key=key, max_retries=0)
                       for m, s in (("alpha", a), ("beta", b))}
            done = await asyncio.gather(_run_batch(clients["alpha"], "alpha", 30), _run_batch(clients["beta"], "beta", 20))
            for batch, model, n in zip(done, ("alpha", "beta"), (30, 20)):
                assert batch.status == "completed" and batch.request_counts.completed == n
                for via in ("alpha", "beta"):  # each gateway serves the other's output file
                    text = (await clients[via].files.content(batch.output_file_id)).text
                    outputs = [json.loads(line) for line in text.splitlines()]
                    assert len(outputs) == n
                    # Run by the gateway that serves the batch's model, and only by it.
                    assert {o["response"]["body"]["model"] for o in outputs} == {model}

    asyncio.run(scenario())
