"""Turn a step's scheduled requests into the flat batch one forward takes, for either attention backend.

Legend: T scheduled tokens, D decode requests, P prefill chunks, N requests that sample,
G requests in a decode group, L padded context, W block-table width.

Both builders order requests decodes first, then prefills, and stage every
host-built int array to the device in one non-blocking copy (``staging``).
"""

from dataclasses import dataclass, replace

import torch

from engine.device_batch.attention_metadata import AttentionMetadata, DecodeGroup, TritonAttentionMetadata
from engine.device_batch.flat_batch import FlatBatch
from engine.kernels.attention import DEFAULT_LAUNCH, decode_splits, prefill_tiles
from engine.core.scheduler import ScheduledRequest
from engine.device_batch.staging import stage_int64

# Decodes attended together in one padded SDPA call; bigger groups pad more, smaller ones call more.
DECODE_GROUP_SIZE = 16
# Decodes sharing a cached prompt prefix, attended together: the shared blocks are read once per group.
SHARED_GROUP_SIZE = 64


@dataclass(slots=True)
class _Flat:
    """Host-side token arrays in flat order, and each request's row range."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    ranges: list[tuple[int, int]]
    # The sliding-window layers' slots (their own cache group's tables); None with one cache group.
    window_slots: list[int] | None = None


def _has_window_tables(order: list[ScheduledRequest]) -> bool:
    """Whether the sliding-window layers have their own block tables (every request has them, or none)."""
    return bool(order) and bool(order[0].window_block_ids)


def _flatten(order: list[ScheduledRequest], block_size: int) -> _Flat:
    flat = _Flat([], [], [], [], [] if _has_window_tables(order) else None)
    for item in order:
        start = item.start
        end = start + item.num_new_tokens
        flat.ranges.append((len(flat.input_ids), len(flat.input_ids) + item.num_new_tokens))
        flat.input_ids.extend(item.token_ids)
        flat.positions.extend(range(start, end))
        table = item.block_ids
        flat.slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        if flat.window_slots is not None:
            table = item.window_block_ids
            flat.window_slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
    return flat


def _sample_rows(scheduled: list[ScheduledRequest], order: list[ScheduledRequest], flat: _Flat) -> list[int]:
    # Row of the last token of each request in scheduled order (sampling rows map back to it); a request with
    # K drafts samples at its last K + 1 rows.
    last_index = {id(item): flat.ranges[i][1] - 1 for i, item in enumerate(order)}
    return [row for item in scheduled if item.sample
            for row in range(last_index[id(item)] - len(item.draft_token_ids), last_index[id(item)] + 1)]


def _scheduled_ranges(scheduled: list[ScheduledRequest], order: list[ScheduledRequest],
                      flat: _Flat) -> tuple[tuple[int, int], ...]:
    by_item = {id(item): rows for item, rows in zip(order, flat.ranges)}
    return tuple(by_item[id(item)] for item in scheduled)


def _prompt_rows(scheduled: list[ScheduledRequest], order: list[ScheduledRequest], flat: _Flat) -> list[int]:
    # Flat rows whose logits score a prompt token (prompt logprobs), in scheduled order.
    first_index = {id(item): flat.ranges[i][0] for i, item in enumerate(order)}
    return [first_index[id(item)] + j for item in scheduled for j in range(item.prompt_logprob_rows)]


def _padded(tables: list[list[int]]) -> list[list[int]]:
    width = max((len(t) for t in tables), default=0)
    return [t + [0] * (width - len(t)) for t in tables]


def build_triton_batch(scheduled: list[ScheduledRequest], block_size: int, sliding_window: int | None,
                       num_kv_heads: int, device: torch.device) -> FlatBatch:
    """The flat batch for the Triton kernels: block tables and lengths only, all in one staged copy. Requests with
    their own tables for the sliding-window layers give those layers ``meta.windowed`` (the same batch over
    those tables)."""
    decodes = [s for s in scheduled if s.num_new_tokens == 1]
    prefills = [s for s in scheduled if s.num_new_tokens > 1]
    order = decodes + prefills
    flat = _flatten(order, block_size)
    num_decodes = len(decodes)
    query_lens = [s.num_new_tokens for s in prefills]
    tile_req, tile_start = prefill_tiles(query_lens, DEFAULT_LAUNCH.prefill_block_m)
    dec_tables = _padded([s.block_ids for s in decodes])
    arrays = [
        flat.input_ids, flat.positions, flat.slots,
        dec_tables, [s.start + 1 for s in decodes],
        _padded([s.block_ids for s in prefills]),
        [s.start + s.num_new_tokens for s in prefills],
        [start for start, _ in flat.ranges[num_decodes:]], query_lens,
        tile_req, tile_start, _sample_rows(scheduled, order, flat), _prompt_rows(scheduled, order, flat),
    ]
    if flat.window_slots is not None:
        arrays += [flat.window_slots, _padded([s.window_block_ids for s in decodes]),
                   _padded([s.window_block_ids for s in prefills])]
    staged = stage_int64(arrays, device)
    (input_ids, positions, slots, dec_table, dec_lens, pre_table, pre_lens, pre_start, pre_len, t_req, t_start,
     sample_rows, prompt_rows) = staged[:13]

    def tables(dec: torch.Tensor, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (dec.view(num_decodes, -1) if num_decodes else dec.view(0, 1),
                pre.view(len(prefills), -1) if prefills else pre.view(0, 1))

    dec_table, pre_table = tables(dec_table, pre_table)
    meta = TritonAttentionMetadata(
        slot_mapping=slots,
        num_decodes=num_decodes,
        decode_block_table=dec_table,
        decode_seq_lens=dec_lens,
        decode_splits=decode_splits(num_decodes, num_kv_heads, device),
        num_prefills=len(prefills),
        prefill_block_table=pre_table,
        prefill_seq_lens=pre_lens,
        prefill_query_start=pre_start,
        prefill_query_len=pre_len,
        prefill_tile_req=t_req,
        prefill_tile_start=t_start,
        sliding_window=sliding_window or 0,
        prefill_extents=tuple((start, s.num_new_tokens, s.start + s.num_new_tokens)
                              for (start, _), s in zip(flat.ranges[num_decodes:], prefills)),
    )
    if flat.window_slots is not None:
        window_slots, window_dec, window_pre = staged[13:]
        window_dec, window_pre = tables(window_dec, window_pre)
        meta.windowed = replace(meta, slot_mapping=window_slots, decode_block_table=window_dec,
                                prefill_block_table=window_pre)
    max_blocks = len(dec_tables[0]) if dec_tables else 0
    return FlatBatch(input_ids, positions, meta, sample_rows, prompt_rows, num_decodes, max_blocks,
                     _scheduled_ranges(scheduled, order, flat))


# ---- the torch path --------------------------------------------------------------


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, seq_len: torch.Tensor | int,
             sliding_window: int | None) -> torch.Tensor:
    visible = (key_pos <= query_pos) & (key_pos < seq_len)
    if sliding_window:
        visible &= key_pos > query_pos - sliding_window
    return visible


def decode_groups(decodes: list[ScheduledRequest], sliding_window: int | None) -> list[tuple[list[ScheduledRequest], int]]:
    """Split decodes into attention groups, with their shared leading blocks.

    Requests whose tables start with the same block share a prompt prefix (prefix cache): they
    form groups of up to SHARED_GROUP_SIZE whose common blocks are read once. The rest go in
    groups of DECODE_GROUP_SIZE of similar length, to pad little.
    """
    by_first: dict[int, list[ScheduledRequest]] = {}
    for item in decodes:
        by_first.setdefault(item.block_ids[0], []).append(item)
    groups, alone = [], []
    for members in by_first.values():
        if len(members) < 2 or sliding_window:
            alone.extend(members)
            continue
        for g0 in range(0, len(members), SHARED_GROUP_SIZE):
            group = members[g0:g0 + SHARED_GROUP_SIZE]
            # Common leading blocks, keeping each request's last block (its newest token) its own.
            limit = min(len(s.block_ids) for s in group) - 1
            num_shared = 0
            while num_shared < limit and all(s.block_ids[num_shared] == group[0].block_ids[num_shared] for s in group):
                num_shared += 1
            groups.append((group, num_shared))
    alone.sort(key=lambda s: len(s.block_ids))
    groups += [(alone[i:i + DECODE_GROUP_SIZE], 0) for i in range(0, len(alone), DECODE_GROUP_SIZE)]
    return groups


def build_torch_batch(scheduled: list[ScheduledRequest], block_size: int, sliding_window: int | None,
                      device: torch.device, layer_window: int | None = None) -> FlatBatch:
    """The flat batch for the torch path: decodes in length-sorted (or prefix-sharing) groups with masks.

    ``layer_window``: the window of some layers only (``ModelConfig.layer_sliding_window``); their masks go in
    ``meta.windowed`` (the groups, and so the flat order, are the same for every layer), over the requests'
    ``window_block_ids`` where they have their own tables.
    """
    bs = block_size
    groups_host = decode_groups([s for s in scheduled if s.num_new_tokens == 1], sliding_window or layer_window)
    decodes = [item for group, _ in groups_host for item in group]  # flat order follows the groups
    prefills = [s for s in scheduled if s.num_new_tokens > 1]
    order = decodes + prefills
    flat = _flatten(order, bs)
    num_decodes = len(decodes)
    own_tables = flat.window_slots is not None
    assert not own_tables or layer_window, "window tables without windowed layers"

    def padded_tables(group: list[ScheduledRequest], num_shared: int, width: int, window: bool) -> list[list[int]]:
        rows = [s.window_block_ids if window else s.block_ids for s in group]
        return [t[num_shared:] + [0] * (width - len(t) + num_shared) for t in rows]

    # Host arrays of every group and prefill, staged in one copy; masks are then built on the device.
    arrays: list = [flat.input_ids, flat.positions, flat.slots, _sample_rows(scheduled, order, flat),
                    _prompt_rows(scheduled, order, flat)]
    if own_tables:
        arrays.append(flat.window_slots)
    widths = []
    for group, num_shared in groups_host:
        width = max(len(s.block_ids) for s in group) - num_shared
        widths.append(width)
        arrays.append(padded_tables(group, num_shared, width, False))
        arrays.append([s.start + 1 for s in group])
        arrays.append(group[0].block_ids[:num_shared])
        if own_tables:  # never shared: groups with a window share no blocks
            arrays.append(padded_tables(group, 0, width, True))
    for item in prefills:
        arrays.append(item.block_ids)
        if own_tables:
            arrays.append(item.window_block_ids)
    staged = iter(stage_int64(arrays, device))
    input_ids, positions, slots, sample_rows, prompt_rows = (next(staged) for _ in range(5))
    window_slots = next(staged) if own_tables else slots

    groups, windowed_groups = [], []
    g0 = 0
    for (group, num_shared), width in zip(groups_host, widths):
        table, seq_lens, shared = next(staged), next(staged)[:, None], next(staged)  # [G, W], [G, 1], [S]
        window_table = next(staged) if own_tables else table  # [G, W]
        key_pos = num_shared * bs + torch.arange(width * bs, device=device)[None, :]  # [1, L]
        lens = [s.start + 1 for s in group]
        for window, into, t in ((sliding_window, groups, table), (layer_window, windowed_groups, window_table)):
            mask = _visible(seq_lens - 1, key_pos, seq_lens, window)[:, None, None, :]  # [G, 1, 1, L]
            # Columns every member sees: before the shortest one's end, inside the longest one's window.
            seen_by_all = (max(0, max(lens) - window - num_shared * bs) if window else 0,
                           max(0, min(lens) - num_shared * bs))
            into.append(DecodeGroup(g0, g0 + len(group), t.view(len(group), width), mask,
                                    shared if num_shared else None, seen_by_all))
        g0 += len(group)
    pre_tables, window_pre_tables, pre_lens, pre_masks, windowed_masks = [], [], [], [], []
    for item in prefills:
        start = item.start
        seq_len = start + item.num_new_tokens
        pre_tables.append(next(staged))
        window_pre_tables.append(next(staged) if own_tables else pre_tables[-1])
        pre_lens.append(seq_len)
        query_pos = torch.arange(start, seq_len, device=device)[:, None]  # [q, 1]
        key_pos = torch.arange(seq_len, device=device)[None, :]  # [1, L]
        for window, into in ((sliding_window, pre_masks), (layer_window, windowed_masks)):
            fresh_causal = start == 0 and not window
            into.append(None if fresh_causal else _visible(query_pos, key_pos, seq_len, window)[None, None])  # [1, 1, q, L]

    def metadata(slot_mapping: torch.Tensor, decode: list[DecodeGroup], tables: list[torch.Tensor], masks: list,
                 windowed: AttentionMetadata | None) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slot_mapping, num_decodes=num_decodes, decode_groups=decode,
            prefill_query_ranges=flat.ranges[num_decodes:], prefill_block_tables=tables,
            prefill_seq_lens=pre_lens, prefill_masks=masks, windowed=windowed,
        )

    windowed = metadata(window_slots, windowed_groups, window_pre_tables, windowed_masks, None) if layer_window else None
    meta = metadata(slots, groups, pre_tables, pre_masks, windowed)
    return FlatBatch(input_ids, positions, meta, sample_rows, prompt_rows, num_decodes, max(widths, default=0),
                     _scheduled_ranges(scheduled, order, flat))


def build_batch(scheduled: list[ScheduledRequest], attention_backend: str, block_size: int,
                sliding_window: int | None, num_kv_heads: int, device: torch.device,
                layer_window: int | None = None) -> FlatBatch:
    """The flat batch of ``scheduled`` with the metadata ``attention_backend`` ("torch" or "triton") reads.

    ``sliding_window``: every layer's window; ``layer_window``: some layers' own (the Triton kernels take
    those layers' window as an argument, so only the torch path's masks need it).
    """
    if attention_backend == "triton":
        return build_triton_batch(scheduled, block_size, sliding_window, num_kv_heads, device)
    return build_torch_batch(scheduled, block_size, sliding_window, device, layer_window)
