"""Qwen3-VL-MoE with layer-chunked encoding (``max_num_encoder_token_blocks``): a budget of two thirds of one stage
of the smallest image a step, so every image's tower (with its deepstack taps) runs over several steps, its blocks
split over its rows (``engine.vision.tower_rows``); greedy tokens
equal transformers' for prompts with one image, two images and none, with steps overlapped or not; and with a KV
pool too small for all of them, requests preempted while an image is part-way through the tower resume with the
state kept and still give transformers' tokens."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.vision.qwen_image_processing import process_image
from tests.engine.vision.qwen3_vl_checkpoint import IMAGE_CONFIG, hf_greedy, random_image, text_ids, with_images
from tests.engine.vision.tower_pieces import check_recorded_pieces

MAX_NEW = 8
STAGES, MERGE = 3, 4  # the tiny tower's stages (patch embedding, 2 blocks), patches per image token


def _cases(model, seed: int, n: int):
    """(prompt, processed images) with one image, two, none (then the first two again up to ``n``), their
    transformers greedy tokens, and the budget: two thirds of one block of the smallest image."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    processed = [process_image(random_image(gen, rng.randint(12, 40), rng.randint(12, 40)), IMAGE_CONFIG)
                 for _ in range(3)]
    cases = [(with_images(rng, processed[:1]), processed[:1]), (with_images(rng, processed[1:]), processed[1:]),
             (text_ids(rng, rng.randint(5, 20)), [])]
    cases = (cases * 2)[:n]
    expected = [hf_greedy(model, p, im, MAX_NEW) for p, im in cases]
    budget = min(p.num_tokens(IMAGE_CONFIG.merge_size) for p in processed) * MERGE * 2 // 3
    return cases, expected, budget


def _recording(llm: LLM) -> list:
    """The encoder pieces each step runs, recorded as the model runs them; a whole image's encoding (which
    layer-chunked encoding never needs) fails the test."""
    model, seen = llm.engine.runner.model, []
    run = model.encode_pieces

    def whole(pixels):
        raise AssertionError("an image was encoded whole")
    model.encode = whole

    def record(pieces):
        seen.append([(p.request.request_id, p.image, p.first, p.end, p.total) for p in pieces])
        run(pieces)
    model.encode_pieces = record
    return seen


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_greedy_matches_transformers_with_layer_chunked_encoding(qwen3_vl_checkpoint, overlap):
    path, model, seed = qwen3_vl_checkpoint
    cases, expected, budget = _cases(model, seed, 3)
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=48, block_size=4, max_num_batched_tokens=16,
              max_num_encoder_token_blocks=budget, encoder_cache_gb=0.0, overlap_scheduling=overlap)
    seen = _recording(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.token_ids for o in llm.generate([p for p, _ in cases], params, images=[im for _, im in cases])]
    assert got == expected, f"seed={seed}"
    assert check_recorded_pieces(seen, budget, STAGES) == 3


def test_preempted_mid_encoding_resumes_and_matches_transformers(qwen3_vl_checkpoint):
    """A pool of blocks of 4 tokens that holds the largest request and nothing beside it (the five are three prompts,
    two of them twice), so some are preempted (4 to 10 times in 12 seeds measured, 1 to 7 with the 16 blocks this test had);
    and the first request found with an image part-way through the tower is preempted there too (the scheduler's
    recompute preemption): its kept state is resumed, not begun again, and every request still gives
    transformers' tokens."""
    path, model, seed = qwen3_vl_checkpoint
    cases, expected, budget = _cases(model, seed + 1, 5)
    blocks = max(-(-(len(prompt) + MAX_NEW) // 4) for prompt, _ in cases)
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=16,
              max_num_encoder_token_blocks=budget, encoder_cache_gb=0.0, enable_prefix_caching=False)
    engine, scheduler = llm.engine, llm.engine.scheduler
    seen = _recording(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for k, (prompt, images) in enumerate(cases):
        engine.add_request(prompt, params, request_id=f"c{k}", images=images)
    got: dict[str, list[int]] = {f"c{k}": [] for k in range(len(cases))}
    partly = None  # the request preempted with an image part-way through the tower
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
        if partly is None:
            partly = next((r for r in scheduler.running
                           if any(0 < n < 2 * r.images[i].num_tokens * MERGE * STAGES
                                  for i, n in r.encoder_blocks.items())), None)
            if partly is not None:
                scheduler._preempt(partly, [])
    assert partly is not None and partly.num_preemptions >= 1
    assert [got[f"c{k}"] for k in range(len(cases))] == expected, f"seed={seed}"
    assert scheduler.num_preemptions > 1, "the small KV pool should have forced preemption too"
    assert check_recorded_pieces(seen, budget, STAGES) == sum(len(im) for _, im in cases)  # no pass run twice
