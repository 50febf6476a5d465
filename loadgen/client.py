"""The HTTP client: one OpenAI-compatible request (streaming or not), timed chunk by chunk.

Tokens are counted from ``usage`` when the server sends it (streams ask for it
with ``stream_options.include_usage``) and otherwise from content chunks (one
chunk, one token: true for servers that stream token by token). A 429 or 503
with ``Retry-After`` (or ``retry-after-ms``) is recorded; with
``honour_retry_after`` the request waits that long and tries again, up to
``max_retries`` times.
"""

import asyncio
import email.utils
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from loadgen.datasets import RequestSpec
from loadgen.records import RequestRecord

APIS = ("completion", "chat")
RETRYABLE = (429, 503)


@dataclass(slots=True)
class RequestOptions:
    """How a tenant's requests are sent (the same for all its requests)."""

    api: str = "completion"
    stream: bool = True
    model: str | None = None
    ignore_eos: bool = False  # vLLM's extension (moegate has it): output lengths then follow max_tokens
    temperature: float | None = None
    max_tokens: int | None = None  # overrides the dataset's output length when set
    extra_body: dict = field(default_factory=dict)
    honour_retry_after: bool = False
    max_retries: int = 3
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api must be one of {APIS}, got {self.api!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.max_retries < 0 or not self.timeout_s > 0:
            raise ValueError("max_retries must be >= 0 and timeout_s > 0")


@dataclass(slots=True)
class Target:
    """The server: ``base_url`` ends in ``/v1`` (or wherever ``/completions`` lives)."""

    base_url: str
    api_key: str | None = None

    def url(self, api: str) -> str:
        return self.base_url.rstrip("/") + ("/chat/completions" if api == "chat" else "/completions")


def build_body(spec: RequestSpec, opts: RequestOptions) -> dict:
    max_tokens = opts.max_tokens or spec.max_tokens
    if opts.api == "chat":
        content = spec.prompt if not spec.images else [{"type": "text", "text": spec.prompt}] + [
            {"type": "image_url", "image_url": {"url": url}} for url in spec.images]
        messages = ([{"role": "system", "content": spec.system}] if spec.system else []) + [
            {"role": "user", "content": content}]
        body = {"messages": messages}
    elif spec.images:
        raise ValueError("images are sent in chat requests: use the chat API (--api chat)")
    else:
        body = {"prompt": f"{spec.system}\n{spec.prompt}" if spec.system else spec.prompt}
    body["max_tokens"] = max_tokens
    if opts.model:
        body["model"] = opts.model
    if opts.temperature is not None:
        body["temperature"] = opts.temperature
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    body.update(opts.extra_body)
    return body


def retry_after_seconds(headers) -> float | None:
    """The wait a 429/503 asks for: ``retry-after-ms``, else ``Retry-After`` (seconds or an HTTP date)."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(float(ms) / 1000, 0.0)
        except ValueError:
            pass
    value = headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        try:
            return max(email.utils.parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
        except (TypeError, ValueError):
            return None


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict):
            return str(err.get("code") or err.get("type") or "") + ": " + str(err.get("message", ""))[:200]
    except (ValueError, AttributeError):
        pass
    return text.strip()[:200]


def _content(choice: dict, api: str) -> str:
    if api == "chat":
        delta = choice.get("delta") or choice.get("message") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def _take_usage(record: RequestRecord, usage: dict | None) -> None:
    if not usage:
        return
    record.prompt_tokens = usage.get("prompt_tokens")
    record.completion_tokens = usage.get("completion_tokens") or 0
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens")
    record.usage_source = "usage"


async def _read_stream(resp: aiohttp.ClientResponse, record: RequestRecord, api: str, clock: Callable[[], float]) -> None:
    state = {"chunks": 0, "done": False}
    try:
        await _read_events(resp, record, api, clock, state)
    finally:  # also when the stream is cut: count what did arrive
        if record.usage_source != "usage":
            record.completion_tokens, record.usage_source = state["chunks"], "chunks"
    if record.error is None and not state["done"] and record.finish_reason is None:
        record.error = "stream ended before [DONE]"
    record.ok = record.error is None


async def _read_events(resp: aiohttp.ClientResponse, record: RequestRecord, api: str, clock: Callable[[], float],
                       state: dict) -> None:
    last_token_s = None
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, "event:" lines
        data = line[5:].strip()
        if data == b"[DONE]":
            state["done"] = True
            return
        now = clock()
        try:
            event = json.loads(data)
        except ValueError:
            record.error = "malformed SSE event"
            return
        if "error" in event and not event.get("choices"):
            record.error = "stream error: " + _error_message(json.dumps(event))
            return
        for choice in event.get("choices") or []:
            if _content(choice, api):
                state["chunks"] += 1
                if last_token_s is None:
                    record.first_token_s = now
                else:
                    record.itl_s.append(now - last_token_s)
                last_token_s = now
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        _take_usage(record, event.get("usage"))


async def _read_json(resp: aiohttp.ClientResponse, record: RequestRecord, api: str, clock: Callable[[], float]) -> None:
    body = await resp.json(content_type=None)
    record.first_token_s = clock()  # not streaming: the first token arrives with the whole response
    choices = body.get("choices") or [{}]
    record.finish_reason = choices[0].get("finish_reason")
    _take_usage(record, body.get("usage"))
    record.ok = True


async def send_request(session: aiohttp.ClientSession, target: Target, spec: RequestSpec, opts: RequestOptions,
                       record: RequestRecord, clock: Callable[[], float]) -> RequestRecord:
    """Send one request (retrying after Retry-After when asked) and fill ``record``; never raises for HTTP trouble."""
    body = build_body(spec, opts)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
    record.input_len, record.max_tokens = spec.input_len, body["max_tokens"]
    record.images, record.new_images = len(spec.images), spec.new_images
    while True:
        if record.sent_s is None:
            record.sent_s = clock()
        record.error = None  # an earlier attempt's 429 is history once a retry is under way
        try:
            async with session.post(target.url(opts.api), json=body, headers=headers, timeout=timeout) as resp:
                record.first_byte_s = clock()
                record.status = resp.status
                record.attempt_statuses.append(resp.status)
                record.ratelimit = {k.lower(): v for k, v in resp.headers.items() if k.lower().startswith("x-ratelimit-")}
                if resp.status != 200:
                    record.error = _error_message(await resp.text())
                    wait = retry_after_seconds(resp.headers)
                    if wait is not None:
                        record.retry_after_s.append(wait)
                    if (resp.status in RETRYABLE and opts.honour_retry_after and wait is not None
                            and record.retries < opts.max_retries):
                        record.retries += 1
                        await asyncio.sleep(wait)
                        continue
                elif opts.stream:
                    await _read_stream(resp, record, opts.api, clock)
                else:
                    await _read_json(resp, record, opts.api, clock)
        except asyncio.TimeoutError:
            record.error = f"timeout after {opts.timeout_s:g} s"
        except aiohttp.ClientPayloadError as e:
            record.error = f"stream cut: {e}"
        except aiohttp.ClientError as e:
            record.error = f"{type(e).__name__}: {e}"
        except ValueError as e:  # a 200 whose body is not JSON
            record.error = f"bad response body: {e}"
        record.end_s = clock()
        if record.ok:
            record.error = None
        return record
