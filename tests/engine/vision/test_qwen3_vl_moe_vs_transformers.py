"""Qwen3-VL-MoE served with images: greedy tokens equal transformers' ``Qwen3VLMoeForConditionalGeneration`` on a
tiny random checkpoint (every parameter random) for a chat with one image, one with two images and a text-only
one, batched and prefilled in chunks that cut through images, with steps overlapped or not; the same text with
another image gives that image's own tokens (its image blocks are keyed by the picture, so the prefix cache does
not hand it the first image's). The tower's features and the prompt's M-RoPE positions are checked on their own."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.vision.mrope import ImageSpan, prompt_positions
from engine.vision.prompt_images import placeholder_runs
from engine.vision.qwen_image_processing import process_image
from tests.engine.vision.image_engine_checks import (check_image_blocks_keyed_by_picture,
                                                       check_misfit_images_refused)
from tests.engine.vision.qwen3_vl_checkpoint import (IMAGE_CONFIG, IMAGE_TOKEN, VISION_END, VISION_START, hf_greedy,
                                                     loaded_tower, random_image, text_ids,
                                                     tower_against_transformers, with_images)
from tests.engine.vision.tower_pieces import run_in_random_pieces

MAX_NEW = 8


def test_prompt_positions_match_transformers(qwen3_vl_checkpoint):
    """M-RoPE positions of a prompt with two images of different grids (one taller, one wider) and its delta."""
    _, model, seed = qwen3_vl_checkpoint
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    images = [process_image(random_image(gen, w, h), IMAGE_CONFIG) for w, h in ((20, 50), (44, 18))]
    prompt = with_images(rng, images)
    ids = torch.tensor([prompt])
    want, want_delta = model.model.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
                                                  image_grid_thw=torch.tensor([p.grid_thw for p in images]))
    runs = placeholder_runs(prompt, IMAGE_TOKEN)
    spans = [ImageSpan(start, p.grid_thw[1] // 2, p.grid_thw[2] // 2) for (start, _), p in zip(runs, images)]
    got, delta = prompt_positions(len(prompt), spans)
    assert torch.equal(got, want[:, 0]) and delta == int(want_delta)
    assert delta < 0


def test_vision_tower_matches_transformers(qwen3_vl_checkpoint):
    """The tower alone, loaded from the model's own weights: merged features and deepstack taps of two images of
    different grids; and the same with its stages run over row ranges in random pieces (layer-chunked encoding's
    passes, ``engine.vision.tower_rows``)."""
    _, model, seed = qwen3_vl_checkpoint
    gen = torch.Generator().manual_seed(seed)
    images = [process_image(random_image(gen, w, h), IMAGE_CONFIG) for w, h in ((37, 21), (20, 50))]
    assert images[0].grid_thw != images[1].grid_thw
    ours, ref = tower_against_transformers(model, images)
    for i, features in enumerate(ours):
        assert features.deepstack.shape[0] == 2
        for k in range(2):
            torch.testing.assert_close(features.deepstack[k], ref.deepstack_features[k][i], rtol=1e-5, atol=1e-5)
    # its stages split over row ranges, as layer-chunked encoding runs them: the same features
    tower, rng = loaded_tower(model), random.Random(seed)
    for i, image in enumerate(images):
        split = run_in_random_pieces(tower, image.pixel_values, image.grid_thw, rng, whole_block=i % 2)
        torch.testing.assert_close(split.embeds, ref.pooler_output[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(split.embeds, ours[i].embeds, rtol=1e-6, atol=1e-6)
        for k in range(2):
            torch.testing.assert_close(split.deepstack[k], ref.deepstack_features[k][i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_greedy_matches_transformers(qwen3_vl_checkpoint, overlap):
    path, model, seed = qwen3_vl_checkpoint
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pics = [random_image(gen, rng.randint(12, 40), rng.randint(12, 40)) for _ in range(4)]
    processed = [process_image(p, IMAGE_CONFIG) for p in pics]
    one = with_images(rng, processed[:1])
    two = with_images(rng, processed[1:3])
    text = text_ids(rng, rng.randint(5, 20))
    # the first prompt again with the fourth image in place of the first, when its placeholders are as many
    other = processed[3] if processed[3].grid_thw == processed[0].grid_thw else processed[0]
    if other is processed[0]:  # redraw the fourth image at the first's size: same tokens, another picture
        pics[3] = random_image(gen, *pics[0].size)
        other = processed[3] = process_image(pics[3], IMAGE_CONFIG)
    assert other.grid_thw == processed[0].grid_thw and not torch.equal(other.pixel_values, processed[0].pixel_values)
    cases = [(one, processed[:1]), (two, processed[1:3]), (text, [])]
    expected = [hf_greedy(model, p, im, MAX_NEW) for p, im in cases]
    expected_other = hf_greedy(model, one, [other], MAX_NEW)
    # a tiny random model can answer two pictures alike: draw another until it does not, and every fourth try the
    # first prompt's text too (one text may be answered alike whatever picture comes with it)
    for attempt in range(1, 24):
        if expected_other != expected[0]:
            break
        if attempt % 4 == 0:
            one = with_images(rng, processed[:1])
            cases[0] = (one, processed[:1])
            expected[0] = hf_greedy(model, one, processed[:1], MAX_NEW)
        pics[3] = random_image(gen, *pics[0].size)
        other = processed[3] = process_image(pics[3], IMAGE_CONFIG)
        expected_other = hf_greedy(model, one, [other], MAX_NEW)
    assert expected_other != expected[0], \
        f"seed={seed}: 24 images over 6 texts gave the same tokens (the test would be blind)"

    # 16-token steps cut the image prompts into chunks, some through an image's placeholders
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=32, block_size=4, max_num_batched_tokens=16,
              overlap_scheduling=overlap)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    # the engine preprocesses encoded bytes and PIL images itself; pixel tensors are taken as they are
    images = [[pics[0]], [processed[1], processed[2]], []]
    got = [o.token_ids for o in llm.generate([p for p, _ in cases], params, images=images)]
    assert got == expected, f"seed={seed}"
    # the same text with another picture: its own tokens, no prefix hit past the text before the image; and the
    # first picture again: its blocks are hit, and the tokens are its own
    want = {"other": expected_other, "again": expected[0]}

    def check(tokens, case):
        assert tokens == want[case], f"seed={seed} {case}"
    check_image_blocks_keyed_by_picture(llm, params, one, IMAGE_TOKEN, pics[3], pics[0], check)


def test_preempted_image_requests_resume_with_their_images(qwen3_vl_checkpoint):
    """A pool of blocks of 4 tokens that holds the largest request and nothing beside it (five requests: three
    prompts, two of them twice): some are preempted and recompute their prompts, images included, and still give
    transformers' tokens."""
    path, model, seed = qwen3_vl_checkpoint
    rng = random.Random(seed + 1)
    gen = torch.Generator().manual_seed(seed + 1)
    processed = [process_image(random_image(gen, rng.randint(12, 40), rng.randint(12, 40)), IMAGE_CONFIG)
                 for _ in range(3)]
    cases = [(with_images(rng, processed[:1]), processed[:1]), (with_images(rng, processed[1:]), processed[1:]),
             (text_ids(rng, rng.randint(5, 20)), [])]
    cases += cases[:2]
    expected = [hf_greedy(model, p, im, MAX_NEW) for p, im in cases[:3]]
    expected += expected[:2]
    # The pool holds the largest request and nothing beside it, so the five sent together must preempt (16 blocks
    # held the shortest draws, images of 12 pixels and the fewest text tokens, without a preemption).
    blocks = max(-(-(len(prompt) + MAX_NEW) // 4) for prompt, _ in cases)
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.token_ids for o in llm.generate([p for p, _ in cases], params, images=[im for _, im in cases])]
    assert got == expected, f"seed={seed}"
    assert llm.engine.scheduler.num_preemptions > 0, "the small KV pool should have forced preemption"


def test_images_that_do_not_fit_the_prompt_are_refused(qwen3_vl_checkpoint):
    path, _, seed = qwen3_vl_checkpoint
    gen = torch.Generator().manual_seed(seed)
    image = process_image(random_image(gen, 20, 20), IMAGE_CONFIG)
    n = image.num_tokens(IMAGE_CONFIG.merge_size)
    check_misfit_images_refused(path, image, n, IMAGE_TOKEN, VISION_START, VISION_END)
