"""OpenAI response bodies for one finished request, shared by the live routes and the Batch API."""

import dataclasses
import hashlib
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

import msgspec

from engine.serving.async_engine import EngineError, RequestRejectedError, UnreadStreamError
from engine.text.prompts import InvalidPrompt
from engine.core.outputs import RequestOutput
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from gateway.choices import Choices, merged
from gateway.errors import APIError
from gateway.openai_logprobs import CompletionLogprobs, as_token_ids, chat_logprobs, echo_text, prompt_logprobs_list, top_k
from gateway.openai_schema import check_choices, prompts_of, sampling_params_of, scoring_only, text_messages
from gateway.chat_plan import ChatPlan, ParserChoice, plan as plan_chat
from gateway.tool_parsers import ParsedDelta
from gateway.schema_check import check_schema


# (id of the engine's config, model name) -> (that config, kept so that its id is not reused; fingerprint)
_FINGERPRINTS: dict[tuple[int, str], tuple[object, str]] = {}


def system_fingerprint(engine_config, model: str) -> str:
    """``fp_`` and a hash of the served model's name, moegate's version and the engine's configuration: it
    changes exactly when something that may change outputs for the same request (and seed) does. Computed
    once per engine configuration object (it is not changed while it serves)."""
    key = (id(engine_config), model)
    if key not in _FINGERPRINTS:
        _FINGERPRINTS[key] = (engine_config, _fingerprint(engine_config, model))
    return _FINGERPRINTS[key][1]


def _fingerprint(engine_config, model: str) -> str:
    try:
        ver = version("moegate")
    except PackageNotFoundError:
        ver = "0"
    fields = dataclasses.asdict(engine_config) if dataclasses.is_dataclass(engine_config) else {}
    text = repr((model, ver, sorted(fields.items())))
    return "fp_" + hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def choice(chat: bool, text: str, finish: str | None, delta: bool, logprobs: dict | None = None, index: int = 0,
           stop_reason: int | str | None = None) -> dict:
    """One choice; a finished one has ``stop_reason``: the stop string or stop token id that ended it (as vLLM
    reports), None for EOS and length."""
    if not chat:
        body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    else:
        key = "delta" if delta else "message"
        body = {"index": index, key: {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish}
    if finish is not None:
        body["stop_reason"] = stop_reason
    return body


def output_choice(chat: bool, body, out: RequestOutput, index: int, delta: bool, first: bool = True,
                  offsets: CompletionLogprobs | None = None, prompt: str | list[int] | None = None) -> dict:
    """Choice ``index`` for ``out`` (a whole output, or a stream's chunk: ``first`` for its first one), with the
    echoed ``prompt`` (this choice's) and the logprobs the request asked for. ``offsets`` carries text_offset
    across one choice's chunks."""
    text = out.text
    echo = not chat and bool(body.echo) and first
    if echo:
        text = echo_text(prompt, out) + text
    logprobs = None
    if chat:
        logprobs = chat_logprobs(out.logprobs)
    elif body.logprobs is not None:
        prompt_lp = top_k(out.prompt_logprobs, body.logprobs) if echo else None
        if body.return_tokens_as_token_ids:  # the echoed text above keeps the prompt tokens' texts
            prompt_lp = as_token_ids(prompt_lp)
        logprobs = (offsets or CompletionLogprobs()).format(prompt_lp, out.logprobs)
    stop_reason = out.stop_reason if out.finish_reason == "stop" else None
    body_choice = choice(chat, text, out.finish_reason, delta, logprobs, index, stop_reason)
    if not chat and body.prompt_logprobs is not None and first:  # vLLM's field, in the choice
        body_choice["prompt_logprobs"] = prompt_logprobs_list(out.prompt_logprobs, body)
    return body_choice


def chat_finish_reason(finish: str | None, made_calls: bool) -> str | None:
    """"tool_calls" for a reply that made calls and ended on its own; one cut by max_tokens says "length"
    (its last call's arguments may be incomplete), as OpenAI and vLLM report it."""
    return "tool_calls" if made_calls and finish == "stop" else finish


def chat_message(parsed: ParsedDelta, plan: ChatPlan) -> dict:
    """The assistant message of a whole chat output: content (null when the reply is only calls), tool calls,
    and the reasoning when the model's family thinks."""
    content = parsed.content
    message = {"role": "assistant", "content": None if parsed.tool_calls and not content.strip() else content}
    if parsed.tool_calls:
        message["tool_calls"] = [call.openai() for call in parsed.tool_calls]
    if plan.reasoning_parser is not None:
        message["reasoning_content"] = parsed.reasoning or None
    return message


def stream_choices(piece: ParsedDelta, finish: str | None, first_call: int, plan: ChatPlan,
                   logprobs: dict | None = None, index: int = 0, first: bool = True) -> list[dict]:
    """The streamed choices of one step's parsed text: content / reasoning as they come; each tool call as
    OpenAI sends it (one delta with its index, id, type, name and empty arguments, then the arguments);
    the finish reason on the last. ``first_call`` is the index of the first call in ``piece``; the step's
    ``logprobs`` go with the first choice.

    ``first``: the choice has sent no chunk yet. Only its first chunk carries ``role``, as OpenAI sends it:
    clients (the SDKs' stream helpers) concatenate every string field of the deltas, so a role in each
    chunk would add up to "assistantassistant...". A step with nothing to show (text held back while a
    tool call may be starting) sends no chunk, unless it carries the finish reason or logprobs: so a reply
    that is only tool calls starts with the first call, and its ``content`` stays null."""
    out = []
    if piece.content or piece.reasoning:
        delta = {"content": piece.content}
        if plan.reasoning_parser is not None:
            delta["reasoning_content"] = piece.reasoning or None
        out.append(delta)
    for i, call in enumerate(piece.tool_calls, start=first_call):
        out.append({"tool_calls": [
            {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
    if not out:
        if finish is None and logprobs is None:
            return []
        out.append({"content": ""} if first else {})
    elif finish is not None:
        out.append({})
    if first:
        out[0] = {"role": "assistant", **out[0]}
    choices = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in out]
    choices[-1]["finish_reason"] = finish
    choices[0]["logprobs"] = logprobs
    return choices


def choice_prompts(body, chat: bool, n: int) -> list:
    """Each choice's prompt as the request gave it (for echo); None for chat."""
    return [None] * n if chat else [p for p in prompts_of(body) for _ in range(n)]


def parsed_choice(out: RequestOutput, index: int, plan: ChatPlan) -> dict:
    """A whole chat choice read through the plan: content, tool calls, reasoning."""
    parsed = plan.output_parser().parse(out.text)
    body = {"index": index, "message": chat_message(parsed, plan), "logprobs": chat_logprobs(out.logprobs),
            "finish_reason": chat_finish_reason(out.finish_reason, bool(parsed.tool_calls))}
    body["stop_reason"] = out.stop_reason if out.finish_reason == "stop" else None
    return body


def completion_body(rid: str, created: int, model: str, chat: bool, whole: Choices, body, fingerprint: str,
                    plan: ChatPlan | None = None) -> dict:
    """The non-streaming response of /v1/completions or /v1/chat/completions for a request's whole output."""
    prompts = choice_prompts(body, chat, whole.n)
    choices = [parsed_choice(out, i, plan) if chat and plan is not None
               else output_choice(chat, body, out, i, False, prompt=prompts[i]) for i, out in enumerate(whole.outputs)]
    response = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "system_fingerprint": fingerprint, "choices": choices, "usage": whole.usage()}
    if chat and body.prompt_logprobs is not None:  # vLLM's field: the prompt's, once for the response
        response["prompt_logprobs"] = prompt_logprobs_list(whole.outputs[0].prompt_logprobs, body)
    return response


def chat_plan_of(engine, body, parsers: ParserChoice) -> ChatPlan:
    """How a chat request is rendered and read, with the parsers the served checkpoint takes."""
    architecture = engine.info.architecture if engine.info is not None else None  # None while (re)starting
    return plan_chat(body, parsers.resolve(engine.chat_template(), architecture))


def apply_plan(sampling_params, plan: ChatPlan | None):
    """Sampling settings a chat plan needs: the forcing schema, special tokens kept for formats that use them."""
    if plan is not None:
        if plan.structured_output is not None:
            if sampling_params.structured_output is not None:
                raise APIError(400, "tool_choice 'required' or a named function already fixes the output's format; "
                                    "leave response_format out", param="response_format")
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


def output_failed() -> APIError:
    """A request the engine ended with finish_reason 'error' (its output could not be produced); the
    other requests were not affected. Not marked for retry: the same request would fail the same way."""
    return APIError(500, "the engine could not produce this request's output; it was not retried",
                    "server_error", code="request_failed", headers={"x-should-retry": "false"})


NOT_RETRIED = ("engine_failed", "request_failed")  # error codes a batch line fails with instead of running again


async def prepare_prompts(engine, body, chat: bool, plan: ChatPlan | None = None) -> list[list[int]]:
    """The request's checked prompts as token ids (a chat request has one); a 400 naming the field if one
    cannot be served."""
    try:
        if chat:
            return [await engine.prepare(None, plan.chat if plan is not None else text_messages(body.messages))]
        prompts = prompts_of(body)
        check_choices(len(prompts), body.n or 1)
        out = []
        for i, prompt in enumerate(prompts):
            try:
                out.append(await engine.prepare(prompt, None))
            except InvalidPrompt as e:
                if len(prompts) > 1:
                    e.param, e.message = f"prompt[{i}]", f"prompt {i}: {e.message}"
                raise
        return out
    except InvalidPrompt as e:
        raise APIError(400, e.message, param=e.param) from None
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


def start_streams(engine, prompts: list[list[int]], sampling_params: SamplingParams, rid: str, policy: RequestPolicy,
                  view: Callable[[RequestOutput], RequestOutput] | None = None, stream: bool = True):
    """One engine request per prompt (ids ``rid``, or ``rid-0``, ``rid-1``, ... for several), merged; each
    output through ``view`` (``output_view``) when given. ``stream=False``: one output per request, at its end."""
    ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    streams = [engine.generate(p, sampling_params, i, policy, stream) for p, i in zip(prompts, ids)]
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
        raise APIError(400, str(e), param="messages" if chat else "prompt") from None
    except EngineError as e:
        raise engine_down(e) from None
    if choices.failed:
        raise output_failed()
    return choices


async def complete(engine, body, chat: bool, rid: str, created: int, model: str, fingerprint: str = "",
                   *, policy: RequestPolicy, parsers: ParserChoice | None = None,
                   render=completion_body) -> tuple[dict, Choices]:
    """Run one request to the end and return (response body, its choices); APIError as the live API would.

    ``policy``: how the engine schedules it (its ``order_in_class`` is taken from the body's ``priority``).
    Closing (or cancelling) aborts the engine requests.
    ``parsers``: the server's tool-call / reasoning parser settings (auto-detected when not given).
    ``render``: the response body, from ``completion_body``'s arguments (the Responses API has its own).
    """
    plan = chat_plan_of(engine, body, parsers or ParserChoice()) if chat else None
    sampling_params = apply_plan(sampling_params_of(body, engine.info.vocab_size if engine.info is not None else None), plan)
    prompts = await prepare_prompts(engine, body, chat, plan)
    await check_schema(sampling_params.structured_output, body, forced_call=plan is not None and plan.structured_output is not None)
    # Only the result is wanted: one message from the engine at the end, not one per token.
    policy = msgspec.structs.replace(policy, order_in_class=order_in_class(body))
    stream = start_streams(engine, prompts, sampling_params, rid, policy, output_view(body), stream=False)
    try:
        whole = await collect(stream, chat, Choices([len(p) for p in prompts], sampling_params.n, whole=True))
    finally:
        await stream.aclose()
    return render(rid, created, model, chat, whole, body, fingerprint, plan), whole
