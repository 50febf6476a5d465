"""`/v1/batches`: create (validating the whole input file first), get, list, cancel.

A batch whose input has any problem fails validation with every problem listed
by line and nothing runs; a valid one holds its estimated tokens on the
tenant's batch queue limit (429 if over) until it is finalized.
"""

import asyncio
import json
import math
from typing import Any

import msgspec
from aiohttp import web

from gateway.admission import QUOTAS
from gateway.auth import PRINCIPAL
from gateway.batch.validation import ENDPOINTS, validate_batch_file
from gateway.errors import APIError, read_body
from gateway.lora_adapters import ADAPTERS
from gateway.batch.files import BATCH_STORE, file_expiry, list_page, read_content
from gateway.replies import json_response, query_limit
from gateway.openai_schema import decode_body
from tenants.models import Batch
from tenants.quota import Denied

BATCH_SETTINGS = web.AppKey("batch_settings", dict)  # served model name, limits, window


class CreateBatch(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    # The output and error files' expiry policy (a FileExpiry, checked by file_expiry): accepted, not applied.
    output_expires_after: dict[str, Any] | None = None


def _ts(value) -> int | None:
    return None if value is None else int(value.timestamp())


def batch_object(b: Batch) -> dict:
    errors = json.loads(b.errors_json) if b.errors_json else None
    return {
        "id": b.id, "object": "batch", "endpoint": b.endpoint,
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": b.input_file_id, "completion_window": b.completion_window, "status": b.status,
        "output_file_id": b.output_file_id, "error_file_id": b.error_file_id,
        "created_at": _ts(b.created_at), "in_progress_at": _ts(b.in_progress_at), "expires_at": _ts(b.expires_at),
        "finalizing_at": _ts(b.finalizing_at), "completed_at": _ts(b.completed_at), "failed_at": _ts(b.failed_at),
        "expired_at": _ts(b.expired_at), "cancelling_at": _ts(b.cancelling_at), "cancelled_at": _ts(b.cancelled_at),
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "metadata": json.loads(b.metadata_json) if b.metadata_json else None,
        "model": b.model,
    }


def _not_found(batch_id: str) -> APIError:
    return APIError(404, f"no such batch: {batch_id!r}", param="batch_id", code="batch_not_found")


async def create_batch(request: web.Request) -> web.Response:
    app = request.app
    tenant = request[PRINCIPAL].tenant
    settings = app[BATCH_SETTINGS]
    req = decode_body(await read_body(request), CreateBatch)
    if req.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {req.endpoint!r}", param="endpoint")
    if req.completion_window != "24h":
        raise APIError(400, f"completion_window must be '24h', got {req.completion_window!r}",
                       param="completion_window")
    if req.metadata is not None and (len(req.metadata) > 16 or any(len(k) > 64 or len(v) > 512
                                                                   for k, v in req.metadata.items())):
        raise APIError(400, "metadata holds at most 16 pairs, keys up to 64 and values up to 512 characters",
                       param="metadata")
    file_expiry(req.output_expires_after, "output_expires_after")  # files here are kept until deleted
    store = app[BATCH_STORE]
    info = await store.get_file(tenant.id, req.input_file_id)
    if info is None:
        raise APIError(404, f"no such file: {req.input_file_id!r}", param="input_file_id", code="file_not_found")
    if info.purpose != "batch":
        raise APIError(400, f"file {info.id!r} has purpose {info.purpose!r}, not 'batch'", param="input_file_id")
    data = await read_content(app, info)
    # On a worker thread: a file of 50,000 lines takes seconds to check, which on the event loop every other
    # request's stream would wait for (the thread hands the interpreter back every few milliseconds).
    checked = await asyncio.to_thread(validate_batch_file, data, req.endpoint, settings["model"](),
                                      settings["max_lines"], settings["default_max_tokens"],
                                      await app[ADAPTERS].usable(tenant.id))
    if not checked.ok:
        batch = await store.create_batch(tenant.id, req.endpoint, info.id, settings["window_s"], req.completion_window,
                                         req.metadata, checked.model, [], checked.errors, 0)
        return json_response(batch_object(batch))
    quotas = app[QUOTAS]
    held = await quotas.reserve_batch_queue(tenant.id, checked.token_estimate)
    if isinstance(held, Denied):
        headers = {} if held.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(held.retry_after_s)))}
        raise APIError(429, f"batch queue limit: this batch needs about {checked.token_estimate} tokens and "
                       f"{held.remaining} of {held.limit} are free until queued batches finish",
                       "rate_limit_error", code="batch_queue_limit_exceeded", headers=headers)
    try:
        batch = await store.create_batch(tenant.id, req.endpoint, info.id, settings["window_s"], req.completion_window,
                                         req.metadata, checked.model, checked.lines, None, checked.token_estimate)
    except BaseException:
        await quotas.release_batch_queue(tenant.id, checked.token_estimate)
        raise
    request.app[BATCH_WAKE].set()
    return json_response(batch_object(batch))


async def get_batch(request: web.Request) -> web.Response:
    batch_id = request.match_info["batch_id"]
    b = await request.app[BATCH_STORE].get_batch(request[PRINCIPAL].tenant.id, batch_id)
    if b is None:
        raise _not_found(batch_id)
    return json_response(batch_object(b))


async def list_batches(request: web.Request) -> web.Response:
    batches, more = await request.app[BATCH_STORE].list_batches(
        request[PRINCIPAL].tenant.id, request.query.get("after"), query_limit(request, default=20, most=100))
    return json_response(list_page([batch_object(b) for b in batches], more))


async def cancel_batch(request: web.Request) -> web.Response:
    batch_id = request.match_info["batch_id"]
    b = await request.app[BATCH_STORE].cancel(request[PRINCIPAL].tenant.id, batch_id)
    if b is None:
        raise _not_found(batch_id)
    if b.status not in ("cancelling", "cancelled"):
        raise APIError(400, f"batch {batch_id!r} is {b.status} and cannot be cancelled", code="batch_not_cancellable")
    request.app[BATCH_WAKE].set()
    return json_response(batch_object(b))


BATCH_WAKE = web.AppKey("batch_wake", asyncio.Event)  # an asyncio.Event: new work or a cancel for the runner


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
