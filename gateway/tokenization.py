"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, with the served model's tokenizer.

/tokenize returns the token ids the generation routes would run for the same
prompt or messages (chat template included; each image's placeholder repeated
to its token count, as the chat route runs it), so clients can count tokens
before they send a request; /detokenize turns token ids back into text.
Both need an API key like the /v1/ routes (``gateway.auth.KEYED_PATHS``) and count against the tenant's request
rate and concurrency (``gateway.plain_admission``).
"""

from typing import Annotated

import msgspec
from aiohttp import web

from engine.serving.async_engine import EngineError
from engine.text.harmony_vocab import HarmonyVocabError
from engine.text.prompts import InvalidPrompt
from gateway.chat_plan import HARMONY, ParserChoice, chat_input
from gateway.chat_images import DEFAULT_IMAGE_LIMITS, ImageRef, expand_placeholders, image_model_of
from gateway.completion import engine_down, read_image_refs
from gateway.errors import APIError, read_body
from gateway.openai_schema import (
    ChatCompletionRequest, ChatMessage, NonEmptyText, TokenId, TokenIds, decode_body,
)
from gateway.plain_admission import admitted
from gateway.replies import json_response

class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Either ``prompt`` (text or token ids) or ``messages`` (rendered through the chat template)."""

    model: str | None = None
    prompt: NonEmptyText | TokenIds | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None = None
    add_generation_prompt: bool | None = None  # messages only; default true


def _chat(engine, body: TokenizeRequest, parsers: ParserChoice, images: list[ImageRef]):
    """The messages as the chat route renders them (tool calls, tool results and names included): through
    openai-harmony for gpt-oss, else the template; their image parts added to ``images``."""
    architecture = engine.info.architecture if engine.info is not None else None
    chat = chat_input(ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt),
                      images=images)
    chat.harmony = HARMONY in parsers.resolve(engine.chat_template(), architecture)
    return chat


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[TokenId]


def add_routes(app: web.Application, engine_key, check_model, parsers: ParserChoice | None = None,
               remote_images_key: web.AppKey | None = None, image_limits=None) -> None:
    """Register both routes; ``await check_model(request, name)`` raises the 404 for a model the caller is not
    served (the base model and the LoRA adapters it may use tokenize alike); ``parsers``: the
    server's parser settings (a gpt-oss chat is rendered by openai-harmony, as the chat route renders it);
    ``remote_images_key``: the app's ``RemoteImagePolicy`` (images at remote URLs are fetched to be counted, as
    the chat route fetches them; None: refused); ``image_limits(request)``: the limits the request's images are
    read under, awaited only when it has images (None: ``DEFAULT_IMAGE_LIMITS``)."""

    async def tokenize(request: web.Request) -> web.Response:
        async with admitted(request):  # a request of the tenant's rate: rendering and images cost the server
            return await _tokenize(request)

    async def _tokenize(request: web.Request) -> web.Response:
        body = decode_body(await read_body(request), TokenizeRequest)
        await check_model(request, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either `prompt` (text or token ids) or `messages`, not both",
                           param="prompt" if body.prompt is not None else "messages")
        if body.add_generation_prompt is not None and body.messages is None:
            raise APIError(400, "add_generation_prompt applies to `messages` only; leave it out with `prompt`",
                           param="add_generation_prompt")
        engine = request.app[engine_key]
        images: list[ImageRef] = []
        try:
            if body.messages is not None:
                chat = _chat(engine, body, parsers or ParserChoice(), images)
                if images and chat.harmony:
                    raise APIError(400, f"{images[0].where}: this model reads text only", param=images[0].where)
                remote = request.app.get(remote_images_key) if remote_images_key is not None else None
                limits = await image_limits(request) if images and image_limits is not None else DEFAULT_IMAGE_LIMITS
                decoded = await read_image_refs(engine, images, remote, limits)  # a 400 naming the part
                ids = await engine.prepare(None, chat, body.add_generation_prompt is not False)
                if decoded:
                    ids = expand_placeholders(ids, image_model_of(engine).image_token_id, decoded)
            else:
                ids = await engine.prepare(body.prompt, None)
        except InvalidPrompt as e:
            raise APIError(400, e.message, param=e.param) from None
        except HarmonyVocabError as e:
            raise APIError(500, str(e), "server_error", code="harmony_vocabulary") from None
        except EngineError as e:
            raise engine_down(e) from None
        info = engine.info
        if info is None:
            raise engine_down("the engine is starting")
        return json_response({"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids})

    async def detokenize(request: web.Request) -> web.Response:
        async with admitted(request):
            return await _detokenize(request)

    async def _detokenize(request: web.Request) -> web.Response:
        body = decode_body(await read_body(request), DetokenizeRequest)
        await check_model(request, body.model)
        try:
            text = await request.app[engine_key].detokenize(body.tokens)
        except InvalidPrompt as e:
            raise APIError(400, e.message, param=e.param) from None
        except EngineError as e:
            raise engine_down(e) from None
        return json_response({"prompt": text})

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
