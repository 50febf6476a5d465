"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{response_id}``.

A create runs as a chat completion through the app's one request path (admission, quotas, priorities,
billing: ``run``), with its own reply: the response object, or its events as SSE (``event:`` and ``data:``
lines). A response made with ``store`` (the default) is kept per tenant in the policy database for the
retention period, so ``previous_response_id`` continues its conversation.
"""

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web
from sqlalchemy.exc import SQLAlchemyError

from engine.serving.async_engine import EngineError, RequestRejectedError
from gateway.admission import QUOTAS
from gateway.app_keys import CONFIG
from gateway.auth import PRINCIPAL
from gateway.chat_plan import ChatPlan
from gateway.completion import engine_down, output_failed, rejected
from gateway.errors import REQUEST_ID, REQUEST_ID_HEADER, APIError, read_body
from gateway.batch.files import list_page
from gateway.replies import json_response, query_limit
from gateway.request_keys import CHOICES, RATE_HEADERS, SERVED_MODEL, TIMER
from gateway.stream_padding import encode_event
from gateway.responses import stored_items
from gateway.responses.builder import ResponseBuilder, skeleton, usage
from gateway.live_admission import refuse_early
from gateway.responses.prepare import head, prepare, stored_bound
from gateway.responses.request import FunctionTool, ResponsesRequest
from gateway.responses.translate import responses_error
from tenants.response_store import (
    ChainBroken, ChainTooLong, ResponseStore, StoredResponsesFull, StoredRow, conversation, decode_rows,
)

logger = logging.getLogger(__name__)

RESPONSE_STORE = web.AppKey("response_store", ResponseStore)
PURGE_INTERVAL_S = 3600.0  # expired responses are deleted at least this often
LARGE_BODY_BYTES = 1 << 16  # bodies past this are prepared on a worker thread


def add_routes(app: web.Application, run: Callable[..., Awaitable[web.StreamResponse]], model_name: Callable[[], str],
               retention_s: float) -> None:
    """Register the routes. ``run(request, chat_body, chat, respond=, rid_prefix=)`` is the app's request path;
    the store opens after the policy database (register after the app's store lifecycle)."""

    async def create(request: web.Request) -> web.StreamResponse:
        data = await read_body(request)
        tenant_id = request[PRINCIPAL].tenant.id
        first = head(data)
        previous = first.previous_response_id if first is not None else None
        # What can refuse the request cheaply does so before its stored conversation is read and decoded: a
        # tenant past its rates, or out of stored-response room, costs the gateway no such work.
        await refuse_early(request)
        if first is not None and first.store is not False:
            await _check_room(request, tenant_id, stored_bound(len(data), first.max_output_tokens,
                                                               request.app[CONFIG].default_reservation_tokens))
        history: list[StoredRow] = []
        if previous is not None:
            history = await _chain(request.app[RESPONSE_STORE], tenant_id, previous, "previous_response_id", APIError(
                404, f"previous_response_id {previous!r} names no stored response of yours (never stored, deleted, "
                     f"made with store: false, or older than the {retention_s / 86400:g}-day retention); send the "
                     "whole conversation as input", param="previous_response_id", code="previous_response_not_found"))
        # A large body or a stored conversation is decoded and translated on a worker thread (prepare.py).
        req, tools, body, inputs, places = await asyncio.to_thread(prepare, data, history) \
            if history or len(data) > LARGE_BODY_BYTES else prepare(data, history)
        if req.store is not False:
            if len(history) >= request.app[RESPONSE_STORE].max_depth:  # stored, it could not be read back
                raise APIError(400, f"previous_response_id {previous!r}: the conversation already holds "
                                    f"{len(history)} stored responses, the most one is read back with; send it (or a "
                                    "summary of it) as input, or continue it with store: false",
                               param="previous_response_id")
        respond = functools.partial(_respond, req=req, tools=tools, inputs=inputs,
                                    ancestors=[row.id for row in history], model=model_name())
        try:
            return await run(request, body, True, respond=respond, rid_prefix="resp_")
        except APIError as err:
            raise responses_error(err, places) from None

    async def retrieve(request: web.Request) -> web.Response:
        return json_response((await _saved(request)).response)

    async def list_input_items(request: web.Request) -> web.Response:
        """The items the response answered (its conversation before its own output)."""
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, "order must be 'asc' or 'desc'", param="order")
        response_id = request.match_info["response_id"]
        rows = await _chain(request.app[RESPONSE_STORE], request[PRINCIPAL].tenant.id, response_id, "response_id",
                            _not_found(response_id, retention_s))
        chain = await asyncio.to_thread(decode_rows, rows)
        inputs = conversation(chain[:-1]) + chain[-1].inputs
        items, more = stored_items.page(inputs, order, request.query.get("after"), query_limit(request, most=100))
        return json_response(list_page(items, more))

    async def remove(request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if not await request.app[RESPONSE_STORE].delete(request[PRINCIPAL].tenant.id, response_id):
            raise _not_found(response_id, retention_s)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def _saved(request: web.Request):
        response_id = request.match_info["response_id"]
        saved = await request.app[RESPONSE_STORE].get(request[PRINCIPAL].tenant.id, response_id)
        if saved is None:
            raise _not_found(response_id, retention_s)
        return saved

    async def store_lifecycle(app: web.Application):
        app[RESPONSE_STORE] = store = ResponseStore(app[QUOTAS].store, retention_s)
        purger = asyncio.create_task(_purge(store, min(PURGE_INTERVAL_S, retention_s / 4)), name="responses-purge")
        yield
        purger.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await purger

    app.cleanup_ctx.append(store_lifecycle)
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", remove)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)


async def _chain(store: ResponseStore, tenant_id: int, response_id: str, param: str,
                 not_found: APIError) -> list[StoredRow]:
    """The rows of the conversation ending with the tenant's response ``response_id``; ``not_found`` if there
    is no such response, a 404 if an earlier one of it was deleted, a 400 if it is too long (naming
    ``param``)."""
    try:
        chain = await store.chain_rows(tenant_id, response_id)
    except ChainBroken as gone:
        raise APIError(404, f"{param} {response_id!r} continues response {gone.missing!r}, which was deleted; "
                            "send the whole conversation as input", param=param,
                       code="previous_response_not_found") from None
    except ChainTooLong as e:
        raise APIError(400, f"{param} {response_id!r}: {e}; send the conversation (or a summary of it) as "
                            "input instead", param=param) from None
    if chain is None:
        raise not_found
    return chain


async def _check_room(request: web.Request, tenant_id: int, incoming: int) -> None:
    """A 400 if storing this request and its output (about ``incoming`` bytes) would pass the tenant's
    stored-response cap."""
    cap = (await request.app[QUOTAS].limits(tenant_id)).stored_response_bytes
    if cap is None:
        return
    used = await request.app[RESPONSE_STORE].stored_bytes(tenant_id)
    if used + incoming > cap:
        raise APIError(400, f"your stored responses hold {used} bytes and this one would pass your limit of "
                            f"{cap} bytes; delete responses you no longer continue (DELETE /v1/responses/{{id}}), "
                            f"let them expire, or send store: false", param="store",
                       code="stored_responses_limit_exceeded")


def _not_found(response_id: str, retention_s: float) -> APIError:
    return APIError(404, f"no stored response {response_id!r} of yours (never stored, deleted, made with store: "
                         f"false, or older than the {retention_s / 86400:g}-day retention)", "not_found_error",
                    param="response_id", code="response_not_found")


async def _purge(store: ResponseStore, interval_s: float) -> None:
    while True:
        try:
            purged = await store.purge_expired()
            if purged:
                logger.info("deleted %d expired stored response(s)", purged)
        except Exception:  # the database is down: try again next time
            logger.exception("purging expired responses failed")
        await asyncio.sleep(interval_s)


async def _respond(request: web.Request, body, chat: bool, stream, rid: str, created: int, plan: ChatPlan, *,
                   req: ResponsesRequest, tools: list[FunctionTool], inputs: msgspec.Raw, ancestors: list[str],
                   model: str) -> web.StreamResponse:
    """The engine's output as a response object or its events; the response is stored (``store``: its own
    ``inputs``, linked to the response it continued, whose chain is ``ancestors``) before the client hears it
    is finished."""
    choices, timer = request[CHOICES], request[TIMER]
    # The adapter's name when the request's model named one (gateway.lora_adapters).
    builder = ResponseBuilder(skeleton(req, rid, created, request.get(SERVED_MODEL, model), tools), plan.output_parser())

    async def outputs():
        """(engine output, last) as they come, each recorded in choices so the usage is settled if the client
        goes away."""
        first = True
        while True:
            try:
                out = await anext(stream)
            except RequestRejectedError as e:
                raise rejected(e, "input") from None
            except EngineError as e:
                raise engine_down(e) from None
            timer.delta(first=first, queue_time_s=out[1].queue_time_s if first else None)
            first = False
            choices.add(*out)
            yield out[1], choices.finished
            if choices.finished:
                return

    async def finish() -> list[dict]:
        last = choices.outputs[0]
        events = builder.finish(last.finish_reason, usage(choices.num_prompt_tokens, choices.num_cached_tokens,
                                                          choices.num_output_tokens))
        if req.store is not False and builder.response["status"] != "failed":
            tenant_id = request[PRINCIPAL].tenant.id
            try:
                cap = (await request.app[QUOTAS].limits(tenant_id)).stored_response_bytes
                await request.app[RESPONSE_STORE].put(tenant_id, builder.response, inputs, req.previous_response_id,
                                                      ancestors, max_stored_bytes=cap)
            except StoredResponsesFull as full:
                # Made and billed, but past the cap with its own output (a longer output than admission allowed
                # for, or other responses stored meanwhile): the client gets it, saying it was not stored.
                logger.info("response %s not stored: %s", rid, full)
                builder.response["store"] = False
                events[-1]["response"]["store"] = False  # the final event's copy of the response
            except SQLAlchemyError:
                logger.exception("storing response %s failed", rid)
                raise APIError(503, "the response was made but could not be stored (the policy database is "
                                    "unavailable); retry shortly, or send store: false", "server_error",
                               code="database_unavailable", headers={"Retry-After": "2"}) from None
        return events

    if not req.stream:
        async for out, last in outputs():
            builder.feed(out.text, out.token_ids, last, _cut(out, last))
        if choices.failed:
            raise output_failed()
        await finish()
        reply = json_response(builder.response)
        reply.headers.update(request[RATE_HEADERS])
        return reply

    events = outputs()
    out, last = await anext(events)  # a prompt the engine refuses is still a 400, before the stream starts
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **request[RATE_HEADERS]})
    response.headers[REQUEST_ID_HEADER] = request[REQUEST_ID]  # sent at prepare, before the middleware sees it
    await response.prepare(request)
    obfuscate = bool(req.stream_options and req.stream_options.include_obfuscation)
    await _write(response, builder.start(), obfuscate)
    try:
        while True:
            await _write(response, builder.feed(out.text, out.token_ids, last, _cut(out, last)), obfuscate)
            if last:
                break
            out, last = await anext(events)
        await _write(response, await finish(), obfuscate)
    except APIError as err:  # the engine went down mid-stream, or the store did not answer
        await _write(response, [{"type": "error", "sequence_number": builder.sequence, "code": err.code,
                                 "message": err.message, "param": err.param}], obfuscate)
    await response.write_eof()
    return response


def _cut(out, last: bool) -> bool:
    """Whether the output ends here at the token limit."""
    return last and out.finish_reason == "length"


async def _write(response: web.StreamResponse, events: list[dict], obfuscate: bool) -> None:
    if events:
        await response.write(b"".join(b"event: " + e["type"].encode() + b"\ndata: " + encode_event(e, obfuscate)
                                      + b"\n\n" for e in events))
