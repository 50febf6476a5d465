"""OpenAI response bodies and their choices for one request's outputs (whole or a stream's chunk), shared by the
live routes and the Batch API; ``gateway/completion.py`` runs the engine requests they are built from."""

import dataclasses
import hashlib
from importlib.metadata import PackageNotFoundError, version

from engine.core.outputs import RequestOutput
from gateway.choices import Choices
from gateway.openai_logprobs import CompletionLogprobs, as_token_ids, chat_logprobs, echo_text, prompt_logprobs_list, top_k
from gateway.openai_schema import prompts_of
from gateway.chat_plan import ChatPlan
from gateway.tool_parsers import ParsedDelta


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
    parsed = plan.output_parser().parse(out.text, out.token_ids)
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
