"""Qwen3-VL-MoE split over 2 tensor-parallel ranks with layer-chunked encoding (``max_num_encoder_token_blocks``:
one block of the smallest image a step, so each image's tower runs over several steps on rank 0, its part-way
state rank 0's alone): transformers' greedy tokens for a prompt with one image, one with two and a text-only one;
an image finished piece by piece enters rank 0's encoder cache (the first picture under other text is a hit)."""

import pytest

from tests.distributed.ranks import run_ranks_each
from tests.distributed.test_image_tensor_parallel import MAX_NEW, _generate, _qwen_cases
from tests.engine.vision import qwen3_vl_checkpoint as qwen
from tests.greedy_ties import assert_greedy_equal_up_to_a_near_tie


@pytest.mark.timeout(300)
def test_split_qwen3_vl_with_layer_chunked_encoding_generates_transformers_tokens(qwen3_vl_checkpoint):
    path, model, seed = qwen3_vl_checkpoint
    prompts, images, expected, refs, budget = _qwen_cases(model, seed)
    merge = qwen.IMAGE_CONFIG.merge_size
    token_blocks = min(p.num_tokens(merge) for p in images[1]) * merge ** 2  # one block of the smaller of the two
    args = {"chunked": (path, prompts, images, budget, "visual", token_blocks)}
    status, value = run_ranks_each(_generate, 1, args, timeout_s=240)["chunked"].get(0, ("missing", None))
    assert status == "ok", f"seed={seed}: {value}"
    cases = zip(prompts + prompts[:1], value["tokens"], expected + expected[:1], refs + refs[:1])
    for i, (prompt, got, want, ref) in enumerate(cases):
        assert len(got) == MAX_NEW
        assert_greedy_equal_up_to_a_near_tie(ref, prompt, got, want, f"seed={seed} case {i}")
    assert value["tower"], "rank 0 holds the vision tower"
    assert value["cache_hits"] >= 1, f"the first image, encoded piece by piece, was not cached (seed={seed})"
