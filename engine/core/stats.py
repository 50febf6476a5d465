"""Per-step engine statistics (what the gateway exports as metrics). Cheap to build: counters only."""

import msgspec

EXPERT_LOAD_EVERY_CUDA = 32


class TierStats(msgspec.Struct, array_like=True):
    """One prefix-cache tier's cumulative counters for one tenant (``engine.kv_tiers.counters``): block lookups
    found and not found there, bytes written to and read from it, blocks evicted from it, blocks that failed to be
    written to it."""

    tier: str  # "host" or "disk"
    tenant: str
    hits: int
    misses: int
    bytes_in: int
    bytes_out: int
    evictions: int
    write_errors: int = 0


class SchedulerStats(msgspec.Struct):
    num_running: int
    num_waiting_by_priority: dict[int, int]
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_query_tokens: int  # cumulative
    prefix_hit_tokens: int  # cumulative
    blocks_evicted: int  # cumulative
    num_preemptions: int  # cumulative
    step_prefill_tokens: int
    step_decode_tokens: int
    total_prefill_tokens: int  # cumulative tokens computed as prefill (prompt, chunks, recompute)
    total_decode_tokens: int  # cumulative
    # Speculative decoding, cumulative: drafts verified, drafts accepted, and request-steps that verified
    # drafts (each emitted 1 + its accepted drafts). Zero while speculation is off.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_steps: int = 0
    num_promotions: int = 0  # cumulative: requests promoted for going unserved for the starvation bound
    # Per KV cache group (one, or the full-attention group then the sliding-window one): the most blocks one
    # request held at once since start. A sliding group's stays within its window's blocks plus a step's.
    kv_peak_request_blocks: list[int] = []
    # Tokens routed to each expert per MoE layer since start; refreshed every step on the CPU and about
    # every EXPERT_LOAD_EVERY_CUDA steps on CUDA (a copy read once done, never waited for), else None.
    expert_load: list[list[int]] | None = None
    # With experts divided among ranks: tokens routed to each rank's experts, all layers, read with expert_load.
    expert_load_by_rank: list[int] | None = None
    # With experts divided: max over ranks / mean of the tokens routed to each rank's experts, per MoE layer,
    # averaged over the layers (1.0 is even); over the balancing window with enable_eplb, since start without.
    expert_imbalance: float | None = None
    # Expert load balancing (enable_eplb), cumulative: rebalances applied, bytes of expert weights moved between
    # ranks (all ranks), slot copies between ranks, slots whose expert was replaced by another; how long the last one took; logical experts with replicas now
    # (all layers); and for the last one, each rank's tokens over the window before it (measured) and the same
    # tokens under the new placement (predicted), with the imbalance of each.
    eplb_rebalances: int = 0
    eplb_bytes_moved: int = 0
    eplb_slots_copied: int = 0
    eplb_slots_reassigned: int = 0
    eplb_last_rebalance_ms: float = 0.0
    eplb_replicated_experts: int = 0
    eplb_rank_load_before: list[int] | None = None
    eplb_rank_load_after: list[float] | None = None
    eplb_imbalance_before: float | None = None
    eplb_imbalance_after: float | None = None
    # Host time of the last step, milliseconds: the scheduler's Python (schedule + update), the
    # runner's batch building (metadata and staging, part of execute), and execute as a whole
    # (which waits for the sampled tokens, so on a GPU it includes the device time). With overlapped
    # scheduling: schedule + resolve, the next step's batch building, and its launch plus the wait for
    # the previous step's tokens.
    step_schedule_ms: float = 0.0
    step_prepare_ms: float = 0.0
    step_execute_ms: float = 0.0
    # KV transfers between prefill and decode engines (docs/disaggregation.md), cumulative: transfers this engine
    # sent (prefill) or received into its cache (decode), their bytes and seconds (from the request for the
    # blocks to their arrival, on the decode side), and prompts a decode engine prefilled itself after a
    # transfer failed or timed out.
    kv_transfers: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_fallbacks: int = 0
    kv_transfer_pieces: int = 0  # pieces those transfers came in (more than one each: chunks sent while computing)
    # Prefix-cache tiers below the pool, per tier and tenant (empty when off), and the blocks the host tier
    # holds at most (0 when off): a router's prefix index counts them with the pool's.
    cache_tiers: list[TierStats] = []
    host_tier_blocks: int = 0
    # LoRA adapters (zero when the engine serves none): registered, resident in device slots, and requests waiting
    # for theirs to be written into a slot; cumulative: slot writes, resident adapters evicted from a slot for
    # another, slot writes served from host memory (hits) and disk reads (misses), adapters dropped from host
    # memory for room, slot writes that had to read the disk themselves, and seconds spent reading and parsing
    # adapters (off the step loop) and writing slots (between steps).
    lora_registered: int = 0
    lora_resident: int = 0
    lora_waiting_requests: int = 0
    lora_slot_loads: int = 0
    lora_slot_evictions: int = 0
    lora_host_hits: int = 0
    lora_host_misses: int = 0
    lora_host_evictions: int = 0
    lora_sync_reads: int = 0
    lora_read_seconds: float = 0.0
    lora_slot_load_seconds: float = 0.0
    # The vision encoder's cache (models that read images; zero otherwise), cumulative: images found there (not
    # encoded again), images the tower encoded, entries evicted for room; and the bytes its entries take now.
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
    encoder_cache_evictions: int = 0
    encoder_cache_bytes: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed drafts since start (0 before any)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_tokens_per_step(self) -> float:
        """Tokens a speculating request emitted per step, on average (1 + its accepted drafts; 0 before any)."""
        return (self.spec_steps + self.spec_accepted_tokens) / self.spec_steps if self.spec_steps else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
