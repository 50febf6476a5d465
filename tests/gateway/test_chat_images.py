"""Images in chat completions, through the HTTP API of an in-process server on a tiny random Qwen3-VL-MoE
checkpoint with a tokenizer and a Qwen-style chat template: the official ``openai`` client's chat with an image
gets the greedy tokens transformers' ``Qwen3VLMoeForConditionalGeneration`` makes of the inputs transformers'
``Qwen3VLProcessor`` builds (the placeholders expanded by the processor itself), and bills those prompt tokens;
hostile images are a 400 naming the content part, and the engine serves the next request."""

import base64
import io
import json
import random
import shutil
import struct
import zlib

from PIL import Image

import openai
import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil, Qwen3VLProcessor

from engine.serving.protocol import Ready
from gateway.chat_images import ImageLimits, ImageRef, decode_images, image_model_of
from gateway.completion import chat_plan_of
from gateway.chat_plan import ParserChoice
from gateway.errors import APIError
from gateway.openai_schema import ChatCompletionRequest, decode_body
from tests.engine.vision.qwen3_vl_checkpoint import (
    IMAGE_CONFIG, IMAGE_TOKEN, VISION_END, VISION_START, VIDEO_TOKEN, VOCAB, hf_greedy_pixels, random_image,
)
from tests.gateway.byte_level_tokenizer import write_byte_level_tokenizer
from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key

pytestmark = pytest.mark.timeout(240)
MAX_NEW = 6

# Qwen's chat format: a user turn's image part writes <|vision_start|><|image_pad|><|vision_end|>
TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{ message.content }}{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{ content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
IM_START, ENDOFTEXT, IM_END = 196, 197, VOCAB - 1


def write_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Byte-level characters as tokens (printable ASCII and the newline, ids 0-95), the rest of the model's
    vocabulary filler, Qwen-VL's special tokens at the checkpoint's ids."""
    specials = {IM_START: "<|im_start|>", ENDOFTEXT: "<|endoftext|>", VISION_START: "<|vision_start|>",
                VISION_END: "<|vision_end|>", IMAGE_TOKEN: "<|image_pad|>", VIDEO_TOKEN: "<|video_pad|>",
                IM_END: "<|im_end|>"}
    return write_byte_level_tokenizer(path, VOCAB, specials, TEMPLATE, eos_token="<|im_end|>",
                                      pad_token="<|endoftext|>")


# The engine settings the image chat servers run with: a tiny pool of small blocks, one CPU thread.
SERVED_ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, cpu_threads=1, max_model_len=256)


def with_tokenizer(root, shared: str) -> tuple[str, PreTrainedTokenizerFast]:
    """A copy of the session's checkpoint ``shared`` under ``root`` with the tokenizer (its path and tokenizer):
    the session's checkpoint stays as other test files read it, with none."""
    path = str(root / "qwen3_vl")
    shutil.copytree(shared, path)
    return path, write_tokenizer(path)


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` and holds one tiny compressed row: a decompression bomb's header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def served(tmp_path_factory, qwen3_vl_checkpoint):
    root = tmp_path_factory.mktemp("chat_images")
    shared, model, seed = qwen3_vl_checkpoint
    path, tok = with_tokenizer(root, shared)
    with in_process_server(root, SERVED_ENGINE, checkpoint=path) as srv:
        key = srv.run(new_tenant_key(srv.database_url))
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
        yield srv, client, model, tok, seed


class _ImageOnlyProcessor(Qwen3VLProcessor):
    """Qwen3-VL's processor without a video processor (transformers' needs torchvision, not installed here)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        return type(argument)


def _processed(model, tok, messages, pictures) -> tuple[list[int], dict]:
    """transformers' prompt ids (its Qwen3-VL processor expands each placeholder to its image's tokens) and the
    pixel inputs, for ``messages`` whose image parts are ``{"type": "image"}``."""
    processor = _ImageOnlyProcessor(
        image_processor=Qwen2VLImageProcessorPil(
            patch_size=IMAGE_CONFIG.patch_size, temporal_patch_size=IMAGE_CONFIG.temporal_patch_size,
            merge_size=IMAGE_CONFIG.merge_size, image_mean=list(IMAGE_CONFIG.image_mean),
            image_std=list(IMAGE_CONFIG.image_std),
            size={"shortest_edge": IMAGE_CONFIG.min_pixels, "longest_edge": IMAGE_CONFIG.max_pixels}),
        tokenizer=tok, chat_template=TEMPLATE)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=pictures, return_tensors="pt")
    return inputs["input_ids"][0].tolist(), {"pixel_values": inputs["pixel_values"],
                                             "image_grid_thw": inputs["image_grid_thw"]}


def test_chat_with_an_image_matches_transformers(served):
    """One PNG in a user message between texts, one of which spells <|image_pad|>: the greedy tokens equal
    transformers' on its processor's inputs, and the prompt tokens billed are those inputs' (the image's tokens
    included; the spelled placeholder its plain characters, no image slot)."""
    srv, client, model, tok, seed = served
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    picture = random_image(gen, rng.randint(12, 40), rng.randint(12, 40))
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Look <|image_pad|> here:"},
        {"type": "image_url", "image_url": {"url": data_url(picture), "detail": "auto"}},
        {"type": "text", "text": "What is it?"}]}]
    # The reference: "@" where the client spelled the placeholder (the processor would take the spelling for an
    # image slot, which the server must not), then "@" swapped for the spelling's characters.
    marked = [{"role": "user", "content": [{"type": "text", "text": "Look @ here:"}, {"type": "image"},
                                           {"type": "text", "text": "What is it?"}]}]
    want_prompt, pixels = _processed(model, tok, marked, [picture])
    at = want_prompt.index(tok.convert_tokens_to_ids("@"))
    want_prompt[at:at + 1] = [tok.convert_tokens_to_ids(c) for c in "<|image_pad|>"]
    want = hf_greedy_pixels(model, want_prompt, pixels, MAX_NEW)

    reply = srv.run(client.chat.completions.create(
        model="demo", messages=messages, max_tokens=MAX_NEW, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}))
    got = [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content]
    assert got == want, f"seed={seed}"
    assert reply.usage.prompt_tokens == len(want_prompt), f"seed={seed}"
    assert want_prompt.count(IMAGE_TOKEN) == image_model_of(srv.engine).num_tokens(*picture.size) > 1


def test_jpeg_webp_and_animated_gif_first_frame(served):
    """A JPEG, a WebP and a two-frame GIF in one message: the tokens equal transformers' on the images Pillow
    opens from the same bytes (a GIF's first frame), and the prompt tokens billed are its processor's."""
    srv, client, model, tok, seed = served
    rng = random.Random(seed + 1)
    gen = torch.Generator().manual_seed(seed + 1)
    size = lambda: (rng.randint(12, 40), rng.randint(12, 40))  # noqa: E731
    jpeg, webp, first, second = (random_image(gen, *size()) for _ in range(4))
    gif = io.BytesIO()
    first.save(gif, format="GIF", save_all=True, append_images=[second.resize(first.size)], duration=100)
    urls = [data_url(jpeg, "JPEG"), data_url(webp, "WEBP"),
            "data:image/gif;base64," + base64.b64encode(gif.getvalue()).decode()]
    pictures = []
    for url in urls:  # what the client sent, as Pillow reads it: lossy pixels, the GIF's first frame (its
        opened = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))  # palette as transformers reads it)
        opened.seek(0)
        opened.load()
        pictures.append(opened)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Three:"}] + [
        {"type": "image_url", "image_url": {"url": u}} for u in urls]}]
    want_prompt, pixels = _processed(model, tok, [{"role": "user", "content": [
        {"type": "text", "text": "Three:"}] + [{"type": "image"}] * 3}], pictures)
    want = hf_greedy_pixels(model, want_prompt, pixels, MAX_NEW)
    reply = srv.run(client.chat.completions.create(
        model="demo", messages=messages, max_tokens=MAX_NEW, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}))
    assert [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content] == want, f"seed={seed}"
    assert reply.usage.prompt_tokens == len(want_prompt)


def _png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


HOSTILE = {
    "bad base64": ("data:image/png;base64,iVBORw0K!!!not*base64", "not valid base64"),
    "not an image": ("data:image/png;base64," + base64.b64encode(b"hello, this is text" * 8).decode(),
                     "not an image"),
    "declared 20000x20000": ("data:image/png;base64," + base64.b64encode(png_header_only(20000, 20000)).decode(),
                             "over the pixel limit"),  # past Pillow's own bomb limit
    "declared 5000x5000": ("data:image/png;base64," + base64.b64encode(png_header_only(5000, 5000)).decode(),
                           "5000x5000 pixels is over the limit"),  # past the gateway's
    "truncated": (None, "truncated or corrupt"),
    "aspect ratio 250": (data_url(Image.new("RGB", (250, 1))), "aspect ratio 250.0 is over 200"),
    "remote url": ("https://example.com/cat.png", "remote image URLs are off"),
    "not a data url": ("file:///etc/passwd", "must be a data: URL"),
}


def test_hostile_images_are_a_400_naming_the_part(served):
    """Each hostile image is a 400 naming messages[0].content[1] with its reason; the engine then serves a chat."""
    srv, client, model, tok, seed = served
    whole = _png_bytes(random_image(torch.Generator().manual_seed(seed), 32, 32))
    truncated = "data:image/png;base64," + base64.b64encode(whole[:len(whole) // 2]).decode()

    async def refused(url):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="demo", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]}])
        return info.value

    for name, (url, reason) in HOSTILE.items():
        err = srv.run(refused(url or truncated))
        assert err.status_code == 400 and err.body["param"] == "messages[0].content[1]", (name, err.body)
        assert reason in err.body["message"], (name, err.body)
    reply = srv.run(client.chat.completions.create(model="demo", max_tokens=2, messages=[
        {"role": "user", "content": "still up?"}]))
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_completions_prompt_with_the_image_placeholder_says_where_images_go(served):
    """/v1/completions takes no images: a prompt holding the image placeholder token (spelled in the text, or its
    id in a token-id prompt) is a 400 naming the prompt and saying to send images as chat image_url parts; a
    prompt without it is served, and so is the next request."""
    srv, client, model, tok, seed = served
    rng = random.Random(seed)
    words = "".join(rng.choice("abcdefgh ") for _ in range(6))

    async def refused(prompt):
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="demo", max_tokens=2, prompt=prompt)
        return info.value.body

    ids = [rng.randrange(0, 96) for _ in range(4)]
    cases = [(f"{words}<|image_pad|>{words}", "prompt"), ([*ids, IMAGE_TOKEN, *ids], "prompt"),
             ([words, f"<|vision_start|><|image_pad|><|vision_end|>{words}"], "prompt[1]")]
    for prompt, param in cases:
        body = srv.run(refused(prompt))
        assert body["param"] == param, (prompt, body)
        assert "image_url" in body["message"] and "/v1/chat/completions" in body["message"], body
        assert str(IMAGE_TOKEN) in body["message"] or "<|image_pad|>" in body["message"], body
    reply = srv.run(client.completions.create(model="demo", max_tokens=2, prompt=words))
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.prompt_tokens == len(words)


def test_request_limits_and_text_models():
    """Images per request and bytes per request, counted across the request's parts, refuse the part past the
    limit; a model that reads text only refuses the first image part (no engine: the refusal comes first)."""
    png = _png_bytes(random_image(torch.Generator().manual_seed(random.randrange(2**31)), 16, 16))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    refs = [ImageRef(f"messages[0].content[{j}]", url) for j in range(3)]

    class VisionModel:
        image_token_id = IMAGE_TOKEN
        num_tokens = staticmethod(lambda w, h: 4)

    for limits, at in ((ImageLimits(max_images=2), 2), (ImageLimits(max_request_image_bytes=2 * len(png) + 1), 2),
                       (ImageLimits(max_image_bytes=len(png) - 1), 0)):
        with pytest.raises(APIError) as info:
            decode_images(refs, VisionModel(), limits)
        assert info.value.status == 400 and info.value.param == f"messages[0].content[{at}]", (limits, info.value)
    assert [d.data for d in decode_images(refs, VisionModel(), ImageLimits(max_images=3))] == [png] * 3

    class TextEngine:
        info = Ready(model="m", architecture="Qwen3MoeForCausalLM", max_model_len=64, vocab_size=100,
                     has_tokenizer=True)

        def chat_template(self):
            return None

    body = decode_body(json.dumps({"model": "m", "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {
            "url": url}}]}]}).encode(), ChatCompletionRequest)
    with pytest.raises(APIError) as info:
        chat_plan_of(TextEngine(), body, ParserChoice(None, None))
    assert info.value.status == 400 and info.value.param == "messages[1].content[1]"
    assert "reads text only" in info.value.message
    assistant = decode_body(json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}).encode(),
        ChatCompletionRequest)
    with pytest.raises(APIError) as info:
        chat_plan_of(TextEngine(), assistant, ParserChoice(None, None))
    assert info.value.param == "messages[1].content[0]" and "only user messages" in info.value.message


# Remote image URLs, the Responses API's input_image, /tokenize and Batch API lines with images: collected here to
# run on this module's server (tests/gateway/media_api_cases.py).
from tests.gateway.media_api_cases import (  # noqa: E402,F401
    media, reference, test_batch_lines_with_images, test_connections_go_to_the_checked_address,
    test_hostile_remote_urls_are_a_400_naming_the_part, test_remote_image_url_and_responses_input_image_match_transformers,
    test_tokenize_counts_image_tokens,
)
# Per-tenant image limits (moegate admin quota set --max-images-per-request / --max-image-pixels), on the same
# server (tests/gateway/image_limit_cases.py).
from tests.gateway.image_limit_cases import (  # noqa: E402,F401
    tenant_keys, test_responses_name_the_image_they_refuse_in_input_or_in_the_stored_conversation,
    test_server_image_limit_flags, test_tenant_image_limits_tighten_the_servers,
    test_tokenize_applies_the_tenants_image_limits,
)
