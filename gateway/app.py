"""The aiohttp application: OpenAI-compatible routes over the engine process.

Middleware order: error mapping -> auth (key -> tenant) -> handler; a
generation handler runs the request through the gateway's pipeline
(``gateway/pipeline.py``) with the live API's admission
(``gateway/live_admission.py``: reserve prompt + max_tokens, settle the real
counts at the end), which gives the engine request its tenant's policy
(priority, weight, preemptibility, cache salt).
"""

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path

from aiohttp import web

from engine.serving.async_engine import EngineError, RequestRejectedError
from engine.serving.client import EngineClient
from gateway.admission import INFLIGHT, QUOTAS, SETTLEMENTS, Settlements
from gateway.slo_admission import SLO, SloAdmission
from gateway.app_keys import CONFIG, DRAINING, ENGINE, LEDGER, SCALER, SUPERVISORS
from gateway.auth import AUTHENTICATOR, PRINCIPAL, Authenticator, auth_middleware, require_token
from gateway import admin_lora, admin_replicas, cors, pipeline
from gateway.replies import json_response
from gateway.chat_plan import ChatPlan, ParserChoice
from gateway.completion import collect, engine_down, load_harmony, rejected
from gateway.config import GatewayConfig
from gateway.drain import OPEN_REQUESTS, drain_open_requests, track_open_requests
from gateway.engine_supervisor import Supervisors
from gateway.errors import BODY_TIMEOUT_S, error_middleware, read_body, request_id_middleware
from gateway.heap import freeze_startup_heap, unfreeze_heap
from gateway.image_policy import IMAGE_LIMITS, image_limits_for, server_image_limits, tenant_image_limits
from gateway.large_replies import whole_body_json
from gateway.live_admission import LiveAdmission
from gateway.lora_adapters import ADAPTERS, AdapterCatalog
from gateway import http_protocol
from gateway.metrics import METRICS, GatewayMetrics
from gateway.pipeline import Adapter, Outputs, Planned
from gateway.request_keys import CHOICES, RATE_HEADERS, SERVED_MODEL, TIMER
from gateway.refusals import count_refusals
from gateway.remote_images import REMOTE_IMAGES, RemoteImagePolicy
from gateway.replica_router import replicas_of, unresponsive_after_s
from gateway.response_bodies import completion_body, system_fingerprint
from gateway.sse import stream_reply
from gateway.stream_journal import STREAM_JOURNAL, StreamJournal
from gateway.openapi import openapi_document
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest, decode_body
from gateway.usage_ledger import UsageLedger
from gateway.batch import batches as batch_api, files as files_api
from gateway.responses import routes as responses_api
from gateway import tokenization
from gateway.batch.batches import BATCH_SETTINGS, BATCH_WAKE
from gateway.batch.runner import BatchRunner, BatchRunnerConfig
from gateway.batch.files import BATCH_STORE, DATA_DIR, MAX_FILE_BYTES
from tenants.batch_store import BatchStore
from tenants.store import NotFound
from tenants.quota import QuotaManager
from tenants.store import TenantStore

logger = logging.getLogger(__name__)

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
    require_token(request, request.app[CONFIG].metrics_token, "metrics")
    return request.app[METRICS].render()


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


def _model_card(app: web.Application, adapter: str | None = None) -> dict:
    """The base model's card, or an adapter's: its ``parent`` is the base model (vLLM's LoRA cards)."""
    base = _model_name(app)
    card = {"id": adapter or base, "object": "model", "created": app[SERVING_SINCE], "owned_by": "moegate",
            "max_model_len": app[ENGINE].info.max_model_len}
    if adapter is not None:
        card["parent"] = base
    return card


async def list_models(request: web.Request) -> web.Response:
    """The base model and every LoRA adapter the caller may use."""
    usable = await request.app[ADAPTERS].usable(request[PRINCIPAL].tenant.id)
    cards = [_model_card(request.app)] + [_model_card(request.app, name) for name in sorted(usable)]
    return json_response({"object": "list", "data": cards})


async def retrieve_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: the base model's or a usable adapter's card, or 404 ``model_not_found``."""
    adapter, _ = await request.app[ADAPTERS].resolve(request[PRINCIPAL].tenant.id, request.match_info["model"],
                                                     _model_name(request.app))
    return json_response(_model_card(request.app, adapter))


async def _check_model(request: web.Request, model: str | None) -> None:
    """``/tokenize``'s and ``/detokenize``'s model: the base model or an adapter the caller may use (whose tokens are
    the base model's); the unknown-model 404 otherwise, as on the generation routes."""
    await request.app[ADAPTERS].resolve(request[PRINCIPAL].tenant.id, model, _model_name(request.app))


async def _run(request: web.Request, body, chat: bool, respond=None, rid_prefix: str | None = None) -> web.StreamResponse:
    """One live request through the gateway's pipeline (``gateway/pipeline.py``), admitted and settled by
    ``LiveAdmission``; ``respond`` (default: the chat / completion reply) writes the reply, ``rid_prefix`` starts
    its id (the Responses API runs as chat with its own)."""
    app = request.app
    base = _model_name(app)
    adapter, adapter_path = await app[ADAPTERS].resolve(request[PRINCIPAL].tenant.id, body.model, base)
    request[SERVED_MODEL] = adapter or base
    rid = (rid_prefix or ("chatcmpl-" if chat else "cmpl-")) + uuid.uuid4().hex[:24]
    created = int(time.time())
    reply = respond or _respond

    def respond_with(planned: Planned, outputs: Outputs) -> Awaitable[web.StreamResponse]:
        return reply(request, body, chat, outputs, rid, created, planned.plan)

    return await pipeline.run(app[ENGINE], body, chat, _parsers(app[CONFIG]),
                              LiveAdmission(request, rid, base, adapter), rid, respond_with,
                              adapter=Adapter(app[ADAPTERS], adapter, adapter_path) if adapter is not None else None,
                              remote_images=app[REMOTE_IMAGES],
                              image_limits=image_limits_for(app[QUOTAS], app[IMAGE_LIMITS],
                                                            request[PRINCIPAL].tenant.id))


async def _tokenize_image_limits(request: web.Request):
    """``/tokenize``'s image limits: the caller's tenant's, as its chat requests have them."""
    return await tenant_image_limits(request.app[QUOTAS], request.app[IMAGE_LIMITS], request[PRINCIPAL].tenant.id)


def _parsers(config: GatewayConfig) -> ParserChoice:
    return ParserChoice(config.tool_call_parser, config.reasoning_parser)


async def _respond(request: web.Request, body, chat: bool, stream, rid: str, created: int,
                   plan: ChatPlan | None = None) -> web.StreamResponse:
    """Run the merged engine streams to a JSON body or SSE events; request[CHOICES] keeps every choice's
    latest output for usage."""
    app = request.app
    model = request.get(SERVED_MODEL) or _model_name(app)  # an adapter's name when the request named one
    fingerprint = system_fingerprint(app[ENGINE].config, model)
    first = await _first_output(stream, chat)
    request[TIMER].delta(first=True, queue_time_s=first[1].queue_time_s)
    if body.stream:
        return await stream_reply(request, body, chat, stream, first, rid, created, model, fingerprint, plan)
    return await _whole_reply(request, body, chat, stream, first, rid, created, model, fingerprint, plan)


async def _first_output(stream, chat: bool) -> tuple:
    """The streams' first (choice, output): a prompt the engine refused is a 400, an engine down a 503."""
    try:
        return await anext(stream)
    except RequestRejectedError as e:
        raise rejected(e, "messages" if chat else "prompt") from None
    except EngineError as e:
        raise engine_down(e) from None


async def _whole_reply(request: web.Request, body, chat: bool, stream, first: tuple, rid: str, created: int,
                       model: str, fingerprint: str, plan: ChatPlan | None) -> web.Response:
    timer = request[TIMER]

    async def from_first():
        yield first
        async for item in stream:
            yield item
            timer.delta(first=False)

    # collect records each output in request[CHOICES], so usage is settled even if the client goes away.
    whole = await collect(from_first(), chat, request[CHOICES])
    encoded = await whole_body_json(whole, lambda: completion_body(rid, created, model, chat, whole, body, fingerprint,
                                                                   plan))
    reply = web.Response(body=encoded, content_type="application/json")
    reply.headers.update(request[RATE_HEADERS])
    return reply


async def completions(request: web.Request) -> web.StreamResponse:
    return await _run(request, decode_body(await read_body(request), CompletionRequest), chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _run(request, decode_body(await read_body(request), ChatCompletionRequest), chat=True)


def create_app(config: GatewayConfig, engine: EngineClient, scaler=None) -> web.Application:
    """The app; the policy store and the engine process start with the app and stop with it. ``scaler``: a
    ``gateway.replica_scaling.ReplicaScaler`` over ``engine`` to add and remove replicas while serving (None:
    the replicas are fixed)."""
    http_protocol.install(config.max_connections)
    # Middleware order: requests in flight (for the drain) -> request id -> a browser's preflight (before the
    # key is asked for) -> error mapping -> auth. Admission (quotas, overload) runs in the handler, after the body
    # is parsed, because the reservation depends on max_tokens and the prompt.
    app = web.Application(
        middlewares=[track_open_requests, request_id_middleware, cors.preflight, error_middleware, auth_middleware,
                     count_refusals],
        client_max_size=config.max_request_bytes,
    )
    cors.install(app, config.allowed_origins)
    app[CONFIG] = config
    app[REMOTE_IMAGES] = RemoteImagePolicy.of(config)
    app[IMAGE_LIMITS] = server_image_limits(config)
    app[SERVING_SINCE] = int(time.time())
    app[BODY_TIMEOUT_S] = config.body_timeout_s
    app[ENGINE] = engine
    if scaler is not None:
        app[SCALER] = scaler
    app[INFLIGHT] = {}
    app[DRAINING] = asyncio.Event()
    app[OPEN_REQUESTS] = {}
    app.on_shutdown.append(_drain)
    app.cleanup_ctx.append(_store_lifecycle)
    app.cleanup_ctx.append(_engine_lifecycle)
    app.cleanup_ctx.append(_batch_lifecycle)
    # After every cleanup context above has started (aiohttp runs them as the first startup signal).
    app.on_startup.append(freeze_startup_heap)
    app.on_cleanup.append(unfreeze_heap)  # after the cleanup contexts have closed everything
    _configure_batch_api(app, config)
    files_api.add_routes(app)
    batch_api.add_routes(app)
    responses_api.add_routes(app, _run, lambda: _model_name(app), config.responses_retention_s)
    app[METRICS] = GatewayMetrics(engine)
    app[SLO] = SloAdmission(engine)
    app.cleanup_ctx.append(serve_metrics)
    _add_routes(app, config)
    return app


async def _drain(app: web.Application) -> None:
    config = app[CONFIG]
    app[DRAINING].set()  # new requests on kept-alive connections get 503 from now on
    cut = await drain_open_requests(app, config.drain_timeout_s)
    if cut:
        logger.info("drain timeout (%gs): %d request(s) still running were cut", config.drain_timeout_s, cut)


async def _store_lifecycle(app: web.Application):
    """Cleanup context: the policy store, auth, quotas, the usage ledger and stream journal (each replayed), the
    Batch API's store; at the end, every request's usage written before the store closes."""
    config = app[CONFIG]
    store = TenantStore.open(config.database_url)
    app[AUTHENTICATOR] = Authenticator(store, ttl_s=config.auth_cache_ttl_s)
    app[ADAPTERS] = AdapterCatalog(store, ttl_s=config.policy_cache_ttl_s)
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
    yield
    await app[SETTLEMENTS].drain()  # every finished or cut request has handed its usage to the ledger
    await app[LEDGER].close()  # ... and the ledger has written it
    app[STREAM_JOURNAL].close()
    await app[BATCH_STORE].close()
    await store.close()


async def _engine_lifecycle(app: web.Application):
    """Cleanup context: the engine (every replica) and a supervisor per replica that restarts it."""
    config, engine = app[CONFIG], app[ENGINE]
    await app[ADAPTERS].configure(replicas_of(engine))  # the database's adapters, named at the engines' start
    if (scaler := app.get(SCALER)) is not None:
        scaler.before_start = app[ADAPTERS].configure  # and at the start of each replica added later
    await engine.start()
    try:
        await load_harmony(engine, _parsers(config))
    except EngineError:  # the model cannot be served as configured: stop its engine, then the server
        await engine.shutdown()
        raise
    logger.info("serving %s (%s)", _model_name(app), engine.info.architecture)
    forget = asyncio.create_task(_forget_removed_adapters(app))
    supervisors = app[SUPERVISORS] = Supervisors(config.engine_restart_backoff_s, config.engine_restart_backoff_max_s)
    for name, replica in replicas_of(engine):
        supervisors.start(name, replica)
    yield
    forget.cancel()
    await asyncio.gather(forget, return_exceptions=True)
    if scaler is not None:
        await scaler.close()  # a replica starting or draining for a scaling call ends with the server
    await supervisors.stop_all()
    await engine.shutdown()


async def _forget_removed_adapters(app: web.Application) -> None:
    """Every policy TTL: engines drop the adapters the database no longer holds (``adapter remove`` from the CLI)."""
    while True:
        await asyncio.sleep(max(app[CONFIG].policy_cache_ttl_s, 0.05))
        try:
            await app[ADAPTERS].forget_removed(replicas_of(app[ENGINE]))
        except Exception:  # the database away for a moment: the next round tries again
            logger.warning("could not check for removed LoRA adapters", exc_info=True)


async def _batch_lifecycle(app: web.Application):
    """Cleanup context: the batch runner starts once the engine is up and stops before it."""
    config, engine = app[CONFIG], app[ENGINE]
    try:
        batch_priority = (await app[BATCH_STORE].store.get_class("batch")).priority
    except NotFound:
        batch_priority = max(c.priority for c in await app[BATCH_STORE].store.list_classes())
    # Lines queue inside every replica (the router spreads them by load), so twice each one's slots.
    inflight = config.batch_max_inflight or 2 * engine.config.max_num_seqs * len(replicas_of(engine))
    runner = BatchRunner(app[BATCH_STORE], engine, lambda: _model_name(app), BatchRunnerConfig(
        lease_s=config.batch_lease_s, max_inflight=inflight, poll_s=config.batch_poll_s,
        batch_priority=batch_priority, expiry_check_s=min(5.0, config.batch_completion_window_s / 4),
        remote_images=app[REMOTE_IMAGES]), wake=app[BATCH_WAKE],
        cache_share=app[QUOTAS].cache_share, adapters=app[ADAPTERS],
        image_limits=lambda tenant_id: tenant_image_limits(app[QUOTAS], app[IMAGE_LIMITS], tenant_id))
    task = asyncio.create_task(runner.run(), name="batch-runner")
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _configure_batch_api(app: web.Application, config: GatewayConfig) -> None:
    app[DATA_DIR] = Path(config.data_dir)
    app[MAX_FILE_BYTES] = config.batch_max_file_bytes
    app[BATCH_WAKE] = asyncio.Event()
    app[BATCH_SETTINGS] = {"model": lambda: _model_name(app), "max_lines": config.batch_max_lines,
                           "window_s": config.batch_completion_window_s, "default_max_tokens": 1024}


def _add_routes(app: web.Application, config: GatewayConfig) -> None:
    if config.metrics_token:
        app.router.add_get("/metrics", metrics_endpoint)
    admin_lora.add_routes(app, config.admin_token, app[ENGINE], lambda: _model_name(app))
    admin_replicas.add_routes(app, config.admin_token)
    app.router.add_get("/openapi.json", openapi_endpoint)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", retrieve_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    tokenization.add_routes(app, ENGINE, _check_model, _parsers(config), REMOTE_IMAGES, _tokenize_image_limits)
