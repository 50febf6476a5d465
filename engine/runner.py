"""The model runner: one forward over all scheduled tokens of a step, then sampling."""

import torch

from engine.attention_metadata import AttentionMetadata, DecodeGroup
from engine.config import CacheConfig
from engine.models import MoECausalLM
from engine.sampler import Sampler
from engine.scheduler import ScheduledRequest, SchedulerOutput


# Decodes attended together in one padded SDPA call; bigger groups pad more, smaller ones call more.
DECODE_GROUP_SIZE = 16


def kv_bytes_per_block(model: MoECausalLM, block_size: int, dtype: torch.dtype) -> int:
    c = model.config
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * torch.empty(0, dtype=dtype).element_size()


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler.

    Legend: T scheduled tokens, D decode requests, N requests that sample.
    """

    def __init__(self, model: MoECausalLM, cache_config: CacheConfig, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.model = model
        self.device = device
        self.block_size = cache_config.block_size
        c = model.config
        shape = (cache_config.num_blocks, cache_config.block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(c.num_layers)
        ]
        for attn, cache in zip(model.attention_layers(), self.kv_caches):
            attn.kv_cache = cache
        self.sliding_window = c.sliding_window
        self.sampler = Sampler(device, seed)

    # ---- batch construction -----------------------------------------------
    def _visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor, seq_len: torch.Tensor | int) -> torch.Tensor:
        visible = (key_pos <= query_pos) & (key_pos < seq_len)
        if self.sliding_window:
            visible &= key_pos > query_pos - self.sliding_window
        return visible

    def prepare(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input_ids [T], positions [T], metadata, and the flat index of each sampling row."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        # Decodes sorted by context length so that each attention group pads little.
        decodes = sorted((s for s in scheduled if s.num_new_tokens == 1), key=lambda s: len(s.block_ids))
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        ranges: list[tuple[int, int]] = []
        for item in decodes + prefills:
            start = item.request.num_computed_tokens
            end = start + item.num_new_tokens
            ranges.append((len(input_ids), len(input_ids) + item.num_new_tokens))
            input_ids.extend(item.request.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = item.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))

        dev = self.device
        num_decodes = len(decodes)
        groups = []
        for g0 in range(0, num_decodes, DECODE_GROUP_SIZE):
            group = decodes[g0:g0 + DECODE_GROUP_SIZE]
            width = len(group[-1].block_ids)
            table = torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in group], device=dev)
            seq_lens = torch.tensor([s.request.num_computed_tokens + 1 for s in group], device=dev)[:, None]  # [G, 1]
            key_pos = torch.arange(width * bs, device=dev)[None, :]  # [1, L]
            mask = self._visible(seq_lens - 1, key_pos, seq_lens)[:, None, None, :]  # [G, 1, 1, L]
            groups.append(DecodeGroup(g0, g0 + len(group), table, mask))
        pre_tables, pre_lens, pre_masks = [], [], []
        for item in prefills:
            start = item.request.num_computed_tokens
            seq_len = start + item.num_new_tokens
            pre_tables.append(torch.tensor(item.block_ids, device=dev))
            pre_lens.append(seq_len)
            if start == 0 and not self.sliding_window:
                pre_masks.append(None)
                continue
            query_pos = torch.arange(start, seq_len, device=dev)[:, None]  # [q, 1]
            key_pos = torch.arange(seq_len, device=dev)[None, :]  # [1, L]
            pre_masks.append(self._visible(query_pos, key_pos, seq_len)[None, None])  # [1, 1, q, L]

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decodes=num_decodes,
            decode_groups=groups,
            prefill_query_ranges=ranges[num_decodes:],
            prefill_block_tables=pre_tables,
            prefill_seq_lens=pre_lens,
            prefill_masks=pre_masks,
        )
        # Row of the last token of each request in scheduled order (sampling rows map back to it).
        order = decodes + prefills
        last_index = {id(item): ranges[i][1] - 1 for i, item in enumerate(order)}
        sample_rows = [last_index[id(item)] for item in scheduled if item.sample]
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
            sample_rows,
        )

    # ---- one step ------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> list[int | None]:
        """Run the step's forward; returns the sampled token per scheduled request (None if it did not sample)."""
        self.sampler.forget(sched_out.finished_ids)
        if sched_out.is_empty:
            return []
        input_ids, positions, meta, sample_rows = self.prepare(sched_out.scheduled)
        hidden = self.model(input_ids, positions, meta)  # [T, H]
        sampling = [s.request for s in sched_out.scheduled if s.sample]
        tokens: list[int] = []
        if sampling:
            logits = self.model.compute_logits(hidden[sample_rows])  # [N, V]
            tokens = self.sampler(logits, sampling)
        it = iter(tokens)
        return [next(it) if s.sample else None for s in sched_out.scheduled]
