"""Batch API jobs (OpenAI's files + batches): upload requests, create the batch, poll it, time the turnaround.

Turnaround is batch creation -> the poll that first sees a final status
(``completed``, ``failed``, ``expired``, ``cancelled``), so it is accurate to
one poll interval. When the job completes, its output file is read to count
the lines that succeeded and their tokens.
"""

import asyncio
import dataclasses
import json
from collections.abc import Callable

import aiohttp

from loadgen.client import RequestOptions, Target, build_body
from loadgen.datasets import RequestSpec

FINAL = ("completed", "failed", "expired", "cancelled")


async def _json_or_raise(resp: aiohttp.ClientResponse, what: str) -> dict:
    text = await resp.text()
    if resp.status != 200:
        raise RuntimeError(f"{what}: HTTP {resp.status}: {text[:200]}")
    return json.loads(text)


async def run_batch_job(session: aiohttp.ClientSession, target: Target, tenant: str, specs: list[RequestSpec],
                        opts: RequestOptions, completion_window: str, poll_interval_s: float, timeout_s: float,
                        clock: Callable[[], float]) -> dict:
    """Run one batch job to its end; returns its record (never raises for HTTP trouble: ``error`` says what)."""
    endpoint = "/v1/chat/completions" if opts.api == "chat" else "/v1/completions"
    unstreamed = dataclasses.replace(opts, stream=False)
    lines = [json.dumps({"custom_id": f"{tenant}-{i}", "method": "POST", "url": endpoint,
                         "body": build_body(spec, unstreamed)}) for i, spec in enumerate(specs)]
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    base = target.base_url.rstrip("/")
    job = {"tenant": tenant, "num_requests": len(specs), "submitted_s": clock(), "created_s": None,
           "finished_s": None, "turnaround_s": None, "status": None, "request_counts": None,
           "completed_lines": None, "completion_tokens": None, "error": None}
    try:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", ("\n".join(lines) + "\n").encode(), filename=f"{tenant}.jsonl",
                       content_type="application/jsonl")
        async with session.post(f"{base}/files", data=form, headers=headers) as resp:
            file_id = (await _json_or_raise(resp, "file upload"))["id"]
        body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": completion_window}
        async with session.post(f"{base}/batches", json=body, headers=headers) as resp:
            batch = await _json_or_raise(resp, "batch create")
        job["created_s"] = clock()
        while batch.get("status") not in FINAL:
            if clock() - job["created_s"] > timeout_s:
                raise RuntimeError(f"batch still {batch.get('status')} after {timeout_s:g} s")
            await asyncio.sleep(poll_interval_s)
            async with session.get(f"{base}/batches/{batch['id']}", headers=headers) as resp:
                batch = await _json_or_raise(resp, "batch poll")
        job["finished_s"] = clock()
        job["turnaround_s"] = job["finished_s"] - job["created_s"]
        job["status"] = batch["status"]
        job["request_counts"] = batch.get("request_counts")
        if batch.get("output_file_id"):
            async with session.get(f"{base}/files/{batch['output_file_id']}/content", headers=headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"output file: HTTP {resp.status}")
                text = await resp.text()
            outputs = [json.loads(line) for line in text.splitlines() if line.strip()]
            good = [o for o in outputs if (o.get("response") or {}).get("status_code") == 200]
            job["completed_lines"] = len(good)
            job["completion_tokens"] = sum(
                ((o["response"].get("body") or {}).get("usage") or {}).get("completion_tokens", 0) for o in good)
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, KeyError, ValueError) as e:
        job["error"] = f"{type(e).__name__}: {e}"
        job["finished_s"] = clock()
    return job
