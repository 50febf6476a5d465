"""OpenAI response bodies for one finished request, shared by the live routes and the Batch API."""

from engine.serving.async_engine import EngineError, RequestRejectedError
from engine.text.prompts import InvalidPrompt
from engine.core.outputs import RequestOutput
from gateway.errors import APIError
from gateway.logprobs import CompletionLogprobs, chat_logprobs, echo_text
from gateway.openai_schema import sampling_params


def usage_of(d: RequestOutput) -> dict:
    return {"prompt_tokens": d.num_prompt_tokens, "completion_tokens": d.num_output_tokens,
            "total_tokens": d.num_prompt_tokens + d.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": d.num_cached_tokens}}


def choice(chat: bool, text: str, finish: str | None, delta: bool, logprobs: dict | None = None) -> dict:
    if not chat:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    key = "delta" if delta else "message"
    return {"index": 0, key: {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish}


def output_choice(chat: bool, body, out: RequestOutput, delta: bool, first: bool = True,
                  offsets: CompletionLogprobs | None = None) -> dict:
    """The choice for ``out`` (a whole output, or a stream's chunk: ``first`` for its first one), with the
    echoed prompt and the logprobs the request asked for. ``offsets`` carries text_offset across chunks."""
    text = out.text
    echo = not chat and bool(body.echo) and first
    if echo:
        text = echo_text(body.prompt, out) + text
    logprobs = None
    if chat:
        logprobs = chat_logprobs(out.logprobs)
    elif body.logprobs is not None:
        logprobs = (offsets or CompletionLogprobs()).format(out.prompt_logprobs if echo else None, out.logprobs)
    return choice(chat, text, out.finish_reason, delta, logprobs)


def completion_body(rid: str, created: int, model: str, chat: bool, whole: RequestOutput, body) -> dict:
    """The non-streaming response of /v1/completions or /v1/chat/completions for a request's whole output."""
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created, "model": model,
            "choices": [output_choice(chat, body, whole, False)], "usage": usage_of(whole)}


def engine_down(err: Exception | str) -> APIError:
    """503 for an engine that is down or restarting. A request the engine failed while running it is
    not marked for retry (``x-should-retry: false``, which the OpenAI SDKs honour): it may be the cause."""
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


async def prepare_prompt(engine, body, chat: bool) -> list[int]:
    """The request's checked prompt token ids; a 400 naming the field if it cannot be served."""
    try:
        return await engine.prepare(None if chat else body.prompt, body.messages if chat else None)
    except InvalidPrompt as e:
        raise APIError(400, e.message, param=e.param) from None
    except EngineError as e:
        raise engine_down(e) from None


async def collect(stream, chat: bool, first: RequestOutput | None = None, on_output=None) -> RequestOutput:
    """The engine stream's outputs (after ``first``, if already read) merged into the whole generation.

    APIErrors as the live API gives them: 400 for a prompt the engine refused, 503 if the engine went
    down, 500 if the engine could not produce this request's output. ``on_output(whole)`` sees the
    merged output after each one arrives.
    """
    whole = first
    try:
        async for out in stream:
            whole = out if whole is None else whole.merge(out)
            if on_output is not None:
                on_output(whole)
    except RequestRejectedError as e:
        raise APIError(400, str(e), param="messages" if chat else "prompt") from None
    except EngineError as e:
        raise engine_down(e) from None
    if whole.finish_reason == "error":
        raise output_failed()
    return whole


async def complete(engine, body, chat: bool, rid: str, created: int, model: str, **request_policy) -> tuple[dict, RequestOutput]:
    """Run one request to the end and return (response body, its whole output); APIError as the live API would.

    ``request_policy`` is what ``engine.generate`` takes besides the prompt: priority, tenant,
    weight, preemptible, background, cache_salt. Closing (or cancelling) aborts the engine request.
    """
    params = sampling_params(body, engine.info.vocab_size if engine.info is not None else None)
    prompt = await prepare_prompt(engine, body, chat)
    # Only the result is wanted: one message from the engine at the end, not one per token.
    stream = engine.generate(prompt, params, request_id=rid, stream=False, **request_policy)
    try:
        whole = await collect(stream, chat)
    finally:
        await stream.aclose()
    return completion_body(rid, created, model, chat, whole, body), whole
