"""Images beyond chat's inline ``data:`` URLs, through the HTTP API of the in-process Qwen3-VL-MoE server of
``tests/gateway/test_chat_images.py`` (these tests are collected there, sharing its server: a second one would
cost the suite about 20 s): remote http(s) image URLs (hosts the operator lists, public addresses only), the
Responses API's ``input_image`` parts, ``/tokenize`` counting image tokens, and Batch API lines with images.

The reference is transformers: its ``Qwen3VLProcessor`` builds the prompt (each placeholder expanded by the
processor itself) and ``Qwen3VLMoeForConditionalGeneration`` its greedy tokens. Images are served by a local
aiohttp server on loopback; the gateway refuses loopback, so the tests that fetch from it switch the server's
policy to one that allows private addresses (``allow_private_media_addresses``, which is dangerous outside tests).
The server starts with remote URLs off, as a server does by default.
"""

import asyncio
import base64
import contextlib
import json
import random
import socket
import time
import warnings

import aiohttp
import openai
import pytest
import torch
from aiohttp import web

from gateway.remote_images import REMOTE_IMAGES, RemoteImagePolicy, pinned_session
from tests.engine.vision.qwen3_vl_checkpoint import IMAGE_TOKEN, hf_greedy_pixels, random_image
from tests.gateway.batch_runs import run_chat_batch
from tests.gateway.test_chat_images import MAX_NEW, _png_bytes, _processed, png_header_only


FETCH_TIMEOUT_S = 1.0
MIB = 1 << 20
LISTED = ("127.0.0.1", "localhost", "169.254.169.254")  # on the list; refused for their addresses


class MediaServer:
    """Images (and hostile answers) on loopback, for the gateway to fetch."""

    def __init__(self) -> None:
        self.images: dict[str, bytes] = {}
        self.release = asyncio.Event()  # ends the slow answers at teardown
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/img/{name}", self._image)
        app.router.add_get("/slow.png", self._slow)
        app.router.add_get("/big-chunked.png", self._big_chunked)
        app.router.add_get("/big-declared.png", self._big_declared)
        app.router.add_get("/redirect.png", self._redirect)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    async def _image(self, request: web.Request) -> web.Response:
        return web.Response(body=self.images[request.match_info["name"]], content_type="image/png")

    async def _slow(self, request: web.Request) -> web.StreamResponse:
        try:
            await asyncio.wait_for(self.release.wait(), 30)
        except TimeoutError:
            pass
        return web.Response(body=b"late", content_type="image/png")

    async def _big_chunked(self, request: web.Request) -> web.StreamResponse:
        """25 MiB with no length declared: the gateway must stop reading at its limit."""
        reply = web.StreamResponse(headers={"Content-Type": "image/png"})
        reply.enable_chunked_encoding()
        await reply.prepare(request)
        try:
            for _ in range(25):
                await reply.write(b"\0" * MIB)
        except ConnectionError:  # the gateway hung up at its limit, as it should
            pass
        return reply

    async def _big_declared(self, request: web.Request) -> web.StreamResponse:
        """A declared 30 MiB of which one byte comes: refused from the header, not after waiting for the body."""
        reply = web.StreamResponse(headers={"Content-Type": "image/png"})
        reply.content_length = 30 * MIB
        await reply.prepare(request)
        await reply.write(b"\0")
        await asyncio.wait_for(self.release.wait(), 30)
        return reply

    async def _redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPFound("http://images.not-listed.test/cat.png")


@pytest.fixture(scope="module")
def media(served):
    """The media server, on the served app's event loop."""
    srv = served[0]
    server = MediaServer()
    srv.run(server.start())
    try:
        yield server
    finally:
        server.release.set()
        srv.run(server.runner.cleanup())


@contextlib.contextmanager
def remote_policy(srv, policy: RemoteImagePolicy):
    """Test-only: the running app's remote-image policy replaced for the block (aiohttp warns on a started app's
    state), then put back."""
    app = srv.server.app
    kept = app[REMOTE_IMAGES]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        app[REMOTE_IMAGES] = policy
        try:
            yield
        finally:
            app[REMOTE_IMAGES] = kept


PRIVATE_OK = RemoteImagePolicy(LISTED, FETCH_TIMEOUT_S, allow_private_addresses=True)
PUBLIC_ONLY = RemoteImagePolicy(LISTED, FETCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def reference(served, media):
    """A random picture served at /img/a.png, a user message around it, transformers' prompt and greedy tokens."""
    srv, client, model, tok, seed = served
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    picture = random_image(gen, rng.randint(12, 40), rng.randint(12, 40))
    png = _png_bytes(picture)
    media.images["a.png"] = png
    want_prompt, pixels = _processed(model, tok, [{"role": "user", "content": [
        {"type": "text", "text": "Look:"}, {"type": "image"}, {"type": "text", "text": "What?"}]}], [picture])
    return png, picture, want_prompt, hf_greedy_pixels(model, want_prompt, pixels, MAX_NEW)


def _parts(url: str, kind: str = "chat") -> list[dict]:
    if kind == "chat":
        return [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What?"}]
    return [{"type": "input_text", "text": "Look:"}, {"type": "input_image", "image_url": url, "detail": "auto"},
            {"type": "input_text", "text": "What?"}]


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


async def _chat_tokens(client, url: str):
    reply = await client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": _parts(url)}], max_tokens=MAX_NEW, temperature=0,
        logprobs=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content], reply


def test_remote_image_url_and_responses_input_image_match_transformers(served, media, reference):
    """An allowed remote URL (fetched from loopback under the test-only policy) gives transformers' greedy tokens
    and bills its prompt; the Responses API's input_image, as a data: URL and as the remote URL, through the
    official client, answers the chat's text and bills the same prompt tokens."""
    srv, client, model, tok, seed = served
    png, _, want_prompt, want = reference
    with remote_policy(srv, PRIVATE_OK):
        got, chat = srv.run(_chat_tokens(client, media.url("/img/a.png")))
        assert got == want, f"seed={seed}"
        assert chat.usage.prompt_tokens == len(want_prompt)
        for url in (_data_url(png), media.url("/img/a.png")):
            response = srv.run(client.responses.create(
                model="demo", input=[{"role": "user", "content": _parts(url, "responses")}],
                max_output_tokens=MAX_NEW, temperature=0, store=False, extra_body={"ignore_eos": True}))
            assert response.output_text == chat.choices[0].message.content, f"seed={seed}"
            assert response.usage.input_tokens == len(want_prompt), f"seed={seed}"


def test_hostile_remote_urls_are_a_400_naming_the_part(served, media, reference):
    """Each hostile URL is a 400 naming messages[0].content[1] within the fetch deadline, and the engine runs
    nothing for it (its prefill count unchanged)."""
    srv, client, model, tok, seed = served
    media.images["bomb.png"] = png_header_only(20000, 20000)
    guarded = {  # the server's own policy: listed hosts, public addresses only
        "loopback": (media.url("/img/a.png"), "127.0.0.1, a loopback address"),
        "metadata service": ("http://169.254.169.254/latest/meta-data/", "169.254.169.254, a link-local address"),
        "listed name resolving to loopback": (media.url("/img/a.png", "localhost"), "a loopback address"),
        "not listed": ("https://images.not-listed.test/cat.png", "not among the hosts"),
        "credentials": ("http://user:pw@127.0.0.1/a.png", "may not carry credentials"),
    }
    fetched = {  # from loopback, under the test-only policy: the limits
        "slow": (media.url("/slow.png"), "did not answer in time"),
        "oversize, chunked": (media.url("/big-chunked.png"), "over 20,971,520 bytes"),
        "oversize, declared": (media.url("/big-declared.png"), "over 20,971,520 bytes"),
        "declared 20000x20000": (media.url("/img/bomb.png"), "over the pixel limit"),
        "redirect to a host not listed": (media.url("/redirect.png"), "not among the hosts"),
        "missing": (media.url("/nothing.png"), "HTTP 404"),
    }
    stats = srv.engine.stats
    prefilled = stats.total_prefill_tokens if stats is not None else None

    async def refused(url):
        start = time.monotonic()
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="demo", max_tokens=2, messages=[
                {"role": "user", "content": _parts(url)}])
        return info.value, time.monotonic() - start

    for policy, cases in ((PUBLIC_ONLY, guarded), (PRIVATE_OK, fetched)):
        with remote_policy(srv, policy):
            for name, (url, reason) in cases.items():
                err, took = srv.run(refused(url))
                assert err.status_code == 400 and err.body["param"] == "messages[0].content[1]", (name, err.body)
                assert reason in err.body["message"], (name, err.body)
                assert took < FETCH_TIMEOUT_S + 4.0, (name, took)  # the slow server would hold it for 30 s
    stats = srv.engine.stats
    assert (stats.total_prefill_tokens if stats is not None else None) == prefilled

    async def responses_refused(part):
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(model="demo", input=[
                {"role": "user", "content": "first"},
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}, part]}])
        return info.value

    for part, reason in (({"type": "input_image", "image_url": media.url("/img/a.png")}, "loopback address"),
                         ({"type": "input_image", "file_id": "file-1", "detail": "auto"}, "file_id is not taken")):
        with remote_policy(srv, PUBLIC_ONLY):
            err = srv.run(responses_refused(part))
        assert err.body["param"] == "input[1].content[1]" and reason in err.body["message"], err.body


def test_tokenize_counts_image_tokens(served, media, reference):
    """/tokenize of a chat with two images (a data: URL and a fetched URL) gives the ids transformers'
    processor builds, image tokens included; an image it may not fetch is a 400 naming the part."""
    srv, client, model, tok, seed = served
    png, picture, _, _ = reference
    second = random_image(torch.Generator().manual_seed(seed + 7), 40, 16)
    media.images["b.png"] = _png_bytes(second)
    want, _ = _processed(model, tok, [{"role": "user", "content": [
        {"type": "text", "text": "Two:"}, {"type": "image"}, {"type": "image"}]}], [picture, second])

    async def tokenize(url_b):
        messages = [{"role": "user", "content": [{"type": "text", "text": "Two:"},
                                                 {"type": "image_url", "image_url": {"url": _data_url(png)}},
                                                 {"type": "image_url", "image_url": {"url": url_b}}]}]
        async with aiohttp.ClientSession() as session:
            async with session.post(srv.server.make_url("/tokenize"), json={"model": "demo", "messages": messages},
                                    headers={"Authorization": f"Bearer {client.api_key}"}) as reply:
                return reply.status, await reply.json()

    with remote_policy(srv, PRIVATE_OK):
        status, counted = srv.run(tokenize(media.url("/img/b.png")))
    assert status == 200, counted
    assert counted["tokens"] == want and counted["count"] == len(want), f"seed={seed}"
    assert want.count(IMAGE_TOKEN) > 2
    with remote_policy(srv, PUBLIC_ONLY):
        status, refused = srv.run(tokenize(media.url("/img/b.png")))
    assert status == 400 and refused["error"]["param"] == "messages[0].content[2]", refused


def test_batch_lines_with_images(served, media, reference):
    """A Batch API chat line with a data: URL image gives transformers' greedy tokens; a line with a remote image
    URL is that line's 400 naming the part (the runner keeps the policy the server started with: remote URLs off)."""
    srv, client, model, tok, seed = served
    png, _, want_prompt, want = reference

    def line(custom_id: str, url: str) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": "demo", "messages": [{"role": "user", "content": _parts(url)}], "max_tokens": MAX_NEW,
            "temperature": 0, "logprobs": True, "ignore_eos": True, "return_tokens_as_token_ids": True}})

    # a line's 4xx is in the error file
    out = srv.run(run_chat_batch(client, [line("inline", _data_url(png)), line("loopback", media.url("/img/a.png"))]))
    body = out["inline"]["body"]
    assert out["inline"]["status_code"] == 200, body
    got = [int(t["token"].removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["content"]]
    assert got == want and body["usage"]["prompt_tokens"] == len(want_prompt), f"seed={seed}"
    refused = out["loopback"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "messages[0].content[1]", refused
    assert "remote image URLs are off" in refused["body"]["error"]["message"]  # the server's own policy: none


def test_connections_go_to_the_checked_address(served, media, reference):
    """The fetch's session connects to the addresses that were checked, with no lookup of its own: a name that
    resolves nowhere reaches the media server through its pinned address, and any other name reaches nothing
    (a second, rebound answer is never asked for)."""
    srv, client, model, tok, seed = served
    png = reference[0]
    pinned = [{"hostname": "media.invalid", "host": "127.0.0.1", "port": media.port, "family": socket.AF_INET,
               "proto": 0, "flags": socket.AI_NUMERICHOST}]

    async def fetch(host):
        async with pinned_session("media.invalid", pinned) as session:
            async with session.get(f"http://{host}:{media.port}/img/a.png") as reply:
                return reply.status, await reply.read()

    status, body = srv.run(fetch("media.invalid"))
    assert status == 200 and body == png
    with pytest.raises(aiohttp.ClientConnectorError):
        srv.run(fetch("localhost"))
