"""Per-step engine statistics (what the gateway exports as metrics). Cheap to build: counters only."""

import msgspec

EXPERT_LOAD_EVERY_CUDA = 32


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
    # Tokens routed to each expert per MoE layer since start; refreshed every step on the CPU and about
    # every EXPERT_LOAD_EVERY_CUDA steps on CUDA (a copy read once done, never waited for), else None.
    expert_load: list[list[int]] | None = None
    # With experts divided among ranks: tokens routed to each rank's experts, all layers, read with expert_load.
    expert_load_by_rank: list[int] | None = None
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
