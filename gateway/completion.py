"""The engine work of one request, the steps ``gateway/pipeline.py`` puts in order for the live routes and the
Batch API: its sampling settings and prompts checked, its engine requests started and merged, run to the end;
the engine's failures as the API's errors. The bodies built from its outputs are ``gateway/response_bodies.py``'s."""

import asyncio
from collections.abc import Callable

import msgspec

from engine.serving.async_engine import EngineError, RequestRejectedError, UnreadStreamError
from engine.text.harmony_vocab import HarmonyVocabError, harmony_encoding
from engine.text.prompts import ChatInput, InvalidPrompt
from engine.core.outputs import RequestOutput
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.serving.client import EngineClient
from gateway.chat_images import (
    DEFAULT_IMAGE_LIMITS, DecodedImage, ImageLimits, ImageRef, decode_images, expand_placeholders, image_model_of,
    refuse_if_text_only,
)
from gateway.remote_images import RemoteImagePolicy, fetch_images
from gateway.choices import Choices, merged
from gateway.errors import APIError
from gateway.openai_logprobs import as_token_ids
from gateway.openai_schema import (
    check_choices, check_output_room, prompts_of, scoring_only, text_messages,
)
from gateway.chat_plan import HARMONY, ChatPlan, ParserChoice, plan as plan_chat
from gateway.response_format import format_source
from gateway.tool_parsers.think_prompt import prompt_opens_think


def chat_plan_of(engine: EngineClient, body, parsers: ParserChoice) -> ChatPlan:
    """How a chat request is rendered and read, with the parsers the served checkpoint takes; a 400 naming the
    first image part if the model reads text only."""
    architecture = engine.info.architecture if engine.info is not None else None  # None while (re)starting
    template = engine.chat_template()
    chat_plan = plan_chat(body, parsers.resolve(template, architecture))
    opened = (chat_plan.reasoning_parser in ("qwen3", "think") and template is not None
              and chat_plan.chat.add_generation_prompt)
    if opened and prompt_opens_think(template, chat_plan.chat.template_kwargs):
        chat_plan.reasoning_parser = "deepseek_r1"  # the prompt opened <think>: the output starts inside the reasoning
    refuse_if_text_only(engine, chat_plan.images)
    return chat_plan


async def read_images(engine: EngineClient, plan: ChatPlan | None, remote: RemoteImagePolicy | None = None,
                      limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> list[DecodedImage]:
    """A chat's images: remote URLs fetched under ``remote`` (None: refused; ``gateway.remote_images``), then every
    image decoded and sized on a worker thread (``gateway.chat_images``); a 400 naming the part."""
    if plan is None or not plan.images:
        return []
    return await read_image_refs(engine, plan.images, remote, limits)


async def read_image_refs(engine: EngineClient, refs: list[ImageRef], remote: RemoteImagePolicy | None = None,
                          limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> list[DecodedImage]:
    """``read_images`` for image parts gathered elsewhere (``/tokenize``'s messages)."""
    if not refs:
        return []
    model = refuse_if_text_only(engine, refs)
    fetched = await fetch_images(refs, remote, limits)
    return await asyncio.to_thread(decode_images, refs, model, limits, fetched)


async def load_harmony(engine: EngineClient, parsers: ParserChoice) -> None:
    """At start-up, for a model whose chats openai-harmony renders (gpt-oss): load the package's encoding (its
    vocabulary file written from the model's tokenizer), so that a tokenizer it cannot use stops the server with
    one line (an EngineError) instead of failing every chat."""
    if HARMONY not in parsers.resolve(engine.chat_template(), engine.info.architecture):
        return
    try:
        await engine.prepare(None, ChatInput([{"role": "user", "content": "hi"}], harmony=True))
    except HarmonyVocabError as e:
        raise EngineError(str(e)) from None
    except InvalidPrompt:  # no tokenizer: every chat is refused with its own 400
        pass


def apply_plan(sampling_params, plan: ChatPlan | None, body=None):
    """Sampling settings a chat plan needs: the forcing schema, special tokens kept for formats that use them.

    A forced call's schema replaces ``response_format``'s, as OpenAI's API does (the output is the call, so the
    answer's format has nothing to apply to; agents send both, the answer's format with every request);
    vLLM's ``guided_*`` / ``structured_outputs`` with a forced call are refused (two constraints that conflict)."""
    if plan is not None:
        if plan.structured_output is not None:
            field = format_source(body)[0] if body is not None else "response_format"
            if sampling_params.structured_output is not None and field != "response_format":
                raise APIError(400, f"tool_choice 'required' or a named function already fixes the output's format; "
                                    f"leave {field} out", param=field)
            if sampling_params.ignore_eos:
                raise APIError(400, "a forced tool call ends where its JSON does; leave ignore_eos out",
                               param="ignore_eos")
            sampling_params.structured_output = plan.structured_output
        if plan.keeps_special_tokens:
            sampling_params.skip_special_tokens = False
    return sampling_params


def engine_down(err: Exception | str) -> APIError:
    """503 for an engine that is down or restarting. A request the engine failed while running it is
    not marked for retry (``x-should-retry: false``, which the OpenAI SDKs honour): it may be the cause."""
    if isinstance(err, UnreadStreamError):
        return APIError(408, str(err), code="stream_not_read", headers={"x-should-retry": "false"})
    if isinstance(err, EngineError) and not err.retryable:
        return APIError(503, f"{err}; this request was not retried, check it before sending it again", "server_error",
                        code="engine_failed", headers={"x-should-retry": "false"})
    return APIError(503, f"engine unavailable: {err}; retry shortly", "server_error", code="engine_unavailable",
                    headers={"Retry-After": "5"})


def rejected(e: RequestRejectedError, prompt_param: str) -> APIError:
    """The 400 of a request the engine refused: naming the field it names (``model`` for an adapter it could not
    read), else ``prompt_param``, the request's prompt field."""
    return APIError(400, str(e), param=e.param or prompt_param, code=e.code)


def output_failed() -> APIError:
    """A request the engine ended with finish_reason 'error' (its output could not be produced); the
    other requests were not affected. Not marked for retry: the same request would fail the same way."""
    return APIError(500, "the engine could not produce this request's output; it was not retried",
                    "server_error", code="request_failed", headers={"x-should-retry": "false"})


NOT_RETRIED = ("engine_failed", "request_failed")  # error codes a batch line fails with instead of running again


async def prepare_prompts(engine: EngineClient, body, chat: bool, plan: ChatPlan | None = None,
                          sampling_params: SamplingParams | None = None,
                          images: list[DecodedImage] = ()) -> list[list[int]]:
    """The request's checked prompts as token ids (a chat request has one); a 400 naming the field if one
    cannot be served. A gpt-oss chat's stop tokens join ``sampling_params``' once openai-harmony, which names
    them, has rendered its prompt. A chat's ``images`` (``read_images``): each placeholder the template wrote
    expanded to its image's token count, so they count as prompt tokens."""
    prompts = await _prepared(engine, body, chat, plan, sampling_params)
    if images:
        prompts = [expand_placeholders(prompts[0], image_model_of(engine).image_token_id, list(images))]
        if engine.info is not None and len(prompts[0]) >= engine.info.max_model_len:
            raise APIError(400, f"the prompt has {len(prompts[0]):,} tokens with its images; this model serves at "
                                f"most {engine.info.max_model_len - 1:,} prompt tokens", param="messages")
    if engine.info is not None:
        check_output_room(body, [len(p) for p in prompts], engine.info.max_model_len)
    return prompts


async def _prepared(engine: EngineClient, body, chat: bool, plan: ChatPlan | None,
                    sampling_params: SamplingParams | None) -> list[list[int]]:
    try:
        if chat:
            ids = await engine.prepare(None, plan.chat if plan is not None else text_messages(body.messages))
            if plan is not None and plan.harmony and sampling_params is not None:
                stops = sorted(harmony_encoding().stop_tokens_for_assistant_actions())  # <|return|>, <|call|>
                own = sampling_params.stop_token_ids or []
                sampling_params.stop_token_ids = own + [t for t in stops if t not in own]
            return [ids]
        prompts = prompts_of(body)
        check_choices(len(prompts), body.n or 1)
        out = []
        image_model = image_model_of(engine)
        for i, prompt in enumerate(prompts):
            try:
                out.append(await engine.prepare(prompt, None))
                if image_model is not None and image_model.image_token_id in out[-1]:
                    raise InvalidPrompt(
                        f"the prompt holds this model's image placeholder token (id {image_model.image_token_id}), "
                        "and /v1/completions takes no images: send images as image_url parts of a user message to "
                        "/v1/chat/completions, or remove the placeholder from the prompt", "prompt")
            except InvalidPrompt as e:
                if len(prompts) > 1:
                    e.param, e.message = f"prompt[{i}]", f"prompt {i}: {e.message}"
                raise
        return out
    except InvalidPrompt as e:
        raise APIError(400, e.message, param=e.param) from None
    except HarmonyVocabError as e:  # the server's model cannot be served through openai-harmony
        raise APIError(500, str(e), "server_error", code="harmony_vocabulary",
                       headers={"x-should-retry": "false"}) from None
    except EngineError as e:
        raise engine_down(e) from None


def output_view(body) -> Callable[[RequestOutput], RequestOutput] | None:
    """How the request's engine outputs are shown to its client, where that differs from what the engine
    produced (None: as they are): scoring only (``max_tokens: 0``) drops the one token the engine sampled,
    so the response carries and bills the prompt alone; ``return_tokens_as_token_ids`` shows the generated
    tokens' logprobs as ``token_id:N`` (the prompt's are shown so where they are formatted: an echo of a
    token-id prompt is its tokens' texts)."""
    score, as_ids = scoring_only(body), bool(body.return_tokens_as_token_ids)
    if not score and not as_ids:
        return None

    def view(out: RequestOutput) -> RequestOutput:
        if score:
            ended = out.finish_reason in ("stop", "length")  # an error or an abort stays what it is
            out = msgspec.structs.replace(out, token_ids=[], text="", logprobs=None, num_output_tokens=0,
                                          finish_reason="length" if ended else out.finish_reason, stop_reason=None)
        if as_ids:
            out = msgspec.structs.replace(out, logprobs=as_token_ids(out.logprobs))
        return out

    return view


def order_in_class(body) -> int:
    """vLLM's request ``priority`` (larger waits longer) as the engine's place within the request's priority
    class (``RequestPolicy.order_in_class``): it can only put a request behind others of its class, never ahead
    of them (a negative value counts as 0), so a tenant's class still decides how it is served."""
    return max(body.priority or 0, 0)


async def _viewed(stream, view: Callable[[RequestOutput], RequestOutput]):
    try:
        async for out in stream:
            yield view(out)
    finally:
        await stream.aclose()


def start_streams(engine: EngineClient, prompts: list[list[int]], sampling_params: SamplingParams, rid: str, policy: RequestPolicy,
                  view: Callable[[RequestOutput], RequestOutput] | None = None, stream: bool = True,
                  images: tuple[bytes, ...] = ()):
    """One engine request per prompt (ids ``rid``, or ``rid-0``, ``rid-1``, ... for several), merged; each
    output through ``view`` (``output_view``) when given. ``stream=False``: one output per request, at its end.
    ``images``: a chat's encoded images (one prompt), sent with its engine request."""
    ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    extra = {"images": images} if images else {}  # engines that read text only take no images argument
    streams = [engine.generate(p, sampling_params, i, policy, stream, **extra) for p, i in zip(prompts, ids)]
    return merged(streams if view is None else [_viewed(s, view) for s in streams])


async def collect(stream, chat: bool, choices: Choices, on_output=None) -> Choices:
    """Run the merged engine streams to the end, recording every output in ``choices``.

    APIErrors as the live API gives them: 400 for a prompt the engine refused, 503 if the engine went
    down, 500 if the engine could not produce an output. ``on_output(choices)`` runs after each output.
    """
    try:
        async for p, out in stream:
            choices.add(p, out)
            if on_output is not None:
                on_output(choices)
    except RequestRejectedError as e:
        raise rejected(e, "messages" if chat else "prompt") from None
    except EngineError as e:
        raise engine_down(e) from None
    if choices.failed:
        raise output_failed()
    return choices
