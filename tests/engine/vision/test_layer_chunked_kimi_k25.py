"""Kimi-K2.5 with layer-chunked encoding (``max_num_encoder_token_blocks``): a budget of two thirds of one stage of
the smallest image a step, so every image's MoonViT pass runs over several steps, its blocks split over its rows
(``engine.vision.tower_rows``), then its projector; greedy tokens equal
transformers' for prompts with one image, two images and none, prefilled in chunks that cut through images."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.vision.kimi_k25_checkpoint import IMAGE_CONFIG, make_kimi_k25, random_image
from tests.engine.vision.test_kimi_k25_vs_transformers import three_cases
from tests.engine.vision.tower_pieces import check_recorded_pieces
from tests.greedy_ties import assert_greedy_equal_up_to_a_near_tie

STAGES, MERGE = 3, 4  # the tiny MoonViT's stages (patch embedding, 2 blocks), patches per image token


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    seed = random.randrange(2**31)
    path = str(tmp_path_factory.mktemp("kimi_k25_chunked"))
    return path, make_kimi_k25(path, seed), seed


def test_greedy_matches_transformers_with_layer_chunked_encoding(checkpoint):
    path, model, seed = checkpoint
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed + 2)
    pics = [random_image(gen, rng.randint(12, 60), rng.randint(12, 60)) for _ in range(3)]
    grids = [IMAGE_CONFIG.grid(p.size[1], p.size[0]) for p in pics]
    cases, refs, expected = three_cases(model, rng, pics, seed)
    budget = min(h * w for h, w in grids) * 2 // 3  # two thirds of one block of the smallest image
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=48, block_size=4, max_num_batched_tokens=16,
              max_num_encoder_token_blocks=budget, encoder_cache_gb=0.0)
    runner_model, seen = llm.engine.runner.model, []
    run = runner_model.encode_pieces

    def record(pieces):
        seen.append([(p.request.request_id, p.image, p.first, p.end, p.total) for p in pieces])
        run(pieces)
    runner_model.encode_pieces = record
    params = SamplingParams(temperature=0.0, max_tokens=len(expected[0]), ignore_eos=True)
    outs = llm.generate([p for p, _ in cases], params, images=[im for _, im in cases])
    for i, (out, want, ref, (prompt, _)) in enumerate(zip(outs, expected, refs, cases)):
        assert_greedy_equal_up_to_a_near_tie(ref, prompt, out.token_ids, want, f"seed={seed} case {i}")
    assert check_recorded_pieces(seen, budget, STAGES) == 3
