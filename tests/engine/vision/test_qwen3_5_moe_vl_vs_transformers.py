"""Qwen3.5-MoE served with images: greedy tokens equal transformers' ``Qwen3_5MoeForConditionalGeneration`` on a
tiny random checkpoint (every parameter random), its prompts and pixels built by transformers' own processor
(``Qwen3VLProcessor``, the one Qwen3.5 names), for a chat with one image, one with two images and a text-only one,
batched and prefilled in chunks that cut through images, its hybrid layers' states checkpointed for the prefix
cache. The same chat with another picture gives that picture's own tokens (image blocks and state checkpoints
are keyed by the picture), the first picture again hits its cached prefix. The tower (Qwen3-VL's, without
deepstack taps) is checked on its own, and the checkpoint served as its text model (``language_model_only``)."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.family_support import check_family_support
from engine.core.model_config import load_model_config
from engine.vision.qwen_image_processing import process_image
from tests.engine.vision.qwen3_vl_checkpoint import (IMAGE_CONFIG, IMAGE_TOKEN, hf_greedy_pixels, random_image,
                                                     tower_against_transformers)
from tests.gateway.test_chat_images import _processed

MAX_NEW = 8


def _chat(*parts: str | None) -> list[dict]:
    """One user message: text parts, None for an image."""
    return [{"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p}
                                         for p in parts]}]


def test_vision_tower_matches_transformers(qwen3_5_vl_checkpoint):
    """The tower alone, from the model's own weights: the merged features of two images of different grids, and
    no deepstack taps."""
    _, model, _, seed = qwen3_5_vl_checkpoint
    gen = torch.Generator().manual_seed(seed)
    images = [process_image(random_image(gen, w, h), IMAGE_CONFIG) for w, h in ((37, 21), (20, 50))]
    ours, _ = tower_against_transformers(model, images)
    assert [features.deepstack.shape[0] for features in ours] == [0, 0]


def test_greedy_matches_transformers(qwen3_5_vl_checkpoint):
    path, model, tok, seed = qwen3_5_vl_checkpoint
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    size = lambda: (rng.randint(12, 40), rng.randint(12, 40))  # noqa: E731
    pics = [random_image(gen, *size()) for _ in range(3)]
    chats = [(_chat("Look:", None, "What is it?"), pics[:1]),
             (_chat("Two:", None, "and", None, "Same?"), pics[1:3]),
             (_chat("No picture, only text here."), [])]
    cases = [_processed(model, tok, messages, pictures) for messages, pictures in chats[:2]]
    cases.append((tok(tok.apply_chat_template(chats[2][0], tokenize=False, add_generation_prompt=True))["input_ids"],
                  {}))
    expected = [hf_greedy_pixels(model, ids, pixels, MAX_NEW) for ids, pixels in cases]
    assert all(ids.count(IMAGE_TOKEN) > 1 for ids, _ in cases[:2]) and IMAGE_TOKEN not in cases[2][0]
    # the first chat with another picture of the same size: a tiny random model can answer two pictures alike,
    # so draw until it does not
    for _ in range(12):
        other = random_image(gen, *pics[0].size)
        other_ids, other_pixels = _processed(model, tok, chats[0][0], [other])
        expected_other = hf_greedy_pixels(model, other_ids, other_pixels, MAX_NEW)
        if expected_other != expected[0]:
            break
    assert other_ids == cases[0][0] and expected_other != expected[0], f"seed={seed}: the test would be blind"

    # 16-token steps cut the image prompts into chunks, some through an image's placeholders; a state checkpoint
    # every block of 4 tokens, so the prefix cache can resume inside the image
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.token_ids for o in llm.generate([ids for ids, _ in cases], params,
                                             images=[pictures for _, pictures in chats])]
    assert got == expected, f"seed={seed}"
    kv = llm.engine.scheduler.kv
    one = cases[0][0]
    hits_before = kv.prefix_hit_tokens
    assert llm.generate([one], params, images=[[other]])[0].token_ids == expected_other, f"seed={seed}"
    assert kv.prefix_hit_tokens - hits_before <= one.index(IMAGE_TOKEN) // 4 * 4
    hits_before = kv.prefix_hit_tokens
    assert llm.generate([one], params, images=[[pics[0]]])[0].token_ids == expected[0], f"seed={seed}"
    assert kv.prefix_hit_tokens - hits_before > one.index(IMAGE_TOKEN) // 4 * 4, "no hit past the image's start"


def test_language_model_only_serves_the_text_model(qwen3_5_vl_checkpoint):
    """``language_model_only``: the same checkpoint served as its text model (transformers' tokens on a text chat,
    images refused), with tensor parallelism open to it as to the text model (and with images: the tower on rank 0,
    tests/distributed/test_image_tensor_parallel.py)."""
    path, model, tok, seed = qwen3_5_vl_checkpoint
    ids = tok(tok.apply_chat_template(_chat("Only text, no picture."), tokenize=False,
                                      add_generation_prompt=True))["input_ids"]
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=16, language_model_only=True)
    assert not llm.engine.model.takes_images
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    assert llm.generate([ids], params)[0].token_ids == hf_greedy_pixels(model, ids, {}, MAX_NEW), f"seed={seed}"
    picture = random_image(torch.Generator().manual_seed(seed), 16, 16)
    with pytest.raises(ValueError, match="images were given but Qwen3_5MoeForConditionalGeneration reads text only"):
        llm.generate([[5, IMAGE_TOKEN, IMAGE_TOKEN, 6]], params, images=[[picture]])
    for text_only in (False, True):  # the text model split as it is, with images or not (the tower on rank 0)
        config = EngineConfig(model=path, tensor_parallel_size=2, language_model_only=text_only)
        check_family_support(config, load_model_config(path, text_only))
