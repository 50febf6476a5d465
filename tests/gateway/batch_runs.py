"""A Batch API run through the official ``openai`` client, as the batch tests do it: the lines uploaded, the batch
created and polled until it ends, and each line's response read back from the output and error files."""

import asyncio
import io
import json
import time

import openai


async def run_chat_batch(client: openai.AsyncOpenAI, lines: list[str], timeout_s: float = 60) -> dict[str, dict]:
    """The ``response`` of each of ``lines`` (JSONL request lines to /v1/chat/completions) by ``custom_id``; the
    batch must complete within ``timeout_s``. A line's 4xx is in the error file, read here as a 200's is."""
    f = await client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + timeout_s
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        batch = await client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    out = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            out += [json.loads(x) for x in (await client.files.content(file_id)).text.splitlines()]
    return {x["custom_id"]: x["response"] for x in out}
