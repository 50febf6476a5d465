"""The aiohttp application: OpenAI-compatible routes over the engine process.

Middleware order: error mapping -> auth (key -> tenant) -> handler; the
handler does quota admission (reserve prompt + max_tokens, settle the real
counts at the end) and gives the engine request its tenant's priority rank,
weight, preemptibility and cache salt.
"""

import asyncio
import hmac
import logging
import time
import uuid
from pathlib import Path

import msgspec
from aiohttp import web

from engine.serving.async_engine import EngineError, RequestRejectedError
from engine.serving.client import EngineClient
from gateway.admission import QUOTAS, SETTLEMENTS, Settlements, rate_limit_headers, utcnow
from gateway.auth import AUTHENTICATOR, PRINCIPAL, Authenticator, Principal, auth_middleware
from gateway.replies import json_response
from gateway.chat_plan import ChatPlan, ParserChoice
from gateway.choices import Choices
from gateway.completion import (
    apply_plan, chat_finish_reason, chat_plan_of, choice_prompts, collect, completion_body, engine_down, output_choice,
    order_in_class, output_failed, output_view, prepare_prompts, start_streams, stream_choices, system_fingerprint,
)
from gateway.openai_logprobs import CompletionLogprobs, chat_logprobs, prompt_logprobs_list
from gateway.config import GatewayConfig
from gateway.drain import OPEN_REQUESTS, drain_open_requests, track_open_requests
from gateway.engine_supervisor import supervise
from gateway.errors import (
    BODY_TIMEOUT_S, REQUEST_ID, REQUEST_ID_HEADER, APIError, error_middleware, read_body, request_id_middleware,
)
from gateway.heap import freeze_startup_heap, unfreeze_heap
from gateway import http_protocol
from gateway.metrics import METRICS, GatewayMetrics, RequestTimer
from gateway.request_keys import CHOICES, RATE_HEADERS, TIMER
from gateway.refusals import count_refusals
from gateway.replica_router import replicas_of, unresponsive_after_s
from gateway.schema_check import check_schema
from gateway.stream_journal import JOURNALED, STREAM_JOURNAL, JournaledStream, StreamJournal
from gateway.openapi import openapi_document
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest, decode_body, sampling_params_of
from gateway.usage_ledger import UsageLedger
from gateway.batch import batches as batch_api, files as files_api
from gateway.responses import routes as responses_api
from gateway import tokenization
from gateway.batch.batches import BATCH_SETTINGS, BATCH_WAKE, QUOTA_MANAGER
from gateway.batch.runner import BatchRunner, BatchRunnerConfig
from gateway.batch.files import BATCH_STORE, DATA_DIR, MAX_FILE_BYTES
from tenants.batch_store import BatchStore
from tenants.store import NotFound
from tenants.quota import QuotaManager
from tenants.store import TenantStore, UsageRecord

logger = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", EngineClient)
CONFIG = web.AppKey("config", GatewayConfig)
INFLIGHT = web.AppKey("inflight", dict)  # priority rank -> requests admitted and not finished
LEDGER = web.AppKey("ledger", UsageLedger)
DRAINING = web.AppKey("draining", asyncio.Event)  # set on shutdown: in-flight requests finish, new ones get 503
SERVING_SINCE = web.AppKey("serving_since", int)  # unix time the app was made: the model card's `created`
METRICS_URL = web.AppKey("metrics_url", str)  # where the metrics listener answers (once started)


def _model_name(app: web.Application) -> str:
    config, engine = app[CONFIG], app[ENGINE]
    return config.served_model_name or engine.config.model.rstrip("/").rsplit("/", 1)[-1]


async def health(request: web.Request) -> web.Response:
    """ready (200) while any engine replica serves; starting / engine down (503 with Retry-After) while none
    does. ``replicas`` gives each replica's own status (and why it is down)."""
    engine = request.app[ENGINE]
    replicas = [_replica_health(name, r, unresponsive_after_s(engine)) for name, r in replicas_of(engine)]
    if request.app[DRAINING].is_set():
        response = json_response({"status": "draining", "replicas": replicas}, status=503)
    elif engine.dead:
        response = json_response({"status": "engine down", "reason": engine.dead, "replicas": replicas}, status=503)
    elif engine.info is None:
        response = json_response({"status": "starting", "replicas": replicas}, status=503)
    else:
        return json_response({"status": "ready", "replicas": replicas})
    response.headers["Retry-After"] = "5"
    return response


def _replica_health(name: str, replica: EngineClient, silence_limit_s: float) -> dict:
    if replica.dead:
        return {"replica": name, "status": "down", "reason": replica.dead}
    if replica.info is None:
        return {"replica": name, "status": "starting"}
    silent = replica.silent_s()
    if silent >= silence_limit_s:  # no new requests go there until it speaks again
        return {"replica": name, "status": "unresponsive", "silent_s": round(silent, 1)}
    return {"replica": name, "status": "ready"}


async def openapi_endpoint(request: web.Request) -> web.Response:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("moegate")
    except PackageNotFoundError:
        ver = "0"
    return json_response(openapi_document(ver))


async def metrics_endpoint(request: web.Request) -> web.Response:
    """/metrics on the API's listener: only for the holder of the metrics token (series name tenants)."""
    token = request.app[CONFIG].metrics_token
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise APIError(401, "metrics need 'Authorization: Bearer <metrics token>'", "authentication_error",
                       code="invalid_metrics_token", headers={"WWW-Authenticate": "Bearer"})
    return request.app[METRICS].render()


async def _write_error_event(response: web.StreamResponse, err: APIError) -> web.StreamResponse:
    """End a stream whose headers are gone with one event in the OpenAI error shape."""
    error = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    await response.write(b"data: " + msgspec.json.encode(error) + b"\n\n")
    await response.write_eof()
    return response


async def serve_metrics(app: web.Application):
    """Cleanup context: /metrics alone on ``metrics_host:metrics_port`` (a listener for the scraper only)."""
    config = app[CONFIG]
    if config.metrics_port is None:
        yield
        return
    async def scrape(request: web.Request) -> web.Response:
        return app[METRICS].render()

    metrics_app = web.Application()
    metrics_app.router.add_get("/metrics", scrape)
    runner = web.AppRunner(metrics_app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.metrics_host, config.metrics_port)
    await site.start()
    app[METRICS_URL] = f"http://{config.metrics_host}:{runner.addresses[0][1]}/metrics"
    logger.info("metrics on %s", app[METRICS_URL])
    yield
    await runner.cleanup()


def _model_card(app: web.Application) -> dict:
    return {"id": _model_name(app), "object": "model", "created": app[SERVING_SINCE], "owned_by": "moegate",
            "max_model_len": app[ENGINE].info.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_model_card(request.app)]})


async def retrieve_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: the served model's card, or 404 ``model_not_found`` naming what is served."""
    _check_model(request.app, request.match_info["model"])
    return json_response(_model_card(request.app))


def _check_model(app: web.Application, model: str | None) -> None:
    if model is not None and model != _model_name(app):
        raise APIError(404, f"model {model!r} does not exist; this server serves {_model_name(app)!r}", param="model",
                       code="model_not_found")


async def _run(request: web.Request, body, chat: bool, respond=None, rid_prefix: str | None = None) -> web.StreamResponse:
    """One request through admission, the engine and the settle; ``respond`` (default: the chat / completion
    reply) writes the reply, ``rid_prefix`` starts its id (the Responses API runs as chat with its own)."""
    app = request.app
    _check_model(app, body.model)
    engine = app[ENGINE]
    sampling_params = sampling_params_of(body, engine.info.vocab_size if engine.info is not None else None)
    plan = None
    if chat:
        plan = chat_plan_of(engine, body, _parsers(app[CONFIG]))
        apply_plan(sampling_params, plan)
    if app[DRAINING].is_set():  # a new request on a kept-alive connection during shutdown
        raise APIError(503, "the server is shutting down; retry on another replica or shortly", "server_error",
                       code="shutting_down", headers={"Retry-After": "5", "Connection": "close"})
    if engine.dead:
        raise engine_down(engine.dead)
    principal: Principal = request[PRINCIPAL]
    tenant, cls = principal.tenant, principal.priority_class
    rid = (rid_prefix or ("chatcmpl-" if chat else "cmpl-")) + uuid.uuid4().hex[:24]
    created = int(time.time())
    prompts = await prepare_prompts(engine, body, chat, plan)
    reserved = reservation([len(p) for p in prompts], sampling_params.n, sampling_params.max_tokens, engine.info.max_model_len,
                           app[CONFIG].default_reservation_tokens)
    metrics = app[METRICS]
    timer = RequestTimer(metrics, tenant.name, cls.name)
    inflight = app[INFLIGHT]
    cap = app[CONFIG].max_inflight_by_priority.get(cls.priority)
    if cap is not None and inflight.get(cls.priority, 0) >= cap:
        metrics.rejections.labels(tenant.name, cls.name, "overloaded").inc()
        timer.finish(503, None)
        raise APIError(503, f"server overloaded for priority class {cls.name!r}; retry shortly", "server_error",
                       code="overloaded", headers={"Retry-After": "2"})
    # Counted from here, before any await, so a burst cannot all pass the check above at once.
    # Engine sequences, not HTTP requests: n copies of each prompt load the engine as n requests would.
    sequences = len(prompts) * sampling_params.n
    inflight[cls.priority] = inflight.get(cls.priority, 0) + sequences
    try:
        grant = await app[SETTLEMENTS].acquire(app[QUOTAS], tenant.id, reserved)
    except APIError as refused:
        inflight[cls.priority] -= sequences
        metrics.rejections.labels(tenant.name, cls.name, refused.code or str(refused.status)).inc()
        timer.finish(refused.status, None)
        raise
    except BaseException:
        inflight[cls.priority] -= sequences
        raise
    request[TIMER] = timer
    request[RATE_HEADERS] = rate_limit_headers(grant)
    usage: UsageRecord | None = None
    started_at = utcnow()
    if body.stream:  # its usage is journaled as it is delivered, so a killed gateway still bills it
        request[JOURNALED] = JournaledStream(app[STREAM_JOURNAL], grant, UsageRecord(
            tenant_id=tenant.id, request_id=rid, model=_model_name(app), prompt_tokens=0, completion_tokens=0,
            key_id=principal.key.id, started_at=started_at))
    status = 500
    stream = None
    choices = request[CHOICES] = Choices([len(p) for p in prompts], sampling_params.n, whole=not body.stream)
    try:
        # Compiled once admitted (counted and rate-limited), on a worker thread, within a time budget.
        await check_schema(sampling_params.structured_output, body, forced_call=plan is not None and plan.structured_output is not None)
        stream = start_streams(
            engine, prompts, sampling_params, rid, principal.policy(order_in_class(body)), output_view(body))
        response = await (respond or _respond)(request, body, chat, stream, rid, created, plan)
        status = 200
        return response
    except APIError as err:
        status = err.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away; the engine request was aborted
        raise
    finally:
        inflight[cls.priority] -= sequences
        started = choices.started
        if status == 200 and started and not choices.finished:
            status = 503  # a stream the engine failed mid-way: 200 went out with the headers, the row says so
        elif status == 200 and choices.failed:
            status = 500  # a stream whose output failed (its error event went out after the 200)
        if started:
            usage = UsageRecord(
                tenant_id=tenant.id, request_id=rid, model=_model_name(app), prompt_tokens=choices.num_prompt_tokens,
                completion_tokens=choices.num_output_tokens, cached_prompt_tokens=choices.num_cached_tokens,
                key_id=principal.key.id, finish_reason=choices.finish_reason or "abort", started_at=started_at,
                finished_at=utcnow(), http_status=status,
            )
        timer.finish(status, usage)
        if stream is None or choices.finished:
            # Nothing left to abort: hand the usage over now, with no await before it. Going through
            # a shielded task costs every request a turn of the event loop behind whatever else is
            # ready, which was the gateway's largest share of its slowest requests under load.
            app[LEDGER].submit(grant, usage)
            if stream is not None:
                await stream.aclose()  # a finished stream closes without suspending
        else:
            # Created before any await, so a second cancellation cannot skip it.
            await asyncio.shield(app[SETTLEMENTS].run(_close_and_settle(app, stream, grant, usage)))


async def _close_and_settle(app: web.Application, stream, grant, usage: UsageRecord | None) -> None:
    if stream is not None:
        # Closing the stream aborts the engine request if it has not finished (client gone, error):
        # its KV blocks come back at once.
        await stream.aclose()
    app[LEDGER].submit(grant, usage)  # usage None: the request never ran, the reservation is released


def reservation(prompt_lengths: list[int], n: int, max_tokens: int | None, max_model_len: int,
                default_tokens: int) -> int:
    """Tokens to reserve at admission: each prompt once, plus ``n`` outputs of ``max_tokens`` each (never more
    than the context leaves room for). Without ``max_tokens`` an output may run to the end of the context;
    ``default_tokens`` of it are reserved, and the settle charges what it really used."""
    total = 0
    for length in prompt_lengths:
        room = max_model_len - length
        total += length + n * min(max_tokens if max_tokens is not None else default_tokens, room)
    return total


def _parsers(config: GatewayConfig) -> ParserChoice:
    return ParserChoice(config.tool_call_parser, config.reasoning_parser)


async def _respond(request: web.Request, body, chat: bool, stream, rid: str, created: int,
                   plan: ChatPlan | None = None) -> web.StreamResponse:
    """Run the merged engine streams to a JSON body or SSE events; request[CHOICES] keeps every choice's
    latest output for usage."""
    app = request.app
    model = _model_name(app)
    fingerprint = system_fingerprint(app[ENGINE].config, model)
    choices = request[CHOICES]

    try:
        first = await anext(stream)
    except RequestRejectedError as e:
        raise APIError(400, str(e), param="messages" if chat else "prompt") from None
    except EngineError as e:
        raise engine_down(e) from None

    timer = request[TIMER]
    timer.delta(first=True, queue_time_s=first[1].queue_time_s)

    if not body.stream:
        async def from_first():
            yield first
            async for item in stream:
                yield item
                timer.delta(first=False)

        # collect records each output in request[CHOICES], so usage is settled even if the client goes away.
        whole = await collect(from_first(), chat, choices)
        body_json = json_response(completion_body(rid, created, model, chat, whole, body, fingerprint, plan))
        body_json.headers.update(request[RATE_HEADERS])
        return body_json

    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **request[RATE_HEADERS]}
    )
    response.headers[REQUEST_ID_HEADER] = request[REQUEST_ID]  # sent at prepare, before the middleware sees it
    await response.prepare(request)
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    # vLLM's continuous_usage_stats: every chunk carries the request's usage so far, not null.
    usage_per_chunk = include_usage and body.stream_options.continuous_usage_stats
    index = choices.add(*first)  # so usage is settled even if the client goes away mid-stream
    delta = first[1]
    prompts = choice_prompts(body, chat, choices.n)
    offsets: dict[int, CompletionLogprobs] = {}  # per choice: text_offset runs on across its chunks
    parsers = {}  # per choice: its chat output parser (tool calls, reasoning)
    announced: set[int] = set()  # chat choices that have sent a chunk (the first carries the role)
    while True:
        if delta.finish_reason == "error":
            return await _write_error_event(response, output_failed())
        first_chunk = index not in offsets
        if plan is None:
            out_choices = [output_choice(chat, body, delta, index, True, first_chunk,
                                         offsets.setdefault(index, CompletionLogprobs()), prompts[index])]
        else:
            offsets.setdefault(index, CompletionLogprobs())
            parser = parsers.setdefault(index, plan.output_parser())
            made = parser.num_calls
            piece = parser.feed(delta.text)
            if delta.finished:
                piece += parser.finish()
            finish = chat_finish_reason(delta.finish_reason, parser.num_calls > 0) if delta.finished else None
            out_choices = stream_choices(piece, finish, made, plan, chat_logprobs(delta.logprobs), index,
                                         first=index not in announced)
            if out_choices:
                announced.add(index)
            if finish is not None:
                out_choices[-1]["stop_reason"] = delta.stop_reason if delta.finish_reason == "stop" else None
        # Journaled before it is written: a gateway killed between the two bills this chunk (as a client that
        # leaves mid-stream is billed what was generated), never less than the client received.
        request[JOURNALED].delivered(choices)
        for k, one in enumerate(out_choices):
            event = {"id": rid, "object": chunk_obj, "created": created, "model": model,
                     "system_fingerprint": fingerprint, "choices": [one]}
            if chat and k == 0 and delta.prompt_logprobs is not None and body.prompt_logprobs is not None:
                event["prompt_logprobs"] = prompt_logprobs_list(delta.prompt_logprobs, body)
            if include_usage:
                event["usage"] = choices.usage() if usage_per_chunk else None
            await response.write(b"data: " + msgspec.json.encode(event) + b"\n\n")
        if choices.finished:
            break
        try:
            p, delta = await anext(stream)
        except EngineError as e:
            return await _write_error_event(response, engine_down(e))  # engine_failed if the step failed
        index = choices.add(p, delta)
        timer.delta(first=False)
    if include_usage:  # OpenAI's shape: a last chunk with no choices and the request's usage
        event = {"id": rid, "object": chunk_obj, "created": created, "model": model, "system_fingerprint": fingerprint,
                 "choices": [], "usage": choices.usage()}
        await response.write(b"data: " + msgspec.json.encode(event) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _run(request, decode_body(await read_body(request), CompletionRequest), chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _run(request, decode_body(await read_body(request), ChatCompletionRequest), chat=True)


def create_app(config: GatewayConfig, engine: EngineClient) -> web.Application:
    """The app; the policy store and the engine process start with the app and stop with it."""
    http_protocol.install(config.max_connections)
    # Middleware order: requests in flight (for the drain) -> request id -> error mapping -> auth. Admission
    # (quotas, overload) runs in the handler, after the body is parsed, because the reservation depends on
    # max_tokens and the prompt.
    app = web.Application(
        middlewares=[track_open_requests, request_id_middleware, error_middleware, auth_middleware, count_refusals],
        client_max_size=config.max_request_bytes,
    )
    app[CONFIG] = config
    app[SERVING_SINCE] = int(time.time())
    app[BODY_TIMEOUT_S] = config.body_timeout_s
    app[ENGINE] = engine
    app[INFLIGHT] = {}
    app[DRAINING] = asyncio.Event()
    app[OPEN_REQUESTS] = {}

    async def drain(app: web.Application) -> None:
        app[DRAINING].set()  # new requests on kept-alive connections get 503 from now on
        cut = await drain_open_requests(app, config.drain_timeout_s)
        if cut:
            logger.info("drain timeout (%gs): %d request(s) still running were cut", config.drain_timeout_s, cut)

    app.on_shutdown.append(drain)

    async def store_lifecycle(app: web.Application):
        store = TenantStore.open(config.database_url)
        app[AUTHENTICATOR] = Authenticator(store, ttl_s=config.auth_cache_ttl_s)
        app[QUOTAS] = QuotaManager(store, policy_ttl_s=config.policy_cache_ttl_s)
        app[SETTLEMENTS] = Settlements()
        # At most 100 ledger transactions a second: each holds the event loop for about 1 ms, so usage
        # writes never starve request handling.
        app[LEDGER] = UsageLedger(app[QUOTAS], min_interval_s=0.01, journal_dir=Path(config.data_dir) / "usage-journal")
        await app[LEDGER].replay_journal()  # usage a previous run could not write (database down at its stop)
        app[STREAM_JOURNAL] = StreamJournal(Path(config.data_dir) / "usage-journal")
        await app[STREAM_JOURNAL].replay(app[QUOTAS])  # streams a killed run had delivered: billed once
        app[LEDGER].on_written = app[STREAM_JOURNAL].settled
        app[LEDGER].start()
        app[BATCH_STORE] = BatchStore(store, app[QUOTAS], model=_model_name(app))
        app[QUOTA_MANAGER] = app[QUOTAS]
        yield
        await app[SETTLEMENTS].drain()  # every finished or cut request has handed its usage to the ledger
        await app[LEDGER].close()  # ... and the ledger has written it
        app[STREAM_JOURNAL].close()
        await app[BATCH_STORE].close()
        await store.close()

    async def engine_lifecycle(app: web.Application):
        await engine.start()
        logger.info("serving %s (%s)", _model_name(app), engine.info.architecture)
        supervisors = [asyncio.create_task(supervise(name, replica, config.engine_restart_backoff_s,
                                                     config.engine_restart_backoff_max_s))
                       for name, replica in replicas_of(engine)]
        yield
        for task in supervisors:
            task.cancel()
        await asyncio.gather(*supervisors, return_exceptions=True)
        await engine.shutdown()

    async def batch_lifecycle(app: web.Application):
        """The batch runner starts once the engine is up and stops before it."""
        try:
            batch_priority = (await app[BATCH_STORE].store.get_class("batch")).priority
        except NotFound:
            batch_priority = max(c.priority for c in await app[BATCH_STORE].store.list_classes())
        # Lines queue inside every replica (the router spreads them by load), so twice each one's slots.
        inflight = config.batch_max_inflight or 2 * engine.config.max_num_seqs * len(replicas_of(engine))
        runner = BatchRunner(app[BATCH_STORE], engine, lambda: _model_name(app), BatchRunnerConfig(
            lease_s=config.batch_lease_s, max_inflight=inflight, poll_s=config.batch_poll_s,
            batch_priority=batch_priority, expiry_check_s=min(5.0, config.batch_completion_window_s / 4)), wake=app[BATCH_WAKE])
        task = asyncio.create_task(runner.run(), name="batch-runner")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    app.cleanup_ctx.append(store_lifecycle)
    app.cleanup_ctx.append(engine_lifecycle)
    app.cleanup_ctx.append(batch_lifecycle)
    # After every cleanup context above has started (aiohttp runs them as the first startup signal).
    app.on_startup.append(freeze_startup_heap)
    app.on_cleanup.append(unfreeze_heap)  # after the cleanup contexts have closed everything
    app[DATA_DIR] = Path(config.data_dir)
    app[MAX_FILE_BYTES] = config.batch_max_file_bytes
    app[BATCH_WAKE] = asyncio.Event()
    app[BATCH_SETTINGS] = {"model": lambda: _model_name(app), "max_lines": config.batch_max_lines,
                           "window_s": config.batch_completion_window_s, "default_max_tokens": 1024}
    files_api.add_routes(app)
    batch_api.add_routes(app)
    responses_api.add_routes(app, _run, lambda: _model_name(app), config.responses_retention_s)
    app[METRICS] = GatewayMetrics(engine)
    app.cleanup_ctx.append(serve_metrics)
    if config.metrics_token:
        app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_get("/openapi.json", openapi_endpoint)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", retrieve_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    tokenization.add_routes(app, ENGINE, _check_model)
    return app
