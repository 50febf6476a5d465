"""Kimi-K2.5 as published: INT4 routed experts (compressed-tensors pack-quantized, ``quantization_config`` at the top
of config.json, not in its text_config) beside the bfloat16-kept vision tower and projector. A tiny random checkpoint
whose experts compressed-tensors' own compressor quantized: the engine loads them packed and its greedy tokens, for a
prompt with an image and a text-only one, equal transformers' on the same checkpoint (up to a near tie: the image
features pass through another implementation of the tower)."""

import random

import pytest
import torch
from transformers import AutoModelForImageTextToText

from engine import LLM, SamplingParams
from tests.engine.loading.int4_checkpoint import float_experts_, write_int4
from tests.engine.vision.kimi_k25_checkpoint import IMAGE_CONFIG, make_kimi_k25, random_image
from tests.engine.vision.test_kimi_k25_vs_transformers import MAX_NEW, _reference, _text, _with_images, draw_case
from tests.greedy_ties import assert_greedy_equal_up_to_a_near_tie


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    seed = random.randrange(2**31)
    src, path = str(tmp_path_factory.mktemp("k25_src")), str(tmp_path_factory.mktemp("k25_int4"))
    make_kimi_k25(src, seed, moe_intermediate_size=64)  # two scale groups of 32 along the down projection
    write_int4(src, path)
    return path, seed


def test_int4_kimi_k25_greedy_matches_transformers(checkpoint):
    path, seed = checkpoint
    rng = random.Random(seed)
    picture = random_image(torch.Generator().manual_seed(seed + 1), rng.randint(28, 48), rng.randint(28, 48))
    grid = IMAGE_CONFIG.grid(picture.size[1], picture.size[0])
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    float_experts_(model)
    cases = []
    for draw, images in ((lambda: _with_images(rng, [(1, *grid)]), [picture]), (lambda: _text(rng, 12), [])):
        ref = _reference(model, images)
        prompt, want = draw_case(ref, draw, seed)
        cases.append((prompt, images, ref, want))

    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=48, block_size=4)
    experts = llm.engine.model.model.layers[1].mlp.experts
    assert experts.scheme.method == "int4" and experts.w13.dtype == torch.int32
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([c[0] for c in cases], params, images=[c[1] for c in cases])
    for i, (out, (prompt, _, ref, want)) in enumerate(zip(outs, cases)):
        assert_greedy_equal_up_to_a_near_tie(ref, prompt, out.token_ids, want, f"seed={seed} case {i}")
