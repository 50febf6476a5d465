"""An image in a chat completion to Kimi-K2.5, through the HTTP API of an in-process server on a tiny random
checkpoint with a tokenizer and a Kimi-style chat template: the official ``openai`` client's chat gets the greedy
tokens transformers' ``Kimi_K25ForConditionalGeneration`` makes of the same prompt (the template's one
``<|media_pad|>`` per image repeated to the image's tokens, as transformers' Kimi-K2.5 processor writes them) and
its reference pixels (up to a near tie), and bills those prompt tokens."""

import base64
import io
import random

import openai
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from gateway.chat_images import image_model_of
from tests.engine.vision.kimi_k25_checkpoint import (IMAGE_CONFIG, IMAGE_TOKEN, VISION_END, VISION_START, VOCAB,
                                                     make_kimi_k25, random_image, reference_pixels)
from tests.gateway.byte_level_tokenizer import write_byte_level_tokenizer
from tests.gateway.in_process import in_process_server
from tests.greedy_ties import assert_greedy_equal_up_to_a_near_tie
from tests.gateway.tenant_keys import new_tenant_key

pytestmark = pytest.mark.timeout(240)
MAX_NEW = 6
IM_USER, IM_ASSISTANT, IM_MIDDLE, MEDIA_CONTENT, IM_END = 192, 193, 194, 195, VOCAB - 1

# Kimi's chat format: a user turn's image part writes <|media_begin|>image<|media_content|><|media_pad|><|media_end|>
TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{ '<|im_user|>user<|im_middle|>' }}"
    "{%- else %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"
    "{%- if message.content is string %}{{ message.content }}{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{{ '<|media_begin|>image<|media_content|><|media_pad|><|media_end|>' }}"
    "{%- elif 'text' in content %}{{ content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}"
)


def write_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Byte-level characters as tokens (printable ASCII and the newline, ids 0-95), the rest of the vocabulary
    filler, Kimi's special tokens at the checkpoint's ids."""
    specials = {IM_USER: "<|im_user|>", IM_ASSISTANT: "<|im_assistant|>", IM_MIDDLE: "<|im_middle|>",
                MEDIA_CONTENT: "<|media_content|>", VISION_START: "<|media_begin|>", VISION_END: "<|media_end|>",
                IMAGE_TOKEN: "<|media_pad|>", IM_END: "<|im_end|>"}
    return write_byte_level_tokenizer(path, VOCAB, specials, TEMPLATE, eos_token="<|im_end|>")


def test_chat_with_an_image_matches_transformers(tmp_path):
    seed = random.randrange(2**31)
    path = str(tmp_path / "kimi_k25")
    model = make_kimi_k25(path, seed)
    tok = write_tokenizer(path)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Look:"}, {"type": "image"}, {"type": "text", "text": "What is it?"}]}],
        tokenize=False, add_generation_prompt=True)
    p = IMAGE_CONFIG.patch_size
    for _ in range(10):  # another picture while the reference samples the placeholder (it cannot read one back)
        picture = random_image(gen, rng.randint(12, 60), rng.randint(12, 60))
        # the reference: the template's text tokenized, its one placeholder repeated to the image's tokens
        pixels, grid = reference_pixels(picture, IMAGE_CONFIG)
        ids = tok(text)["input_ids"]
        at = ids.index(IMAGE_TOKEN)
        want_prompt = ids[:at] + [IMAGE_TOKEN] * (grid[1] * grid[2] // 4) + ids[at + 1:]

        def last_logits(ids: list[int], pixels=pixels, grid=grid) -> torch.Tensor:
            with torch.no_grad():
                return model(torch.tensor([ids]), pixel_values=pixels.view(-1, 3, p, p),
                             image_grid_thw=torch.tensor([grid]), use_cache=False).logits[0, -1]
        prompt = list(want_prompt)
        while len(prompt) < len(want_prompt) + MAX_NEW and IMAGE_TOKEN not in prompt[len(want_prompt):]:
            prompt.append(int(last_logits(prompt).argmax()))
        if IMAGE_TOKEN not in prompt[len(want_prompt):]:
            break
    want = prompt[len(want_prompt):]
    assert IMAGE_TOKEN not in want, f"seed={seed}"
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    with in_process_server(tmp_path, dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=4,
                                          cpu_threads=1, max_model_len=256), checkpoint=path) as srv:
        key = srv.run(new_tenant_key(srv.database_url))
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
        reply = srv.run(client.chat.completions.create(
            model="demo", max_tokens=MAX_NEW, temperature=0, logprobs=True,
            messages=[{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                                   {"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "What is it?"}]}],
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}))
        got = [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content]
        assert_greedy_equal_up_to_a_near_tie(last_logits, want_prompt, got, want, f"seed={seed}")
        assert len(got) == MAX_NEW
        assert reply.usage.prompt_tokens == len(want_prompt), f"seed={seed}"
        assert image_model_of(srv.engine).num_tokens(*picture.size) == want_prompt.count(IMAGE_TOKEN) > 1
