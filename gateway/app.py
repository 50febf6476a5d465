"""The aiohttp application: OpenAI-compatible routes over the engine process.

Tenants, keys, quotas and priorities arrive with the tenants/gateway issues;
this is the single-tenant serving path they build on.
"""

import logging
import time
import uuid

import msgspec
from aiohttp import web

from engine.async_engine import AsyncEngine, EngineError, RequestRejectedError
from engine.protocol import ChatTurn
from gateway.config import GatewayConfig
from gateway.errors import APIError, error_middleware
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest, decode_body, sampling_spec

logger = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", AsyncEngine)
CONFIG = web.AppKey("config", GatewayConfig)


def _json(body: dict, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json")


def _model_name(app: web.Application) -> str:
    config, engine = app[CONFIG], app[ENGINE]
    return config.served_model_name or engine.config.model.rstrip("/").rsplit("/", 1)[-1]


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine.dead:
        raise APIError(503, f"engine unavailable: {engine.dead}", "server_error", headers={"Retry-After": "5"})
    return _json({"status": "ok"})


async def list_models(request: web.Request) -> web.Response:
    info = request.app[ENGINE].info
    card = {"id": _model_name(request.app), "object": "model", "created": 0, "owned_by": "moegate",
            "max_model_len": info.max_model_len}
    return _json({"object": "list", "data": [card]})


def _check_model(app: web.Application, model: str | None) -> None:
    if model is not None and model != _model_name(app):
        raise APIError(404, f"model {model!r} does not exist; this server serves {_model_name(app)!r}", param="model",
                       code="model_not_found")


async def _run(request: web.Request, body, chat: bool) -> web.StreamResponse:
    app = request.app
    _check_model(app, body.model)
    spec = sampling_spec(body)
    engine = app[ENGINE]
    if engine.dead:
        raise APIError(503, f"engine unavailable: {engine.dead}", "server_error", headers={"Retry-After": "5"})
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    messages = [ChatTurn(m.role, m.content) for m in body.messages] if chat else None
    stream = engine.generate("" if chat else body.prompt, spec, request_id=rid, messages=messages)
    obj = "chat.completion" if chat else "text_completion"
    model = _model_name(app)

    def choice(text: str, finish: str | None, delta: bool) -> dict:
        if not chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        key = "delta" if delta else "message"
        return {"index": 0, key: {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}

    try:
        first = await anext(stream)
    except RequestRejectedError as e:
        raise APIError(400, str(e), param="messages" if chat else "prompt") from None
    except EngineError as e:
        raise APIError(503, f"engine unavailable: {e}", "server_error", headers={"Retry-After": "5"}) from None

    if not body.stream:
        text, last = [first.new_text], first
        async for delta in stream:
            text.append(delta.new_text)
            last = delta
        usage = {"prompt_tokens": last.num_prompt_tokens, "completion_tokens": last.num_output_tokens,
                 "total_tokens": last.num_prompt_tokens + last.num_output_tokens}
        return _json({"id": rid, "object": obj, "created": created, "model": model,
                      "choices": [choice("".join(text), last.finish_reason, False)], "usage": usage})

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"
    delta = first
    while True:
        event = {"id": rid, "object": chunk_obj, "created": created, "model": model,
                 "choices": [choice(delta.new_text, delta.finish_reason, True)]}
        await response.write(b"data: " + msgspec.json.encode(event) + b"\n\n")
        if delta.finished:
            break
        delta = await anext(stream)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _run(request, decode_body(await request.read(), CompletionRequest), chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _run(request, decode_body(await request.read(), ChatCompletionRequest), chat=True)


def create_app(config: GatewayConfig, engine: AsyncEngine) -> web.Application:
    """The app; the engine process starts with the app and stops with it."""
    app = web.Application(middlewares=[error_middleware], client_max_size=config.max_request_bytes)
    app[CONFIG] = config
    app[ENGINE] = engine

    async def engine_lifecycle(app: web.Application):
        await engine.start()
        logger.info("serving %s (%s)", _model_name(app), engine.info.architecture)
        yield
        await engine.shutdown()

    app.cleanup_ctx.append(engine_lifecycle)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app
