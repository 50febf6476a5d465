"""Images in chat completions, through the HTTP API of an in-process server on a tiny random Qwen3-VL-MoE
checkpoint with a tokenizer and a Qwen-style chat template: the official ``openai`` client's chat with an image
gets the greedy tokens transformers' ``Qwen3VLMoeForConditionalGeneration`` makes of the inputs transformers'
``Qwen3VLProcessor`` builds (the placeholders expanded by the processor itself), and bills those prompt tokens;
hostile images are a 400 naming the content part, and the engine serves the next request."""

import asyncio
import base64
import io
import json
import random
import struct
import zlib

import openai
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil, Qwen3VLProcessor

from engine.serving.protocol import Ready
from gateway.chat_images import ImageLimits, ImageRef, decode_images, image_model_of
from gateway.completion import chat_plan_of
from gateway.chat_plan import ParserChoice
from gateway.errors import APIError
from gateway.openai_schema import ChatCompletionRequest, decode_body
from tests.engine.vision.qwen3_vl_checkpoint import (
    IMAGE_CONFIG, IMAGE_TOKEN, VISION_END, VISION_START, VIDEO_TOKEN, VOCAB, make_qwen3_vl_moe, random_image,
)
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
    chars = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]  # byte-level's space and newline
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["<unk>"] = len(vocab)
    specials = {IM_START: "<|im_start|>", ENDOFTEXT: "<|endoftext|>", VISION_START: "<|vision_start|>",
                VISION_END: "<|vision_end|>", IMAGE_TOKEN: "<|image_pad|>", VIDEO_TOKEN: "<|video_pad|>",
                IM_END: "<|im_end|>"}
    for i in range(len(vocab), VOCAB):
        vocab[specials.get(i, f"<unused{i}>")] = i
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                                                 pre_tokenizers.Split("", behavior="isolated")])
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials.values()])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="<unk>", chat_template=TEMPLATE)
    tok.save_pretrained(path)
    return tok


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
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_images")
    path = str(root / "qwen3_vl")
    seed = random.randrange(2**31)
    model = make_qwen3_vl_moe(path, seed)
    with open(f"{path}/preprocessor_config.json", "w") as f:
        json.dump({"patch_size": IMAGE_CONFIG.patch_size, "temporal_patch_size": IMAGE_CONFIG.temporal_patch_size,
                   "merge_size": IMAGE_CONFIG.merge_size, "image_mean": list(IMAGE_CONFIG.image_mean),
                   "image_std": list(IMAGE_CONFIG.image_std),
                   "size": {"shortest_edge": IMAGE_CONFIG.min_pixels, "longest_edge": IMAGE_CONFIG.max_pixels}}, f)
    tok = write_tokenizer(path)
    with in_process_server(root, dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, cpu_threads=1,
                                      max_model_len=256), checkpoint=path) as srv:
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


def _greedy(model, prompt: list[int], pixels: dict) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
                             max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0, **pixels)
    return out[0, len(prompt):].tolist()


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
    want = _greedy(model, want_prompt, pixels)

    reply = srv.run(client.chat.completions.create(
        model="demo", messages=messages, max_tokens=MAX_NEW, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}))
    got = [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content]
    assert got == want, f"seed={seed}"
    assert reply.usage.prompt_tokens == len(want_prompt), f"seed={seed}"
    assert want_prompt.count(IMAGE_TOKEN) == image_model_of(srv.engine).num_tokens(*picture.size) > 1
