"""Checks both image models' engine tests make: the prefix cache keys image blocks by the picture (the same prompt
text with another picture, then with the first one again), and images that do not fit the prompt are refused."""

from collections.abc import Callable

import pytest

from engine import LLM, SamplingParams


def check_image_blocks_keyed_by_picture(llm: LLM, params: SamplingParams, prompt: list[int], image_token: int,
                                        other, again, check: Callable[[list[int], str], None]) -> None:
    """``prompt`` (one image's placeholders) with ``other`` (another picture): ``check(tokens, "other")`` and no
    prefix hit past the blocks before the image; then with ``again`` (the first picture): ``check(tokens,
    "again")`` and every full block but the last hit. ``check`` compares the tokens with the reference's."""
    kv = llm.engine.scheduler.kv
    bs = llm.engine.config.block_size
    hits_before = kv.prefix_hit_tokens
    check(llm.generate([prompt], params, images=[[other]])[0].token_ids, "other")
    assert kv.prefix_hit_tokens - hits_before <= prompt.index(image_token) // bs * bs
    hits_before = kv.prefix_hit_tokens
    check(llm.generate([prompt], params, images=[[again]])[0].token_ids, "again")
    assert kv.prefix_hit_tokens - hits_before >= (len(prompt) - 1) // bs * bs - bs


def check_misfit_images_refused(path: str, image, num_tokens: int, image_token: int, start: int, end: int) -> None:
    """An image of ``num_tokens`` placeholders, sent to the checkpoint at ``path`` with prompts (placeholders
    between ``start`` and ``end`` tokens) that do not fit it, and as bytes that are not an image: each refused."""
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=8, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    n = num_tokens
    prompt = [5, start] + [image_token] * n + [end, 7]
    with pytest.raises(ValueError, match="1 runs of image placeholder tokens .* for 2 images"):
        llm.generate([prompt], params, images=[[image, image]])
    with pytest.raises(ValueError, match=f"image 0 takes {n} placeholder tokens, the prompt has {n + 1}"):
        llm.generate([[5] + [image_token] * (n + 1)], params, images=[[image]])
    with pytest.raises(ValueError, match="image 0: not an image"):
        llm.generate([prompt], params, images=[[b"not a picture"]])


def on_tower_runs(model, record: Callable[[tuple[int, int, int]], None]) -> None:
    """Call ``record(grid_thw)`` each time ``model`` starts running its vision tower over an image: whole
    (the tower's forward) or layer-chunked (``begin_encoding``, whose later passes are the same run)."""
    tower = model.tower_block
    whole = next(m for m in model.modules() if getattr(m, "blocks", None) is not None and m.blocks[0] is tower)
    whole.register_forward_hook(lambda mod, args, out: record(tuple(args[1])))
    begin = model.begin_encoding

    def begun(pixels):
        record(tuple(pixels.grid_thw))
        return begin(pixels)

    model.begin_encoding = begun
