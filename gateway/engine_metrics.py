"""Engine gauges and counters for /metrics, read from each replica's latest stats at scrape time (nothing to update
per step), grouped by what they describe: the scheduler's queues and KV pool, the experts' load and rebalancing,
speculative decoding, the router's moves, KV transfers between prefill and decode engines, the prefix-cache tiers,
and the series the Gateway API Inference Extension reads.

Every series has a ``replica`` label. The ``vllm:`` gauges repeat queue depth, running requests and KV-cache
utilisation under the names the Gateway API Inference Extension's endpoint picker (and llm-d's scorers) read by
default, so a Kubernetes deployment can route across moegate pods with them instead of with our router.
"""

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.core.stats import SchedulerStats
from engine.serving.client import EngineClient
from gateway.disaggregation import LOCAL_REASONS, DisaggregatedEngines
from gateway.replica_router import ReplicaRouter, replicas_of

Reported = list[tuple[str, SchedulerStats]]  # (replica name, its latest stats) for each replica that has reported


class EngineCollector:
    """The engine's series (a prometheus_client custom collector), for a single engine or every replica."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        reported = [(name, replica.stats) for name, replica in replicas_of(self.engine) if replica.stats is not None]
        for group in (_scheduler, _experts, _speculative, _router_moves, _kv_transfers, _endpoint_picker,
                      _prefix_tiers, _encoder_cache):
            yield from (family for family in group(self.engine, reported) if family.samples)


def _scheduler(engine: EngineClient, reported: Reported) -> list[Metric]:
    """Each replica's state, running and waiting requests, KV pool and prefix-cache use, preemptions, tokens."""
    families = {
        "up": GaugeMetricFamily("moegate_engine_replica_up", "1 while the replica serves, 0 while it starts or is down",
                                labels=["replica"]),
        "running": GaugeMetricFamily("moegate_engine_running_requests", "requests running in the engine",
                                     labels=["replica"]),
        "waiting": GaugeMetricFamily("moegate_engine_waiting_requests", "requests waiting, by priority rank",
                                     labels=["replica", "rank"]),
        "used": GaugeMetricFamily("moegate_kv_blocks_used", "KV cache blocks in use", labels=["replica"]),
        "total": GaugeMetricFamily("moegate_kv_blocks_total", "KV cache blocks in the pool", labels=["replica"]),
        "hit": GaugeMetricFamily("moegate_prefix_cache_hit_rate",
                                 "prompt tokens served from the prefix cache / queried",
                                 labels=["replica"]),
        "preempt": CounterMetricFamily("moegate_preemptions", "requests preempted (recompute)", labels=["replica"]),
        "promote": CounterMetricFamily("moegate_starvation_promotions",
                                       "requests promoted ahead of every class for going unserved for "
                                       "--starvation-bound-seconds", labels=["replica"]),
        "prefill": CounterMetricFamily("moegate_prefill_tokens", "tokens computed as prefill", labels=["replica"]),
        "decode": CounterMetricFamily("moegate_decode_tokens", "tokens computed as decode", labels=["replica"]),
    }
    for name, replica in replicas_of(engine):
        families["up"].add_metric([name], float(replica.dead is None and replica.info is not None))
    for name, stats in reported:
        for priority, count in stats.num_waiting_by_priority.items():
            families["waiting"].add_metric([name, str(priority)], count)
        _add_fields(families, name, stats, running="num_running", used="kv_blocks_used", total="kv_blocks_total",
                    hit="prefix_hit_rate", preempt="num_preemptions", promote="num_promotions",
                    prefill="total_prefill_tokens",
                    decode="total_decode_tokens")
    return list(families.values())


def _add_fields(families: dict[str, Metric], name: str, stats: SchedulerStats, **fields: str) -> None:
    """One sample per family named by ``fields``' keys: replica ``name``'s value of the stats field it maps to."""
    for key, field in fields.items():
        families[key].add_metric([name], getattr(stats, field))


def _experts(engine: EngineClient, reported: Reported) -> list[Metric]:
    """Tokens routed to each expert and each rank's experts; balance and rebalancing (experts divided only)."""
    families = {
        "experts": CounterMetricFamily("moegate_expert_tokens", "tokens routed to each expert",
                                       labels=["replica", "layer", "expert"]),
        "expert_ranks": CounterMetricFamily("moegate_expert_rank_tokens",
                                            "tokens routed to the experts each rank holds (experts divided)",
                                            labels=["replica", "rank"]),
        "imbalance": GaugeMetricFamily("moegate_expert_imbalance",
                                       "max over ranks / mean of the tokens routed to each rank's experts, per "
                                       "MoE layer, averaged over layers (experts divided; over the balancing "
                                       "window with --enable-eplb, since start without)", labels=["replica"]),
        "eplb_rebalances": CounterMetricFamily("moegate_eplb_rebalances", "expert rebalances applied",
                                               labels=["replica"]),
        "eplb_bytes": CounterMetricFamily("moegate_eplb_moved_bytes",
                                          "bytes of expert weights moved between ranks by rebalancing",
                                          labels=["replica"]),
        "eplb_seconds": GaugeMetricFamily("moegate_eplb_last_rebalance_seconds",
                                          "how long the last rebalance held the engine", labels=["replica"]),
        "eplb_replicated": GaugeMetricFamily("moegate_eplb_replicated_experts",
                                             "experts holding more than one slot now, all layers", labels=["replica"]),
        "eplb_load": GaugeMetricFamily("moegate_eplb_rank_tokens",
                                       "each rank's tokens over the window before the last rebalance: measured "
                                       "(when=before) and predicted under the new placement (when=after)",
                                       labels=["replica", "rank", "when"]),
        "eplb_imbalance": GaugeMetricFamily("moegate_eplb_imbalance",
                                            "imbalance over the window before the last rebalance (when=before, "
                                            "measured) and predicted after it (when=after)",
                                            labels=["replica", "when"]),
    }
    for name, stats in reported:
        for layer, counts in enumerate(stats.expert_load or ()):
            for expert, count in enumerate(counts):
                families["experts"].add_metric([name, str(layer), str(expert)], count)
        for rank, count in enumerate(stats.expert_load_by_rank or ()):
            families["expert_ranks"].add_metric([name, str(rank)], count)
        _add_balance(families, name, stats)
    return list(families.values())


def _add_balance(families: dict[str, Metric], name: str, stats: SchedulerStats) -> None:
    """The expert-balance series of one replica's stats (none unless its experts are divided)."""
    if stats.expert_imbalance is not None:
        families["imbalance"].add_metric([name], stats.expert_imbalance)
    if stats.eplb_rebalances:
        families["eplb_rebalances"].add_metric([name], stats.eplb_rebalances)
        families["eplb_bytes"].add_metric([name], stats.eplb_bytes_moved)
        families["eplb_seconds"].add_metric([name], stats.eplb_last_rebalance_ms / 1e3)
        families["eplb_replicated"].add_metric([name], stats.eplb_replicated_experts)
        for when, loads, ratio in (("before", stats.eplb_rank_load_before, stats.eplb_imbalance_before),
                                   ("after", stats.eplb_rank_load_after, stats.eplb_imbalance_after)):
            for rank, tokens in enumerate(loads or ()):
                families["eplb_load"].add_metric([name, str(rank), when], tokens)
            if ratio is not None:
                families["eplb_imbalance"].add_metric([name, when], ratio)


def _speculative(engine: EngineClient, reported: Reported) -> list[Metric]:
    """Speculative decoding's drafts verified and accepted."""
    families = {
        "spec_draft": CounterMetricFamily("moegate_spec_draft_tokens",
                                          "speculative decoding: draft tokens verified", labels=["replica"]),
        "spec_accepted": CounterMetricFamily("moegate_spec_accepted_tokens",
                                             "speculative decoding: draft tokens accepted", labels=["replica"]),
        "spec_steps": CounterMetricFamily("moegate_spec_steps",
                                          "speculative decoding: request-steps that verified drafts (each "
                                          "emitted 1 + its accepted drafts)", labels=["replica"]),
    }
    for name, stats in reported:
        _add_fields(families, name, stats, spec_draft="spec_draft_tokens", spec_accepted="spec_accepted_tokens",
                    spec_steps="spec_steps")
    return list(families.values())


def _encoder_cache(engine: EngineClient, reported: Reported) -> list[Metric]:
    """The vision encoder's cache: images found there, images encoded, evictions, bytes held (image models)."""
    families = {
        "hits": CounterMetricFamily("moegate_encoder_cache_hits", "images whose vision-encoder output was found "
                                    "in the encoder cache (same pixels, same tenant): not encoded again",
                                    labels=["replica"]),
        "misses": CounterMetricFamily("moegate_encoder_cache_misses", "images the vision encoder encoded (not in "
                                      "the encoder cache)", labels=["replica"]),
        "evictions": CounterMetricFamily("moegate_encoder_cache_evictions", "encoder cache entries evicted for "
                                         "room (least recently used first)", labels=["replica"]),
        "bytes": GaugeMetricFamily("moegate_encoder_cache_bytes", "host memory the encoder cache's entries take",
                                   labels=["replica"]),
    }
    for name, stats in reported:
        if stats.encoder_cache_hits or stats.encoder_cache_misses:  # an engine that has seen images
            _add_fields(families, name, stats, hits="encoder_cache_hits", misses="encoder_cache_misses",
                        evictions="encoder_cache_evictions", bytes="encoder_cache_bytes")
    return list(families.values())


def _router_moves(engine: EngineClient, reported: Reported) -> list[Metric]:
    """Requests the replica router moved off each replica's queue (a router only)."""
    families = {
        "moved": CounterMetricFamily("moegate_router_moved_requests",
                                     "requests the router moved off this replica's queue, before they started, "
                                     "to a replica with a free slot", labels=["replica"]),
    }
    if isinstance(engine, ReplicaRouter):
        for i in engine.current():  # the replicas of the fleet now (a removed one's series go with it)
            families["moved"].add_metric([engine.names[i]], engine.moved_from[i])
    return list(families.values())


def _kv_transfers(engine: EngineClient, reported: Reported) -> list[Metric]:
    """Prompts' KV moved between prefill and decode engines, and the prompts a decode engine computed itself."""
    families = {
        "kv_transfers": CounterMetricFamily("moegate_kv_transfers", "prompts' KV moved between a prefill and a "
                                            "decode engine (sent by a prefill, received by a decode engine)",
                                            labels=["replica"]),
        "kv_bytes": CounterMetricFamily("moegate_kv_transfer_bytes", "bytes of KV blocks moved between engines",
                                        labels=["replica"]),
        "kv_seconds": CounterMetricFamily("moegate_kv_transfer_seconds", "seconds KV transfers took, summed (on a "
                                          "decode engine: from asking for the blocks to their arrival)",
                                          labels=["replica"]),
        "kv_fallbacks": CounterMetricFamily("moegate_kv_transfer_fallbacks", "prompts a decode engine prefilled "
                                            "itself because their KV transfer failed or timed out",
                                            labels=["replica"]),
        "kv_local": CounterMetricFamily("moegate_kv_local_prefills", "prompts a decode engine computed itself "
                                        "instead of receiving their KV, by reason: " + "; ".join(
                                            f"{k}: {v}" for k, v in LOCAL_REASONS.items()),
                                        labels=["replica", "reason"]),
    }
    for name, stats in reported:
        if stats.kv_transfers or stats.kv_transfer_fallbacks:  # a prefill or decode engine that has worked
            _add_fields(families, name, stats, kv_transfers="kv_transfers", kv_bytes="kv_transfer_bytes",
                        kv_seconds="kv_transfer_seconds", kv_fallbacks="kv_transfer_fallbacks")
    if isinstance(engine, DisaggregatedEngines):
        for (name, reason), count in sorted(engine.local_prefills_by.items()):
            families["kv_local"].add_metric([name, reason], count)
    return list(families.values())


def _endpoint_picker(engine: EngineClient, reported: Reported) -> list[Metric]:
    """Queue depth, running requests and KV-cache use under the ``vllm:`` names an endpoint picker reads."""
    families = {
        "gie_waiting": GaugeMetricFamily("vllm:num_requests_waiting", "requests waiting (queue depth)",
                                         labels=["replica"]),
        "gie_running": GaugeMetricFamily("vllm:num_requests_running", "requests running", labels=["replica"]),
        "gie_kv": GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache utilisation, 1 = full", labels=["replica"]),
        "gie_kv_old": GaugeMetricFamily("vllm:gpu_cache_usage_perc", "KV-cache utilisation, 1 = full",
                                        labels=["replica"]),
    }
    for name, stats in reported:
        kv = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        families["gie_waiting"].add_metric([name], sum(stats.num_waiting_by_priority.values()))
        families["gie_running"].add_metric([name], stats.num_running)
        families["gie_kv"].add_metric([name], kv)
        families["gie_kv_old"].add_metric([name], kv)
    return list(families.values())


TIER_HELP = {"hits": "block lookups found in the tier", "misses": "block lookups that ended in the tier",
             "bytes_in": "bytes written to the tier", "bytes_out": "bytes read from the tier",
             "evictions": "blocks evicted from the tier",
             "write_errors": "blocks the tier failed to write (a full disk, say); nothing of them is kept"}


def _prefix_tiers(engine: EngineClient, reported: Reported) -> list[Metric]:
    """The prefix-cache tiers below the KV pool (host memory, disk), per tier and tenant (the engine's tenant id)."""
    families = {field: CounterMetricFamily(f"moegate_prefix_tier_{field}", f"prefix-cache tiers: {text}",
                                           labels=["replica", "tier", "tenant"]) for field, text in TIER_HELP.items()}
    for name, stats in reported:
        for row in stats.cache_tiers:
            for field, family in families.items():
                family.add_metric([name, row.tier, row.tenant], getattr(row, field))
    return list(families.values())
