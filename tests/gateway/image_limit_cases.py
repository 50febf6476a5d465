"""Per-tenant image limits through the HTTP API, run on ``test_chat_images.py``'s server (a tiny random
Qwen3-VL-MoE; its gateway has the default limits, 16 images per request and 16 Mi pixels per image): a tenant's
quota tightens them, never loosens them. The official ``openai`` client's chats with image counts and sizes at
each limit's edges and at random are refused (a 400 naming the content part, the limit and whose it is) exactly
where a plain min() of the two limits says, and served otherwise; ``/tokenize`` applies the same limits. The
server's limits themselves are ``moegate serve --max-images-per-request`` / ``--max-image-pixels``, refused out of
range."""

import asyncio
import base64
import random
import time

import aiohttp
import openai
import pytest
import torch

from engine.vision.prompt_images import DEFAULT_MAX_DECODED_PIXELS
from gateway.config import MAX_DECODED_PIXELS, GatewayConfig
from gateway.image_policy import IMAGE_LIMITS
from tests.engine.vision.qwen3_vl_checkpoint import random_image
from tenants.store import TenantStore
from tests.gateway.tenant_keys import new_tenant_key

TENANTS = {  # name -> its quota's image limits (none: the server's)
    "open": dict(),
    "tight": dict(max_images_per_request=1, max_image_pixels=400),
    "loose": dict(max_images_per_request=100, max_image_pixels=10**8),  # above the server's: the server's apply
    "pixels_only": dict(max_image_pixels=700),
}
BOMB = (5000, 5000)  # a PNG that declares 5000x5000 (past the server's 16 Mi pixels) and holds one tiny row


def _verdict(server, quota: dict, sizes: list[tuple[int, int]]):
    """The reference: None (served), or (index of the refused image, limit, 'tenant' or 'server', code)."""
    images, pixels = server.max_images, server.max_image_pixels
    images_by = pixels_by = "server"
    if quota.get("max_images_per_request") is not None and quota["max_images_per_request"] < images:
        images, images_by = quota["max_images_per_request"], "tenant"
    if quota.get("max_image_pixels") is not None and quota["max_image_pixels"] < pixels:
        pixels, pixels_by = quota["max_image_pixels"], "tenant"
    if len(sizes) > images:
        return images, images, images_by, "too_many_images"
    for i, (w, h) in enumerate(sizes):
        if w * h > pixels:
            return i, pixels, pixels_by, "image_too_large"
    return None


def _url(gen, size) -> str:
    from tests.gateway.test_chat_images import data_url, png_header_only

    if size == BOMB:
        return "data:image/png;base64," + base64.b64encode(png_header_only(*BOMB)).decode()
    return data_url(random_image(gen, *size))


def _messages(gen, sizes):
    return [{"role": "user", "content": [{"type": "text", "text": "see"}] + [
        {"type": "image_url", "image_url": {"url": _url(gen, s)}} for s in sizes]}]


@pytest.fixture(scope="module")
def tenant_keys(served):
    srv = served[0]
    return {name: srv.run(new_tenant_key(srv.database_url, f"images-{name}", **quota))
            for name, quota in TENANTS.items()}


def test_tenant_image_limits_tighten_the_servers(served, tenant_keys):
    srv, _, _, _, seed = served
    server = srv.server.app[IMAGE_LIMITS]
    assert (server.max_images, server.max_image_pixels) == (GatewayConfig().max_images_per_request,
                                                            GatewayConfig().max_image_pixels)
    rng, gen = random.Random(seed + 11), torch.Generator().manual_seed(seed + 11)
    clients = {name: openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
               for name, key in tenant_keys.items()}

    async def ask(name, messages):
        try:
            return await clients[name].chat.completions.create(model="demo", messages=messages, max_tokens=1)
        except openai.BadRequestError as e:
            return e

    cases = []
    for name in TENANTS:  # each limit's edges (the tenants' 400 and 700 pixels, the server's 16 images and
        # 16 Mi pixels), then a random count and sizes
        cases += [(name, [(16, 16)] * 2), (name, [(20, 20)]), (name, [(21, 20)]), (name, [(27, 26)]),
                  (name, [(12, 12)] * 17), (name, [BOMB]),
                  (name, [(rng.randint(12, 44), rng.randint(12, 44)) for _ in range(rng.randint(1, 3))])]
    outcomes = {"served": 0, "tenant": 0, "server": 0}
    for name, sizes in cases:
        got = srv.run(ask(name, _messages(gen, sizes)))
        want = _verdict(server, TENANTS[name], sizes)
        if want is None:
            assert not isinstance(got, Exception), (name, sizes, got)
            outcomes["served"] += 1
            continue
        at, limit, whose, code = want
        assert isinstance(got, openai.BadRequestError), (name, sizes, got)
        error = got.body
        where = f"messages[0].content[{at + 1}]"
        assert (got.status_code, error["param"], error["code"]) == (400, where, code), (name, sizes, error)
        assert error["message"].startswith(where + ": ") and f"{limit:,}" in error["message"], error
        owner = "this API key's tenant's limit" if whose == "tenant" else "this server's limit"
        assert owner in error["message"], (name, sizes, error)
        outcomes[whose] += 1
    assert min(outcomes.values()) > 0, outcomes


def test_tokenize_applies_the_tenants_image_limits(served, tenant_keys):
    srv, _, _, _, seed = served
    two = _messages(torch.Generator().manual_seed(seed + 12), [(16, 16), (16, 16)])

    async def tokenize(name):
        async with aiohttp.ClientSession() as session:
            async with session.post(srv.server.make_url("/tokenize"), json={"model": "demo", "messages": two},
                                    headers={"Authorization": f"Bearer {tenant_keys[name]}"}) as reply:
                return reply.status, await reply.json()

    status, body = srv.run(tokenize("tight"))
    assert status == 400 and body["error"]["param"] == "messages[0].content[2]", body
    assert "at most 1 image (this API key's tenant's limit); this one has 2" in body["error"]["message"]
    status, body = srv.run(tokenize("open"))
    assert status == 200 and body["count"] > 0, body


def test_responses_name_the_image_they_refuse_in_input_or_in_the_stored_conversation(served):
    """The Responses API under a tenant's image count: a continuation's own image past the limit is named where
    the client sent it (input[0].content[1]); once the limit tightens below the images a stored conversation
    already holds, continuing it with text alone is refused naming previous_response_id (the client sent no image,
    and no chat message exists in its API), saying the image is the stored conversation's and how to go on."""
    srv, _, _, _, seed = served
    gen = torch.Generator().manual_seed(seed + 13)
    name = f"images-shrinking-{random.randrange(10**9)}"
    key = srv.run(new_tenant_key(srv.database_url, name, max_images_per_request=1))
    client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
    rng = random.Random(seed + 13)
    image = lambda: {"type": "input_image", "image_url": _url(gen, (rng.randint(12, 20), rng.randint(12, 20)))}  # noqa: E731

    async def refused(**body):
        try:
            await client.responses.create(model="demo", max_output_tokens=1, **body)
        except openai.BadRequestError as e:
            return e
        return None

    first = srv.run(client.responses.create(model="demo", max_output_tokens=1, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "see"}, image()]}]))
    err = srv.run(refused(previous_response_id=first.id, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "and"}, image()]}]))
    assert err is not None and (err.body["param"], err.body["code"]) == ("input[0].content[1]", "too_many_images")
    assert err.body["message"].startswith("input[0].content[1]: a request may carry at most 1 image"), err.body

    async def tighten():
        store = TenantStore.open(srv.database_url)
        try:
            await store.set_quota(name, max_images_per_request=0)
        finally:
            await store.close()
        deadline = time.monotonic() + 15  # the gateway's policy cache applies it within its TTL
        while (err := await refused(previous_response_id=first.id, input="and now?")) is None:
            assert time.monotonic() < deadline, "the tightened image limit never applied"
            await asyncio.sleep(0.5)
        return err

    err = srv.run(tighten())
    assert (err.status_code, err.body["param"], err.body["code"]) == (400, "previous_response_id", "too_many_images")
    message = err.body["message"]
    assert "messages[" not in message and "conversation stored under previous_response_id" in message, message
    assert "at most 0 images (this API key's tenant's limit)" in message and "send the conversation as input" in message


def test_server_image_limit_flags():
    assert MAX_DECODED_PIXELS == DEFAULT_MAX_DECODED_PIXELS
    for fields, message in (({"max_image_pixels": MAX_DECODED_PIXELS + 1}, "max_image_pixels must be in 1.."),
                            ({"max_image_pixels": 0}, "max_image_pixels must be in 1.."),
                            ({"max_images_per_request": -1}, "max_images_per_request must be >= 0")):
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            GatewayConfig(**fields)
