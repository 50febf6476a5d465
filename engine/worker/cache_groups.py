"""Which attention layers share a block table (the KV cache groups), and which cache tensors each layer uses.

One group: every layer has its own cache tensors and reads the one block table. Two groups (a model mixing
full-attention layers with as many sliding-window layers of the same cache spec, as gpt-oss does): the i-th full
layer and the i-th sliding layer share one set of cache tensors. A pool block is then a block of the tensors of
as many layers as one group has, and each block id is held by one request's table in one group at a time, so
the two groups never write the same slots. What a pool block holds is half as much as with one group, and a
sliding layer's blocks go back to the pool as its window passes them.
"""

import torch

from engine.models import MoECausalLM


def sliding_group_window(model: MoECausalLM) -> int | None:
    """The window of the sliding layers when they form a cache group of their own, else None (one group).

    They do when the model's layers differ in window (``ModelConfig.layer_sliding_window``), no window applies to
    every layer, the sliding layers are exactly half of the model's, and every layer caches the same per-token
    shape (so the two groups can share tensors slot for slot; ``MoECausalLM.layers_cache_alike`` says so for the
    layers a pipeline stage does not hold). Decided from the whole model's configuration, so
    every pipeline stage (holding some of the layers) agrees with the scheduler's rank on the groups."""
    config = model.config
    layers = model.attention_layers()
    window = config.layer_sliding_window
    if not window or config.sliding_window or 2 * len(config.sliding_layers) != config.num_layers:
        return None
    specs = {attn.cache_spec() for attn in layers}
    windows = [getattr(attn, "sliding_window", None) for attn in layers]
    if len(specs) > 1 or not model.layers_cache_alike() or any(w not in (None, window) for w in windows):
        return None
    if len(layers) == config.num_layers and sum(w == window for w in windows) != len(config.sliding_layers):
        return None  # the model's layers do not apply the windows its configuration names
    return window


def cache_slots(model: MoECausalLM, sliding_window: int | None) -> list[int]:
    """The cache tensors each attention layer uses, by index: its own with one group, else its position among
    the layers of its group (full layers and sliding layers counted apart)."""
    layers = model.attention_layers()
    if sliding_window is None:
        return list(range(len(layers)))
    seen = {False: 0, True: 0}
    slots = []
    for attn in layers:
        sliding = getattr(attn, "sliding_window", None) is not None
        slots.append(seen[sliding])
        seen[sliding] += 1
    return slots


def kv_bytes_per_block(model: MoECausalLM, block_size: int, dtype: torch.dtype,
                       sliding_window: int | None = None) -> int:
    """Bytes one pool block of ``block_size`` tokens takes: over every attention layer with one group, over one
    group's layers with two (``sliding_window`` from ``sliding_group_window``)."""
    layers = model.attention_layers()
    owners = {slot: attn for attn, slot in zip(layers, cache_slots(model, sliding_window))}
    return block_size * sum(attn.cache_spec().bytes_per_token(dtype) for attn in owners.values())
