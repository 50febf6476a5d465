"""Prometheus metrics, in the `moegate_` namespace. One registry per app, so tests can run several apps."""

import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.disaggregation import LOCAL_REASONS, DisaggregatedEngines
from gateway.replica_router import ReplicaRouter, replicas_of

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector:
    """Engine gauges read from each replica's latest stats at scrape time (nothing to update per step).

    Every series has a ``replica`` label. The ``vllm:`` gauges repeat queue depth, running requests and
    KV-cache utilisation under the names the Gateway API Inference Extension's endpoint picker (and
    llm-d's scorers) read by default, so a Kubernetes deployment can route across moegate pods with
    them instead of with our router.
    """

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        families = {
            "up": GaugeMetricFamily("moegate_engine_replica_up", "1 while the replica serves, 0 while it starts or is down",
                                    labels=["replica"]),
            "running": GaugeMetricFamily("moegate_engine_running_requests", "requests running in the engine",
                                         labels=["replica"]),
            "waiting": GaugeMetricFamily("moegate_engine_waiting_requests", "requests waiting, by priority rank",
                                         labels=["replica", "rank"]),
            "used": GaugeMetricFamily("moegate_kv_blocks_used", "KV cache blocks in use", labels=["replica"]),
            "total": GaugeMetricFamily("moegate_kv_blocks_total", "KV cache blocks in the pool", labels=["replica"]),
            "hit": GaugeMetricFamily("moegate_prefix_cache_hit_rate", "prompt tokens served from the prefix cache / queried",
                                     labels=["replica"]),
            "preempt": CounterMetricFamily("moegate_preemptions", "requests preempted (recompute)", labels=["replica"]),
            "prefill": CounterMetricFamily("moegate_prefill_tokens", "tokens computed as prefill", labels=["replica"]),
            "decode": CounterMetricFamily("moegate_decode_tokens", "tokens computed as decode", labels=["replica"]),
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
            "spec_draft": CounterMetricFamily("moegate_spec_draft_tokens",
                                              "speculative decoding: draft tokens verified", labels=["replica"]),
            "spec_accepted": CounterMetricFamily("moegate_spec_accepted_tokens",
                                                 "speculative decoding: draft tokens accepted", labels=["replica"]),
            "spec_steps": CounterMetricFamily("moegate_spec_steps",
                                              "speculative decoding: request-steps that verified drafts (each "
                                              "emitted 1 + its accepted drafts)", labels=["replica"]),
            "moved": CounterMetricFamily("moegate_router_moved_requests",
                                         "requests the router moved off this replica's queue, before they started, "
                                         "to a replica with a free slot", labels=["replica"]),
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
            "gie_waiting": GaugeMetricFamily("vllm:num_requests_waiting", "requests waiting (queue depth)", labels=["replica"]),
            "gie_running": GaugeMetricFamily("vllm:num_requests_running", "requests running", labels=["replica"]),
            # The endpoint picker's KV metric was renamed in vLLM; both names, same value (0..1).
            "gie_kv": GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache utilisation, 1 = full", labels=["replica"]),
            "gie_kv_old": GaugeMetricFamily("vllm:gpu_cache_usage_perc", "KV-cache utilisation, 1 = full",
                                            labels=["replica"]),
        }
        # Prefix-cache tiers below the KV pool (host memory, disk), per tier and tenant (the engine's tenant id).
        tier_help = {"hits": "block lookups found in the tier", "misses": "block lookups that ended in the tier",
                     "bytes_in": "bytes written to the tier", "bytes_out": "bytes read from the tier",
                     "evictions": "blocks evicted from the tier",
                     "write_errors": "blocks the tier failed to write (a full disk, say); nothing of them is kept"}
        for field, text in tier_help.items():
            families["tier_" + field] = CounterMetricFamily(f"moegate_prefix_tier_{field}",
                                                            f"prefix-cache tiers: {text}",
                                                            labels=["replica", "tier", "tenant"])
        if isinstance(self.engine, ReplicaRouter):
            for name, moved in zip(self.engine.names, self.engine.moved_from):
                families["moved"].add_metric([name], moved)
        if isinstance(self.engine, DisaggregatedEngines):
            for (name, reason), count in sorted(self.engine.local_prefills_by.items()):
                families["kv_local"].add_metric([name, reason], count)
        for name, replica in replicas_of(self.engine):
            families["up"].add_metric([name], float(replica.dead is None and replica.info is not None))
            stats = replica.stats
            if stats is None:
                continue
            kv = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
            waiting = sum(stats.num_waiting_by_priority.values())
            families["running"].add_metric([name], stats.num_running)
            for priority, count in stats.num_waiting_by_priority.items():
                families["waiting"].add_metric([name, str(priority)], count)
            families["used"].add_metric([name], stats.kv_blocks_used)
            families["total"].add_metric([name], stats.kv_blocks_total)
            families["hit"].add_metric([name], stats.prefix_hit_rate)
            families["preempt"].add_metric([name], stats.num_preemptions)
            families["prefill"].add_metric([name], stats.total_prefill_tokens)
            families["decode"].add_metric([name], stats.total_decode_tokens)
            for layer, counts in enumerate(stats.expert_load or ()):
                for expert, count in enumerate(counts):
                    families["experts"].add_metric([name, str(layer), str(expert)], count)
            for rank, count in enumerate(stats.expert_load_by_rank or ()):
                families["expert_ranks"].add_metric([name, str(rank)], count)
            for row in stats.cache_tiers:
                for field in tier_help:
                    families["tier_" + field].add_metric([name, row.tier, row.tenant], getattr(row, field))
            _add_balance(families, name, stats)
            families["spec_draft"].add_metric([name], stats.spec_draft_tokens)
            families["spec_accepted"].add_metric([name], stats.spec_accepted_tokens)
            families["spec_steps"].add_metric([name], stats.spec_steps)
            if stats.kv_transfers or stats.kv_transfer_fallbacks:  # a prefill or decode engine that has worked
                families["kv_transfers"].add_metric([name], stats.kv_transfers)
                families["kv_bytes"].add_metric([name], stats.kv_transfer_bytes)
                families["kv_seconds"].add_metric([name], stats.kv_transfer_seconds)
                families["kv_fallbacks"].add_metric([name], stats.kv_transfer_fallbacks)
            families["gie_waiting"].add_metric([name], waiting)
            families["gie_running"].add_metric([name], stats.num_running)
            families["gie_kv"].add_metric([name], kv)
            families["gie_kv_old"].add_metric([name], kv)
        yield from (f for f in families.values() if f.samples)


def _add_balance(families: dict, name: str, stats) -> None:
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


class GatewayMetrics:
    """Per tenant and priority class: requests, tokens, rejections, latencies."""

    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry()
        labels = ["tenant", "priority_class"]
        r = self.registry
        self.requests = Counter("moegate_requests", "finished requests by HTTP status", labels + ["status"], registry=r)
        self.prompt_tokens = Counter("moegate_prompt_tokens", "prompt tokens", labels, registry=r)
        self.cached_tokens = Counter("moegate_cached_prompt_tokens", "prompt tokens served from the prefix cache", labels, registry=r)
        self.completion_tokens = Counter("moegate_completion_tokens", "completion tokens", labels, registry=r)
        self.rejections = Counter("moegate_rejections", "requests refused before the engine, by reason", labels + ["reason"], registry=r)
        self.ttft = Histogram("moegate_time_to_first_token_seconds", "time to first token", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("moegate_inter_token_latency_seconds", "time between streamed deltas", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("moegate_queue_time_seconds", "time in the engine's waiting queue before first scheduled",
                               labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("moegate_e2e_latency_seconds", "request latency, end to end", labels, buckets=_LATENCY_BUCKETS, registry=r)
        # Per LoRA adapter (a bounded set: adapters are made by operators); requests under the base model are not
        # counted here. Tenants, classes and statuses stay on the series above, so the label sets do not multiply.
        self.adapter_requests = Counter("moegate_adapter_requests", "finished requests that ran under a LoRA adapter",
                                        ["adapter"], registry=r)
        self.adapter_prompt_tokens = Counter("moegate_adapter_prompt_tokens", "prompt tokens under a LoRA adapter",
                                             ["adapter"], registry=r)
        self.adapter_completion_tokens = Counter("moegate_adapter_completion_tokens",
                                                 "completion tokens under a LoRA adapter", ["adapter"], registry=r)
        r.register(_EngineCollector(engine))
        self._series: dict[tuple[str, str], _Series] = {}

    def series(self, tenant: str, priority_class: str) -> "_Series":
        """The labelled children of one tenant and class, looked up once: ``labels()`` takes a lock and
        builds its key on every call, and a request with 8 deltas made 13 such calls."""
        found = self._series.get((tenant, priority_class))
        if found is None:
            if len(self._series) >= 10_000:  # bound memory: tenants come and go on a long-lived server
                self._series.clear()
            found = self._series[(tenant, priority_class)] = _Series(self, (tenant, priority_class))
        return found

    def render(self) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


class _Series:
    """One tenant and class's children of every per-request metric."""

    __slots__ = ("_requests", "_labels", "queue", "ttft", "itl", "e2e", "prompt", "cached", "completion", "by_status")

    def __init__(self, m: GatewayMetrics, labels: tuple[str, str]) -> None:
        self._requests, self._labels = m.requests, labels
        self.queue, self.ttft, self.itl, self.e2e = (h.labels(*labels) for h in (m.queue, m.ttft, m.itl, m.e2e))
        self.prompt, self.cached, self.completion = (
            c.labels(*labels) for c in (m.prompt_tokens, m.cached_tokens, m.completion_tokens))
        self.by_status: dict[int, object] = {}

    def requests(self, status: int):
        child = self.by_status.get(status)
        if child is None:
            child = self.by_status[status] = self._requests.labels(*self._labels, str(status))
        return child


class RequestTimer:
    """Latency bookkeeping for one request; feeds TTFT, inter-token and end-to-end histograms."""

    __slots__ = ("series", "start", "last", "metrics", "adapter")

    def __init__(self, metrics: GatewayMetrics, tenant: str, priority_class: str, adapter: str | None = None) -> None:
        self.series = metrics.series(tenant, priority_class)
        self.metrics, self.adapter = metrics, adapter  # adapter: the LoRA adapter the request runs under
        self.start = self.last = time.perf_counter()

    def delta(self, first: bool, queue_time_s: float | None = None) -> None:
        now = time.perf_counter()
        if first:
            if queue_time_s is not None:
                self.series.queue.observe(queue_time_s)
            self.series.ttft.observe(now - self.start)
        else:
            self.series.itl.observe(now - self.last)
        self.last = now

    def finish(self, status: int, usage) -> None:
        series = self.series
        series.e2e.observe(time.perf_counter() - self.start)
        series.requests(status).inc()
        if usage is not None:
            series.prompt.inc(usage.prompt_tokens)
            series.cached.inc(usage.cached_prompt_tokens)
            series.completion.inc(usage.completion_tokens)
            if self.adapter is not None:
                m = self.metrics
                m.adapter_requests.labels(self.adapter).inc()
                m.adapter_prompt_tokens.labels(self.adapter).inc(usage.prompt_tokens)
                m.adapter_completion_tokens.labels(self.adapter).inc(usage.completion_tokens)


METRICS = web.AppKey("metrics", GatewayMetrics)
