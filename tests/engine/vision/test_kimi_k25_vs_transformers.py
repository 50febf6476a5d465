"""Kimi-K2.5 served with images: greedy tokens equal transformers' ``Kimi_K25ForConditionalGeneration`` on a tiny
random checkpoint (every parameter random, saved in the published layout) for a prompt with one image, one with
two and a text-only one, batched and prefilled in chunks that cut through images; the same text with another
image gives that image's own tokens (its blocks are keyed by the picture). The preprocessing is checked bit for
bit against a step-by-step reference, and the tower with its projector against transformers' image features."""

import io
import random

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from torch import nn

from engine import LLM, SamplingParams
from engine.vision.image_files import image_config_for
from engine.vision.kimi_image_processing import process_kimi_image, resize_uint8
from engine.vision.moonvit_tower import MoonViT, MoonViTConfig, Projector
from engine.vision.qwen_image_processing import _pil_to_chw
from tests.engine.vision.kimi_k25_checkpoint import (IMAGE_CONFIG, IMAGE_TOKEN, VISION_END, VISION_START,
                                                     make_kimi_k25, random_image, reference_pixels)
from tests.engine.vision.image_engine_checks import (check_image_blocks_keyed_by_picture,
                                                       check_misfit_images_refused)
from tests.engine.vision.tower_pieces import run_in_random_pieces
from tests.greedy_ties import assert_greedy_equal_up_to_a_near_tie

MAX_NEW = 8
P = IMAGE_CONFIG.patch_size


def _text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VISION_START) for _ in range(n)]


def _with_images(rng: random.Random, grids: list) -> list[int]:
    """Text, then per image: <media_begin>, its placeholders expanded (grid_h * grid_w / 4), <media_end>, text."""
    ids = _text(rng, rng.randint(3, 9))
    for _, h, w in grids:
        ids += [VISION_START] + [IMAGE_TOKEN] * (h * w // 4) + [VISION_END] + _text(rng, rng.randint(2, 7))
    return ids


def _reference(model, pictures):
    """A last-logits function over the whole prompt (no cache) with the pictures' reference pixels."""
    kwargs = {}
    if pictures:
        refs = [reference_pixels(p, IMAGE_CONFIG) for p in pictures]
        kwargs = dict(pixel_values=torch.cat([px.view(-1, 3, P, P) for px, _ in refs]),
                      image_grid_thw=torch.tensor([g for _, g in refs]))

    def last_logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids]), use_cache=False, **kwargs).logits[0, -1]
    return last_logits


def _greedy(last_logits, prompt: list[int]) -> list[int] | None:
    """The reference's greedy tokens; None if it picks the image placeholder (transformers cannot read one back
    without an image for it: the caller draws another prompt)."""
    ids = list(prompt)
    for _ in range(MAX_NEW):
        ids.append(int(last_logits(ids).argmax()))
        if ids[-1] == IMAGE_TOKEN:
            return None
    return ids[len(prompt):]


def draw_case(ref, draw, seed: int) -> tuple[list[int], list[int]]:
    """A prompt from ``draw()`` and the reference's greedy tokens for it, drawn again (up to 10 times) while the
    reference samples an image placeholder."""
    for _ in range(10):
        prompt = draw()
        want = _greedy(ref, prompt)
        if want is not None:
            return prompt, want
    raise AssertionError(f"seed={seed}: the reference sampled an image placeholder for 10 prompts")


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def three_cases(model, rng: random.Random, pics: list, seed: int) -> tuple[list, list, list]:
    """(prompt, pictures) with the first picture, with the next two, with none; their reference logits functions
    and greedy tokens (the text around the images drawn again while the reference samples a placeholder)."""
    grids = [IMAGE_CONFIG.grid(p.size[1], p.size[0]) for p in pics]
    draws = [lambda: _with_images(rng, [(1, *grids[0])]), lambda: _with_images(rng, [(1, *g) for g in grids[1:3]]),
             lambda: _text(rng, rng.randint(5, 20))]
    cases, refs, expected = [], [], []
    for draw, images in zip(draws, (pics[:1], pics[1:3], [])):
        ref = _reference(model, images)
        prompt, want = draw_case(ref, draw, seed)
        cases.append((prompt, images))
        refs.append(ref)
        expected.append(want)
    return cases, refs, expected


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    seed = random.randrange(2**31)
    path = str(tmp_path_factory.mktemp("kimi_k25"))
    return path, make_kimi_k25(path, seed), seed


def test_pixels_equal_the_reference(checkpoint):
    """Images scaled down by the patch budget, by the per-side limit, or not at all; one with transparency: the
    patches and grid equal the reference's bit for bit, and the checkpoint's settings are read back. Pillow's
    antialiased bicubic (an independent implementation) stays within one level of the resize used, in a few
    pixels (its fixed-point weights have more bits)."""
    path, model, seed = checkpoint
    assert image_config_for(path, model.config.vision_config) == IMAGE_CONFIG
    gen = torch.Generator().manual_seed(seed)
    rgba = random_image(gen, 23, 17).convert("RGBA")
    rgba.putalpha(random_image(gen, 23, 17).convert("L"))
    sizes = ((37, 21), (90, 9), (13, 11), (16, 16), (44, 61), (203, 151))
    for picture in [random_image(gen, w, h) for w, h in sizes] + [rgba]:
        ours = process_kimi_image(picture, IMAGE_CONFIG)
        want, grid = reference_pixels(picture, IMAGE_CONFIG)
        assert ours.grid_thw == grid and torch.equal(ours.pixel_values, want), picture.size
        assert IMAGE_CONFIG.grid(picture.size[1], picture.size[0]) == grid[1:]
    for w, h in ((57, 43), (203, 151), (90, 9)):
        pil = random_image(gen, w, h)
        (new_h, new_w), _ = IMAGE_CONFIG.sizes(h, w)
        ours = resize_uint8(_pil_to_chw(pil).contiguous(), new_h, new_w).int()
        pillow = _pil_to_chw(pil.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)).int()
        off = (ours - pillow).abs()
        assert off.max() <= 1 and (off > 0).float().mean() < 0.02, (w, h, off.max(), (off > 0).sum())


def test_tower_and_projector_match_transformers(checkpoint):
    """MoonViT and the projector loaded from the saved checkpoint's own tensors (fused qkv in MoonViT's rotary
    order): features of two images of different grids equal transformers' image features, also with MoonViT's
    stages run over row ranges in random pieces (layer-chunked encoding's passes, ``engine.vision.tower_rows``)."""
    path, model, seed = checkpoint
    gen = torch.Generator().manual_seed(seed + 1)
    pictures = [random_image(gen, w, h) for w, h in ((37, 21), (20, 50))]
    processed = [process_kimi_image(p, IMAGE_CONFIG) for p in pictures]
    assert processed[0].grid_thw != processed[1].grid_thw
    c = MoonViTConfig.from_hf(model.config)
    ours = nn.Module()
    ours.vision_tower, ours.mm_projector = MoonViT(c), Projector(c)
    saved = load_file(f"{path}/model.safetensors")
    renamed = {k.replace("vision_tower.encoder.", "vision_tower.").removeprefix("model."): v
               for k, v in saved.items()}
    ours.load_state_dict({k: v for k, v in renamed.items() if k.startswith(("vision_tower.", "mm_projector."))})
    with torch.no_grad():
        ref = model.model.get_image_features(torch.cat([p.pixel_values.view(-1, 3, P, P) for p in processed]),
                                             torch.tensor([p.grid_thw for p in processed])).pooler_output
        for i, (image, want) in enumerate(zip(processed, ref)):
            got = ours.mm_projector(ours.vision_tower(image.pixel_values, image.grid_thw))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            # its stages split over row ranges, as layer-chunked encoding runs them: the same features
            split = run_in_random_pieces(ours.vision_tower, image.pixel_values, image.grid_thw, random.Random(seed),
                                         whole_block=i % 2)
            torch.testing.assert_close(ours.mm_projector(split), want, rtol=1e-5, atol=1e-5)


def test_greedy_matches_transformers(checkpoint):
    path, model, seed = checkpoint
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed + 2)
    # the first picture at least 28 pixels a side (4 tokens or more: a tiny model may answer a 1-token image
    # alike whatever it shows, which would blind the check with another picture below)
    pics = [random_image(gen, rng.randint(lo, 60), rng.randint(lo, 60)) for lo in (28, 12, 12)]
    cases, refs, expected = three_cases(model, rng, pics, seed)
    # another picture of the first one's size: same placeholders, its own tokens (redrawn while the tiny model
    # answers it as the first; every fourth try the first prompt's text is drawn again too, as a tiny model may
    # answer one text alike whatever picture comes with it)
    grid = (1, *IMAGE_CONFIG.grid(pics[0].size[1], pics[0].size[0]))
    for attempt in range(24):
        if attempt and attempt % 4 == 0:
            prompt, want = draw_case(refs[0], lambda: _with_images(rng, [grid]), seed)
            cases[0], expected[0] = (prompt, cases[0][1]), want
        other = random_image(gen, *pics[0].size)
        other_ref = _reference(model, [other])
        expected_other = _greedy(other_ref, cases[0][0])
        if expected_other is not None and expected_other != expected[0]:
            break
    assert expected_other not in (None, expected[0]), \
        f"seed={seed}: 24 images over 6 texts gave the same tokens (the test would be blind)"
    one = cases[0][0]

    # 16-token steps cut the image prompts into chunks, some through an image's placeholders
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=48, block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    # a PIL image, encoded bytes (decoded and preprocessed by the engine), none
    images = [[pics[0]], [_png(pics[1]), process_kimi_image(pics[2], IMAGE_CONFIG)], []]
    outs = llm.generate([p for p, _ in cases], params, images=images)
    for i, (out, want, ref, (prompt, _)) in enumerate(zip(outs, expected, refs, cases)):
        assert_greedy_equal_up_to_a_near_tie(ref, prompt, out.token_ids, want, f"seed={seed} case {i}")
    # the same text with another picture: its own tokens, no prefix hit past the text before the image; and the
    # first picture again (as PNG bytes): its blocks are hit, and the tokens are its own
    want = {"other": (other_ref, expected_other), "again": (refs[0], expected[0])}

    def check(tokens, case):
        assert_greedy_equal_up_to_a_near_tie(want[case][0], one, tokens, want[case][1], f"seed={seed} {case}")
    check_image_blocks_keyed_by_picture(llm, params, one, IMAGE_TOKEN, other, _png(pics[0]), check)


def test_images_that_do_not_fit_the_prompt_are_refused(checkpoint):
    path, _, seed = checkpoint
    gen = torch.Generator().manual_seed(seed)
    image = random_image(gen, 20, 20)
    n = IMAGE_CONFIG.grid(20, 20)[0] * IMAGE_CONFIG.grid(20, 20)[1] // 4
    check_misfit_images_refused(path, image, n, IMAGE_TOKEN, VISION_START, VISION_END)
