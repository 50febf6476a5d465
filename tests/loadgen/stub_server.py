"""A tiny OpenAI-compatible stub on 127.0.0.1 with known timings and scripted failures.

Behaviour is chosen per API key (one ``Behaviour`` per key), so one server
plays several tenants. Each content chunk is one token ("tok "); usage is sent
when the client asks for it and ``usage`` is on.
"""

import asyncio
import itertools
import json
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Behaviour:
    first_token_s: float = 0.0  # delay before the first content chunk
    interval_s: float = 0.0  # delay between content chunks
    usage: bool = True
    cached_tokens: int = 0
    status: int = 200  # a non-200 status answers every request with an OpenAI-shaped error
    retry_after: str | None = None  # sent with non-200 answers
    retry_after_ms: str | None = None
    reject_first: int = 0  # the first N requests get 429 (with retry_after), later ones succeed
    cut_after: int | None = None  # close the connection after this many content chunks
    sse_error_after: int | None = None  # send an error event after this many chunks, then end the stream
    multi_token_chunks: int = 1  # tokens per content chunk (usage counts them all)
    batch_delay_s: float = 0.3


@dataclass
class StubState:
    behaviours: dict[str, Behaviour] = field(default_factory=dict)
    bodies: list[tuple[str, dict]] = field(default_factory=list)  # (key, body) of every completion request
    in_flight: int = 0
    max_in_flight: int = 0
    seen: dict[str, int] = field(default_factory=dict)
    key_in_flight: dict[str, int] = field(default_factory=dict)
    key_max_in_flight: dict[str, int] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    batches: dict[str, dict] = field(default_factory=dict)


def _key(request: web.Request) -> str:
    return request.headers.get("Authorization", "").removeprefix("Bearer ")


def _error(status: int, b: Behaviour) -> web.Response:
    headers = {}
    if b.retry_after is not None:
        headers["Retry-After"] = b.retry_after
    if b.retry_after_ms is not None:
        headers["retry-after-ms"] = b.retry_after_ms
    body = {"error": {"message": f"stub says {status}", "type": "stub", "param": None, "code": f"stub_{status}"}}
    return web.json_response(body, status=status, headers=headers)


def make_app(state: StubState) -> web.Application:
    ids = itertools.count()

    async def completions(request: web.Request) -> web.StreamResponse:
        key = _key(request)
        b = state.behaviours.get(key, Behaviour())
        body = await request.json()
        state.bodies.append((key, body))
        n_seen = state.seen.get(key, 0)
        state.seen[key] = n_seen + 1
        if b.status != 200:
            return _error(b.status, b)
        if n_seen < b.reject_first:
            return _error(429, b)
        chat = request.path.endswith("/chat/completions")
        prompt = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        n = body.get("max_tokens") or 16
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n, "total_tokens": len(prompt.split()) + n,
                 "prompt_tokens_details": {"cached_tokens": b.cached_tokens}}
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        state.key_in_flight[key] = state.key_in_flight.get(key, 0) + 1
        state.key_max_in_flight[key] = max(state.key_max_in_flight.get(key, 0), state.key_in_flight[key])
        try:
            if not body.get("stream"):
                await asyncio.sleep(b.first_token_s + b.interval_s * (n - 1))
                choice = ({"index": 0, "message": {"role": "assistant", "content": "tok " * n}, "finish_reason": "length"}
                          if chat else {"index": 0, "text": "tok " * n, "finish_reason": "length"})
                out = {"id": "x", "object": "completion", "choices": [choice]}
                if b.usage:
                    out["usage"] = usage
                return web.json_response(out)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-ratelimit-remaining-requests": "7"})
            await resp.prepare(request)
            await asyncio.sleep(b.first_token_s)
            chunks = (n + b.multi_token_chunks - 1) // b.multi_token_chunks
            for i in range(chunks):
                if i:
                    await asyncio.sleep(b.interval_s)
                if b.cut_after is not None and i == b.cut_after:
                    request.transport.close()  # a dropped stream: no [DONE], no final chunk
                    return resp
                if b.sse_error_after is not None and i == b.sse_error_after:
                    await resp.write(b'data: {"error": {"message": "engine died", "code": "engine_unavailable"}}\n\n')
                    await resp.write_eof()
                    return resp
                text = "tok " * b.multi_token_chunks
                finish = "length" if i == chunks - 1 else None
                choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                          else {"index": 0, "text": text, "finish_reason": finish})
                await resp.write(b"data: " + json.dumps({"id": "x", "choices": [choice]}).encode() + b"\n\n")
            if b.usage and (body.get("stream_options") or {}).get("include_usage"):
                await resp.write(b"data: " + json.dumps({"id": "x", "choices": [], "usage": usage}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            state.in_flight -= 1
            state.key_in_flight[key] -= 1

    async def upload(request: web.Request) -> web.Response:
        form = await request.post()
        fid = f"file-{next(ids)}"
        state.files[fid] = form["file"].file.read()
        assert form["purpose"] == "batch"
        return web.json_response({"id": fid, "object": "file"})

    async def create_batch(request: web.Request) -> web.Response:
        body = await request.json()
        bid = f"batch-{next(ids)}"
        lines = [json.loads(x) for x in state.files[body["input_file_id"]].decode().splitlines() if x]
        state.batches[bid] = {"id": bid, "status": "validating", "created": time.monotonic(), "lines": lines,
                              "key": _key(request)}
        return web.json_response({"id": bid, "status": "validating"})

    async def get_batch(request: web.Request) -> web.Response:
        batch = state.batches[request.match_info["bid"]]
        b = state.behaviours.get(batch["key"], Behaviour())
        if time.monotonic() - batch["created"] < b.batch_delay_s:
            return web.json_response({"id": batch["id"], "status": "in_progress"})
        out_id = f"file-out-{batch['id']}"
        outputs = [{"custom_id": line["custom_id"], "response": {"status_code": 200, "body": {
            "usage": {"prompt_tokens": 3, "completion_tokens": line["body"]["max_tokens"]}}}} for line in batch["lines"]]
        state.files[out_id] = "\n".join(json.dumps(o) for o in outputs).encode()
        n = len(batch["lines"])
        return web.json_response({"id": batch["id"], "status": "completed", "output_file_id": out_id,
                                  "request_counts": {"total": n, "completed": n, "failed": 0}})

    async def file_content(request: web.Request) -> web.Response:
        return web.Response(body=state.files[request.match_info["fid"]])

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/files", upload)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches/{bid}", get_batch)
    app.router.add_get("/v1/files/{fid}/content", file_content)
    return app


class StubThread:
    """The stub in a background thread (for code that runs its own event loop, like the CLI)."""

    def __init__(self, state: StubState) -> None:
        self.state = state
        self.port = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = web.AppRunner(make_app(self.state))
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> "StubThread":
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"
