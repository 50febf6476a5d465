"""Images in chat completions to Qwen3.5-MoE, through the HTTP API of an in-process server on the session's tiny
random checkpoint (its tokenizer and Qwen-style chat template beside it): the official ``openai`` client's chats
with one image and with two get the greedy tokens transformers' ``Qwen3_5MoeForConditionalGeneration`` makes of
the inputs its own processor (``Qwen3VLProcessor``) builds, and are billed those inputs' prompt tokens."""

import random

import openai
import pytest
import torch

from gateway.chat_images import image_model_of
from tests.engine.vision.qwen3_vl_checkpoint import IMAGE_TOKEN, hf_greedy_pixels, random_image
from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key
from tests.gateway.test_chat_images import _processed, data_url

pytestmark = pytest.mark.timeout(240)
MAX_NEW = 6


def test_chats_with_images_match_transformers(tmp_path, qwen3_5_vl_checkpoint):
    path, model, tok, seed = qwen3_5_vl_checkpoint
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pictures = [random_image(gen, rng.randint(12, 40), rng.randint(12, 40)) for _ in range(3)]
    chats = [(["Look:", None, "What is it?"], pictures[:1]), (["Two:", None, None, "Same?"], pictures[1:])]
    with in_process_server(tmp_path, dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=4,
                                          cpu_threads=1, max_model_len=256), checkpoint=path) as srv:
        key = srv.run(new_tenant_key(srv.database_url))
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
        for parts, images in chats:
            # the reference: transformers' processor on the template's text, "image" parts for the pictures
            want_prompt, pixels = _processed(model, tok, [{"role": "user", "content": [
                {"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]}], images)
            want = hf_greedy_pixels(model, want_prompt, pixels, MAX_NEW)
            urls = iter(data_url(image) for image in images)
            content = [{"type": "image_url", "image_url": {"url": next(urls)}} if p is None else
                       {"type": "text", "text": p} for p in parts]
            reply = srv.run(client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": content}], max_tokens=MAX_NEW, temperature=0,
                logprobs=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}))
            got = [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content]
            assert got == want, f"seed={seed}"
            assert reply.usage.prompt_tokens == len(want_prompt), f"seed={seed}"
        model_images = image_model_of(srv.engine)
        assert want_prompt.count(IMAGE_TOKEN) == sum(model_images.num_tokens(*p.size) for p in pictures[1:]) > 2
