"""OpenAI response bodies for one finished request, shared by the live routes and the Batch API."""

from engine.serving.async_engine import EngineError, RequestRejectedError
from engine.text.prompts import InvalidPrompt
from engine.serving.protocol import Delta
from gateway.errors import APIError
from gateway.openai_schema import sampling_spec


def usage_of(d: Delta) -> dict:
    return {"prompt_tokens": d.num_prompt_tokens, "completion_tokens": d.num_output_tokens,
            "total_tokens": d.num_prompt_tokens + d.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": d.num_cached_tokens}}


def choice(chat: bool, text: str, finish: str | None, delta: bool) -> dict:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    key = "delta" if delta else "message"
    return {"index": 0, key: {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}


def completion_body(rid: str, created: int, model: str, chat: bool, text: str, last: Delta) -> dict:
    """The non-streaming response of /v1/completions or /v1/chat/completions."""
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created, "model": model,
            "choices": [choice(chat, text, last.finish_reason, False)], "usage": usage_of(last)}


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


async def complete(engine, body, chat: bool, rid: str, created: int, model: str, **request_policy) -> tuple[dict, Delta]:
    """Run one request to the end and return (response body, last delta); APIError as the live API would.

    ``request_policy`` is what ``engine.generate`` takes besides the prompt: priority, tenant,
    weight, preemptible, background, cache_salt. Closing (or cancelling) aborts the engine request.
    """
    spec = sampling_spec(body)
    prompt = await prepare_prompt(engine, body, chat)
    # Only the result is wanted: one message from the engine at the end, not one per token.
    stream = engine.generate(prompt, spec, request_id=rid, stream=False, **request_policy)
    text: list[str] = []
    last = None
    try:
        async for delta in stream:
            text.append(delta.new_text)
            last = delta
    except RequestRejectedError as e:
        raise APIError(400, str(e), param="messages" if chat else "prompt") from None
    except EngineError as e:
        raise engine_down(e) from None
    finally:
        await stream.aclose()
    if last.finish_reason == "error":
        raise output_failed()
    return completion_body(rid, created, model, chat, "".join(text), last), last
