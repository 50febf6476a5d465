"""A streamed completion or chat completion as server-sent events: one chunk per choice's step (completions' text
and logprobs, or chat output read through its plan: content, reasoning, tool calls), the request's usage where
asked, an error event when the engine fails mid-way, ``[DONE]`` at the end."""

from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from engine.core.outputs import RequestOutput
from engine.serving.async_engine import EngineError
from gateway.chat_plan import ChatPlan
from gateway.completion import engine_down, output_failed
from gateway.errors import REQUEST_ID, REQUEST_ID_HEADER, APIError
from gateway.openai_logprobs import CompletionLogprobs, chat_logprobs, prompt_logprobs_list
from gateway.request_keys import CHOICES, RATE_HEADERS, TIMER
from gateway.response_bodies import chat_finish_reason, choice_prompts, output_choice, stream_choices
from gateway.stream_journal import JOURNALED
from gateway.stream_padding import encode_event


async def write_error_event(response: web.StreamResponse, err: APIError) -> web.StreamResponse:
    """End a stream whose headers are gone with one event in the OpenAI error shape."""
    error = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    await response.write(b"data: " + msgspec.json.encode(error) + b"\n\n")
    await response.write_eof()
    return response


class _Envelope:
    """What every chunk of one response repeats around its choices."""

    def __init__(self, rid: str, chat: bool, created: int, model: str, fingerprint: str, obfuscate: bool) -> None:
        self.fields = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                       "created": created, "model": model, "system_fingerprint": fingerprint}
        self.obfuscate = obfuscate  # stream_options.include_obfuscation: events padded (gateway.stream_padding)

    def event(self, choices: list[dict], **extra) -> bytes:
        return b"data: " + encode_event({**self.fields, "choices": choices, **extra}, self.obfuscate) + b"\n\n"


class _ChunkChoices:
    """Each step's streamed choices, with what each choice carries from one chunk to the next: completions'
    text_offset, chat's output parser and whether the choice has sent its first chunk (the one with ``role``)."""

    def __init__(self, body, chat: bool, plan: ChatPlan | None, n: int) -> None:
        self.body, self.chat, self.plan = body, chat, plan
        self.prompts = choice_prompts(body, chat, n)
        self.offsets: dict[int, CompletionLogprobs] = {}  # per choice: text_offset runs on across its chunks
        self.parsers = {}  # per choice: its chat output parser (tool calls, reasoning)
        self.announced: set[int] = set()  # chat choices that have sent a chunk (the first carries the role)

    def of(self, delta: RequestOutput, index: int) -> list[dict]:
        if self.plan is None:
            first_chunk = index not in self.offsets
            return [output_choice(self.chat, self.body, delta, index, True, first_chunk,
                                  self.offsets.setdefault(index, CompletionLogprobs()), self.prompts[index])]
        parser = self.parsers.setdefault(index, self.plan.output_parser())
        made = parser.num_calls
        piece = parser.feed(delta.text, delta.token_ids)
        if delta.finished:
            piece += parser.finish()
        finish = chat_finish_reason(delta.finish_reason, parser.num_calls > 0) if delta.finished else None
        out = stream_choices(piece, finish, made, self.plan, chat_logprobs(delta.logprobs), index,
                             first=index not in self.announced)
        if out:
            self.announced.add(index)
        if finish is not None:
            out[-1]["stop_reason"] = delta.stop_reason if delta.finish_reason == "stop" else None
        return out


async def _open(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **request[RATE_HEADERS]}
    )
    response.headers[REQUEST_ID_HEADER] = request[REQUEST_ID]  # sent at prepare, before the middleware sees it
    await response.prepare(request)
    return response


async def stream_reply(request: web.Request, body, chat: bool, stream: AsyncIterator, first: tuple, rid: str,
                       created: int, model: str, fingerprint: str, plan: ChatPlan | None) -> web.StreamResponse:
    """Stream the merged engine outputs, ``first`` (already read) and the rest of ``stream``, as SSE events;
    request[CHOICES] records each output (so usage is settled even if the client goes away mid-stream) and
    request[JOURNALED] what was delivered."""
    choices, timer = request[CHOICES], request[TIMER]
    response = await _open(request)
    options = body.stream_options
    envelope = _Envelope(rid, chat, created, model, fingerprint, bool(options and options.include_obfuscation))
    include_usage = bool(options and options.include_usage)
    # vLLM's continuous_usage_stats: every chunk carries the request's usage so far, not null.
    usage_per_chunk = include_usage and body.stream_options.continuous_usage_stats
    chunk_choices = _ChunkChoices(body, chat, plan, choices.n)
    index = choices.add(*first)
    delta = first[1]
    # vLLM's prompt_logprobs (chat): with the first chunk written, which may come after an output that wrote none
    # (a first token with no text yet).
    prompt_lp = None
    while True:
        if delta.finish_reason == "error":
            return await write_error_event(response, output_failed())
        if chat and delta.prompt_logprobs is not None and body.prompt_logprobs is not None:
            prompt_lp = prompt_logprobs_list(delta.prompt_logprobs, body)
        out_choices = chunk_choices.of(delta, index)
        # Journaled before it is written: a gateway killed between the two bills this chunk (as a client that
        # leaves mid-stream is billed what was generated), never less than the client received.
        request[JOURNALED].delivered(choices)
        for one in out_choices:
            extra = {}
            if prompt_lp is not None:
                extra["prompt_logprobs"], prompt_lp = prompt_lp, None
            if include_usage:
                extra["usage"] = choices.usage() if usage_per_chunk else None
            await response.write(envelope.event([one], **extra))
        if choices.finished:
            break
        try:
            p, delta = await anext(stream)
        except EngineError as e:
            return await write_error_event(response, engine_down(e))  # engine_failed if the step failed
        index = choices.add(p, delta)
        timer.delta(first=False)
    if include_usage:  # OpenAI's shape: a last chunk with no choices and the request's usage
        await response.write(envelope.event([], usage=choices.usage()))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
