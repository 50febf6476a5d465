"""Speculative decoding's draft-model proposer: a small model sharing the target's tokenizer proposes each
speculating request's K drafts greedily, on the device, right before the step's target forward.

Legend: T draft tokens of a forward, S speculating requests, V vocabulary.

KV layout: the draft model has KV cache tensors of its own with the target's number of blocks and block size,
and uses the target's block tables: a token's draft K/V sits at the same block and slot as its target K/V. So
there is no second block manager: the scheduler's allocation, rollback (``KVCacheManager.trim``), preemption
and prefix sharing hold for the draft cache too.

What the draft cache holds is tracked here, per request: ``computed`` positions from 0 hold draft K/V of the
request's verified tokens. Only speculating requests involve the draft model: each step, a speculating request
first catches up (the draft runs over its tokens from ``computed`` to its last token, which also covers a
prompt, tokens of steps it did not speculate in, and the last accepted draft), then K - 1 single-token forwards
over its drafts give the rest. Its drafts' K/V are written at the drafts' positions; after the step the
request's verified length drops to what the target kept, and ``computed`` is cut back to it the next time
(a rejected draft's slot is written again with the verified token). A prefix-cache hit or a preemption starts
the request from 0: blocks shared with another request may hold draft K/V of positions the draft never ran
over (their target K/V came from a request that did not speculate), so the draft computes them itself; it
writes the same values any other request's draft would.

Drafts are greedy (a point mass), which the step's verification turns into exact rejection sampling
(``engine.core.speculation.accepted_prefix``).
"""

from dataclasses import replace

import torch

from engine.core.config import CacheConfig
from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.core.speculation import DRAFT_PENDING
from engine.models import MoECausalLM
from engine.worker.batch_builder import build_batch
from engine.worker.cache_binding import attach_kv_caches


class DraftProposer:
    """Owns the draft model and its KV caches; ``propose`` fills in the step's pending drafts."""

    def __init__(self, model: MoECausalLM, cache_config: CacheConfig, device: torch.device, dtype: torch.dtype,
                 attention_backend: str = "torch") -> None:
        self.model = model
        self.device = device
        self.attention_backend = attention_backend
        self.block_size = cache_config.block_size
        # The target's block count; every draft layer reads the target's full-attention tables (``block_ids``),
        # so its caches are one group whatever the target's layout.
        self.kv_caches = attach_kv_caches(model, replace(cache_config, sliding_window=None), device, dtype)
        # request id -> (its preemption count when last seen, positions holding the draft K/V of its tokens)
        self.computed: dict[str, tuple[int, int]] = {}
        self.num_forwards = 0  # draft forwards run (each over every speculating request of its step)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.computed.pop(rid, None)

    @torch.inference_mode()
    def propose(self, plan: SchedulerOutput) -> None:
        """Replace the ``DRAFT_PENDING`` drafts of the step's parts by the draft model's greedy tokens, in place."""
        self.forget(plan.finished_ids)
        parts = [s for s in plan.scheduled if s.draft_token_ids and s.draft_token_ids[0] == DRAFT_PENDING]
        if not parts:
            return
        # First forward: each request from its first position without draft K/V through its last token, the
        # row of the last token proposing draft 1.
        first = []
        for s in parts:
            start = self._valid_prefix(s.request, s.start)
            last = s.start + 1  # a speculating part is one known token, then its drafts
            first.append(ScheduledRequest(None, last - start, s.block_ids, True, start,
                                          s.request.all_token_ids[start:last]))
        tokens = self._greedy(first)  # [S]
        drafts = [[t] for t in tokens]
        # Then one token at a time: draft j at its own position proposes draft j + 1.
        for j in range(1, max(len(s.draft_token_ids) for s in parts)):
            live = [i for i, s in enumerate(parts) if len(s.draft_token_ids) > j]
            step = [ScheduledRequest(None, 1, parts[i].block_ids, True, parts[i].start + j, [drafts[i][-1]])
                    for i in live]
            for i, token in zip(live, self._greedy(step)):
                drafts[i].append(token)
        for s, d in zip(parts, drafts):
            k = len(s.draft_token_ids)
            s.draft_token_ids[:] = d
            s.token_ids[-k:] = d
            # K/V written through draft k - 1 (draft k was never an input); the next step cuts back to what
            # the target kept.
            self.computed[s.request.request_id] = (s.request.num_preemptions, s.start + k)

    def _valid_prefix(self, request: Request, start: int) -> int:
        """Positions from 0 that hold draft K/V of the request's current tokens (at most ``start``)."""
        preemptions, computed = self.computed.get(request.request_id, (request.num_preemptions, 0))
        if preemptions != request.num_preemptions:  # its blocks were freed: it starts over, maybe on shared ones
            return 0
        return min(computed, start)

    def _greedy(self, parts: list[ScheduledRequest]) -> list[int]:
        """The draft model's argmax token after the last row of each part (each part samples once)."""
        config = self.model.config
        batch = build_batch(parts, self.attention_backend, self.block_size, config.sliding_window,
                            self.model.num_local_kv_heads, self.device, config.layer_sliding_window)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta)  # [T, H]
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))  # [S, V]
        self.num_forwards += 1
        return logits.argmax(dim=-1).tolist()
