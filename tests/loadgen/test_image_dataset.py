"""Images in load generation: the synthetic image dataset's PNGs as Pillow reads them (sizes asked, pixels random),
its mix of repeated and new images against a plain record of what was sent, bad settings refused, and a whole
run from the command line's flags against a small server that answers later when a request brings an image it
has not seen from that key (an encoder cache's behaviour): the records' new-image counts equal the server's,
and the report's encoder share of TTFT is the one its timings imply."""

import argparse
import asyncio
import base64
import io
import random

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from PIL import Image

from loadgen.cli import _add_load_args, scenario_from_args
from loadgen.client import RequestOptions, build_body
from loadgen.datasets import DatasetConfig, iter_requests
from loadgen.metrics import image_ttft
from loadgen.records import RequestRecord
from loadgen.runner import run_scenario


def _pixels(url: str) -> Image.Image:
    head, data = url.split(",", 1)
    assert head == "data:image/png;base64"
    image = Image.open(io.BytesIO(base64.b64decode(data)))
    image.load()
    return image


def test_images_are_pngs_of_the_asked_sizes_repeated_and_new():
    seed = random.randrange(2**31)
    sizes = {(24, 16), (9, 33)}
    config = DatasetConfig(input_len="4", output_len="2", images=3, image_size="24x16,9x33", image_repeat=0.6,
                           image_pool=4)
    specs = [s for _, s in zip(range(40), iter_requests(config, seed))]
    seen: set[str] = set()
    repeated_parts = 0
    for spec in specs:
        assert len(spec.images) == 3
        new = 0
        for url in spec.images:
            new += url not in seen
            repeated_parts += url in seen
            seen.add(url)
            image = _pixels(url)
            assert image.size in sizes and image.mode == "RGB"
        assert spec.new_images == new, f"seed={seed}"
    assert repeated_parts > 0 and len(seen) > 4, f"seed={seed}"  # some repeats, some new ones
    # pixels are random: two new images differ
    fresh = [u for s in specs for u in s.images]
    assert len({_pixels(u).tobytes() for u in set(fresh)}) == len(set(fresh))
    again = [s for _, s in zip(range(40), iter_requests(config, seed))]
    assert [s.images for s in again] == [s.images for s in specs]  # deterministic per seed
    body = build_body(specs[0], RequestOptions(api="chat"))
    parts = body["messages"][-1]["content"]
    assert parts[0] == {"type": "text", "text": specs[0].prompt}
    assert [p["image_url"]["url"] for p in parts[1:]] == list(specs[0].images)
    with pytest.raises(ValueError, match="--api chat"):
        build_body(specs[0], RequestOptions(api="completion"))


@pytest.mark.parametrize("change, message", [
    (dict(images=-1), "images"), (dict(image_size="448"), "WxH"), (dict(image_size="0x4"), "WxH"),
    (dict(image_repeat=1.5), "image_repeat"), (dict(image_pool=0), "image_pool")])
def test_bad_image_settings(change, message):
    with pytest.raises(ValueError, match=message):
        DatasetConfig(**change)


def test_encoder_share_from_records():
    rng = random.Random()
    records = []
    for i in range(30):
        r = RequestRecord(i, "t", ok=True, sent_s=0.0, first_token_s=rng.uniform(0.01, 1.0), images=2,
                          new_images=i if i < 2 else rng.choice([0, 0, 1, 2]))  # both groups, whatever the draws
        records.append(r)
    records.append(RequestRecord(99, "t", ok=False, images=1, new_images=1))  # failed: no TTFT
    new = [r.first_token_s for r in records[:30] if r.new_images]
    old = [r.first_token_s for r in records[:30] if not r.new_images]
    got = image_ttft(records)
    want = (sum(new) / len(new) - sum(old) / len(old)) / (sum(new) / len(new))
    assert got["encoder_share"] == pytest.approx(want)
    assert (got["images"], got["new_images"]) == (61, sum(r.new_images for r in records))
    assert got["ttft_new_s"]["count"] == len(new) and got["ttft_repeated_s"]["count"] == len(old)
    assert image_ttft([RequestRecord(0, "t", ok=True, sent_s=0, first_token_s=1)]) is None


NEW_S, SEEN_S = 0.08, 0.01


def _encoder_like_app(seen_by_key: dict, new_counts: list) -> web.Application:
    """Chat completions answering after NEW_S when the request brings an image its key has not sent before,
    else after SEEN_S: one content chunk and usage, streamed."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        key = request.headers.get("Authorization", "")
        seen = seen_by_key.setdefault(key, set())
        urls = [p["image_url"]["url"] for p in body["messages"][-1]["content"] if p["type"] == "image_url"]
        new = 0
        for url in urls:
            new += url not in seen
            seen.add(url)
        new_counts.append(new)
        await asyncio.sleep(NEW_S if new else SEEN_S)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n')
        await resp.write(b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], '
                         b'"usage": {"prompt_tokens": 5, "completion_tokens": 1}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application(client_max_size=2**24)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def test_a_run_reports_the_encoders_share_of_ttft():
    seen_by_key: dict = {}
    new_counts: list[int] = []
    parser = argparse.ArgumentParser()
    _add_load_args(parser)

    async def go():
        async with TestServer(_encoder_like_app(seen_by_key, new_counts), host="127.0.0.1") as server:
            args = parser.parse_args([
                "--base-url", str(server.make_url("/v1")), "--api-key", "k", "--api", "chat", "--concurrency", "1",
                "--num-requests", "24", "--input-len", "4", "--output-len", "1", "--images", "2",
                "--image-size", "16x16", "--image-repeat", "0.8", "--image-pool", "3", "--seed",
                str(random.randrange(1000))])
            return await run_scenario(scenario_from_args(args))

    result = asyncio.run(go())
    records = sorted(result.records, key=lambda r: r.sent_s)
    assert [r.new_images for r in records] == new_counts and all(r.ok and r.images == 2 for r in records)
    images = result.analysis["images"]
    assert images["ttft_new_s"]["count"] > 0 and images["ttft_repeated_s"]["count"] > 0, images
    # the server's own delays: (NEW_S - SEEN_S) / NEW_S = 0.875, less what the client and the loop add to both
    assert 0.5 < images["encoder_share"] < 0.95, images
    with pytest.raises(ValueError, match="--api chat"):
        scenario_from_args(parser.parse_args(["--base-url", "http://x/v1", "--rate", "1", "--images", "1"]))
