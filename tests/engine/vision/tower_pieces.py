"""Running a vision tower the way layer-chunked encoding does: its passes (``engine.vision.tower_rows``) in pieces
cut at random points, a few forced where they split a stage (mid-embedding, mid-projection, mid-mixing, across
the projection-to-mixing turn, off the merge windows), one block whole."""

import random

import torch


def run_in_random_pieces(tower, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int], rng: random.Random,
                         whole_block: int):
    """``tower.finish`` of the image after its passes ran in random pieces (every pass once, in order), block
    ``whole_block`` in one piece, every other stage split."""
    length = pixel_values.shape[0]
    stages, per = len(tower.blocks) + 1, 2 * length
    assert stages >= 3 and length >= 4
    whole = (whole_block + 1) * per  # that block's first pass
    cuts = {0, stages * per, whole, whole + per}
    for s in range(stages):
        if s != whole_block + 1:
            base = s * per
            cuts |= {base + 1, base + length // 2, base + length, base + length + 1, base + length + 3, base + per - 1}
            cuts |= {base + rng.randrange(1, per) for _ in range(3)}
    cuts = sorted(c for c in cuts if not whole < c < whole + per)
    with torch.no_grad():
        state = tower.start(pixel_values, grid_thw)
        for a, b in zip(cuts, cuts[1:]):
            tower.run_passes(state, a, b)
        assert state.qkv is None and state.pixels is None
        return tower.finish(state)

def check_recorded_pieces(steps: list[list[tuple]], budget: int, stages: int) -> int:
    """``steps``: each step's pieces as (request id, image, first, end, total) in the order run. Each step's passes
    stay within ``budget`` token-blocks (two passes each); each image's pieces cover its passes once, in order;
    some piece ends inside a stage (a block split over rows). Returns how many images were encoded."""
    done: dict[tuple[str, int], tuple[int, int]] = {}
    split = False
    for step in steps:
        assert sum(end - first for _, _, first, end, _ in step) <= 2 * budget, step
        for rid, image, first, end, total in step:
            assert first == done.get((rid, image), (0, total))[0] < end <= total, (rid, image, first, end)
            done[(rid, image)] = (end, total)
            split |= end % (total // stages) != 0
    assert all(end == total for end, total in done.values()), done
    assert split, "no block was split over rows"
    return len(done)
