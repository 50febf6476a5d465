"""Blocks as bytes (engine.kv_transfer.block_io): gathered from one set of caches and scattered into another
laid out alike, the chosen blocks' rows arrive bit for bit and no other row changes, whatever the layers cache
(K/V pairs, MLA latent rows, mixed dtypes)."""

import random

import pytest
import torch

from engine.kv_transfer.block_io import BlockLayout


def _caches(num_blocks: int, block_size: int, layers, generator) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(torch.randn(num_blocks + 1, block_size, *shape, generator=generator).to(dtype)
                  for shape in shapes) for shapes, dtype in layers]


@pytest.mark.parametrize("one_odd_block", [False, True])
def test_gathered_blocks_scatter_bit_for_bit_and_touch_nothing_else(one_odd_block):
    """``one_odd_block``: a single block of 1 token with an odd-length bf16 latent row, so a block's bytes are not a
    multiple of 4 (a one-row slice of them keeps that stride, which a float32 view refuses)."""
    rng = random.Random()
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    block_size, num_blocks = 2 ** rng.randint(0, 4), rng.randint(8, 40)
    latent = rng.randint(3, 40)
    if one_odd_block:
        block_size, latent = 1, rng.randrange(3, 40, 2)
    layers = [(((2, 8), (2, 8)), torch.float32),  # K, V of 2 KV heads
              (((latent,),), torch.bfloat16),  # one MLA latent row
              (((1, 16), (1, 16)), torch.float16)]
    source, target = _caches(num_blocks, block_size, layers, g), _caches(num_blocks, block_size, layers, g)
    before = [[t.clone() for t in layer] for layer in target]
    src_ids = rng.sample(range(num_blocks), 1 if one_odd_block else rng.randint(1, num_blocks // 2))
    dst_ids = rng.sample(range(num_blocks), len(src_ids))
    data = BlockLayout(source).gather(src_ids)
    layout = BlockLayout(target)
    # Independent reference for the size: every tensor's bytes per block, summed.
    assert data.shape == (len(src_ids), sum(t[0].numel() * t.element_size() for layer in source for t in layer))
    layout.scatter(dst_ids, data)
    for src_layer, dst_layer, old_layer in zip(source, target, before):
        for src, dst, old in zip(src_layer, dst_layer, old_layer):
            for s, d in zip(src_ids, dst_ids):
                assert torch.equal(dst[d].view(torch.uint8), src[s].view(torch.uint8))
            untouched = [b for b in range(num_blocks + 1) if b not in dst_ids]
            assert torch.equal(dst[untouched].view(torch.uint8), old[untouched].view(torch.uint8))


def test_tensors_shared_by_two_cache_groups_move_once():
    """gpt-oss's layout: the i-th full and the i-th sliding layer share one set of tensors, so a block's bytes
    hold each shared tensor once and a scatter writes each once (bit for bit, other blocks untouched)."""
    rng = random.Random()
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    block_size, num_blocks = 2 ** rng.randint(0, 3), rng.randint(8, 24)
    layers = [(((2, 8), (2, 8)), torch.float32), (((2, 8), (2, 8)), torch.float32)]
    source, target = _caches(num_blocks, block_size, layers, g), _caches(num_blocks, block_size, layers, g)
    shared_source, shared_target = source + source, target + target  # full layers, then their sliding partners
    before = [[t.clone() for t in layer] for layer in target]
    src_ids = rng.sample(range(num_blocks), rng.randint(1, num_blocks // 2))
    dst_ids = rng.sample(range(num_blocks), len(src_ids))
    data = BlockLayout(shared_source).gather(src_ids)
    assert data.shape == (len(src_ids), sum(t[0].numel() * t.element_size() for layer in source for t in layer))
    BlockLayout(shared_target).scatter(dst_ids, data)
    untouched = [b for b in range(num_blocks + 1) if b not in dst_ids]
    for src_layer, dst_layer, old_layer in zip(source, target, before):
        for src, dst, old in zip(src_layer, dst_layer, old_layer):
            assert torch.equal(dst[dst_ids].view(torch.uint8), src[src_ids].view(torch.uint8))
            assert torch.equal(dst[untouched].view(torch.uint8), old[untouched].view(torch.uint8))
