"""Per-step engine statistics (what the gateway exports as metrics). Cheap to build: counters only."""

import msgspec


class SchedulerStats(msgspec.Struct):
    num_running: int
    num_waiting_by_rank: dict[int, int]
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_query_tokens: int  # cumulative
    prefix_hit_tokens: int  # cumulative
    blocks_evicted: int  # cumulative
    num_preemptions: int  # cumulative
    step_prefill_tokens: int
    step_decode_tokens: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
