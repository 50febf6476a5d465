"""The model runner: one forward over all scheduled tokens of a step, then sampling."""

import torch

from engine.attention_metadata import AttentionMetadata, DecodeGroup
from engine.config import CacheConfig
from engine.models import MoECausalLM
from engine.sampler import Sampler
from engine.scheduler import ScheduledRequest, SchedulerOutput


# Decodes attended together in one padded SDPA call; bigger groups pad more, smaller ones call more.
DECODE_GROUP_SIZE = 16
# Decodes sharing a cached prompt prefix, attended together: the shared blocks are read once per group.
SHARED_GROUP_SIZE = 64


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

    def _decode_groups(self, decodes: list[ScheduledRequest]) -> list[tuple[list[ScheduledRequest], int]]:
        """Split decodes (sorted by context length) into attention groups, with their shared leading blocks.

        Requests whose tables start with the same block share a prompt prefix (prefix cache): they
        form groups of up to SHARED_GROUP_SIZE whose common blocks are read once. The rest go in
        groups of DECODE_GROUP_SIZE of similar length, to pad little.
        """
        by_first: dict[int, list[ScheduledRequest]] = {}
        for item in decodes:
            by_first.setdefault(item.block_ids[0], []).append(item)
        groups, alone = [], []
        for members in by_first.values():
            if len(members) < 2 or self.sliding_window:
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

    def prepare(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat input_ids [T], positions [T], metadata, and the flat index of each sampling row."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_groups = self._decode_groups([s for s in scheduled if s.num_new_tokens == 1])
        decodes = [item for group, _ in decode_groups for item in group]  # flat order follows the groups
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
        g0 = 0
        for group, num_shared in decode_groups:
            width = max(len(s.block_ids) for s in group) - num_shared
            table = torch.tensor([s.block_ids[num_shared:] + [0] * (width - len(s.block_ids) + num_shared) for s in group], device=dev)
            seq_lens = torch.tensor([s.request.num_computed_tokens + 1 for s in group], device=dev)[:, None]  # [G, 1]
            key_pos = num_shared * bs + torch.arange(width * bs, device=dev)[None, :]  # [1, L]
            mask = self._visible(seq_lens - 1, key_pos, seq_lens)[:, None, None, :]  # [G, 1, 1, L]
            shared = torch.tensor(group[0].block_ids[:num_shared], device=dev) if num_shared else None
            groups.append(DecodeGroup(g0, g0 + len(group), table, mask, shared))
            g0 += len(group)
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

    def expert_load(self) -> list[list[int]]:
        """Tokens routed to each expert since start, per MoE layer (reads the device: not every step on GPU)."""
        from engine.layers.moe import SparseMoeBlock

        return [m.expert_tokens.tolist() for m in self.model.modules() if isinstance(m, SparseMoeBlock)]

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
