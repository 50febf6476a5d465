"""Prometheus metrics, in the `moegate_` namespace. One registry per app, so tests can run several apps."""

import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.engine_metrics import EngineCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


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
        # Service-level objectives (the priority class's, gateway/slo_admission.py): each request of a class with
        # objectives met them, missed them, or was refused by SLO admission; goodput counts the completion tokens
        # of requests that met theirs (or whose class has none); attainment is met / all three so far.
        self.slo_requests = Counter("moegate_slo_requests", "requests of classes with objectives, by outcome: met, "
                                    "missed, refused (by SLO admission)", labels + ["outcome"], registry=r)
        self.goodput_tokens = Counter("moegate_goodput_tokens", "completion tokens of requests that met their "
                                      "class's objectives (or whose class has none)", labels, registry=r)
        self.slo_attainment = Gauge("moegate_slo_attainment", "requests that met their class's objectives / "
                                    "requests judged or refused, since start", labels, registry=r)
        self._slo_counts: dict[tuple[str, str], list[int]] = {}  # (tenant, class) -> [met, judged or refused]
        r.register(EngineCollector(engine))
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

    def slo_outcome(self, tenant: str, priority_class: str, outcome: str, completion_tokens: int = 0) -> None:
        """One request's verdict: ``outcome`` met, missed or refused, or "none" for a finished request of a class
        without objectives (its tokens are goodput, it is not judged)."""
        if outcome in ("met", "none"):
            self.goodput_tokens.labels(tenant, priority_class).inc(completion_tokens)
        if outcome == "none":
            return
        self.slo_requests.labels(tenant, priority_class, outcome).inc()
        key = (tenant, priority_class)
        counts = self._slo_counts.get(key)
        if counts is None:
            if len(self._slo_counts) >= 10_000:
                self._slo_counts.clear()
            counts = self._slo_counts[key] = [0, 0]
        counts[0] += outcome == "met"
        counts[1] += 1
        self.slo_attainment.labels(tenant, priority_class).set(counts[0] / counts[1])

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

    __slots__ = ("series", "start", "last", "first_at", "on_first", "metrics", "adapter")

    def __init__(self, metrics: GatewayMetrics, tenant: str, priority_class: str, adapter: str | None = None) -> None:
        self.series = metrics.series(tenant, priority_class)
        self.metrics, self.adapter = metrics, adapter  # adapter: the LoRA adapter the request runs under
        self.start = self.last = time.perf_counter()
        self.first_at: float | None = None  # when the first output came
        self.on_first = None  # called at the first output (SLO admission's count of the prefill queued ahead)

    def ttft_s(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.start

    def mean_itl_s(self, completion_tokens: int) -> float | None:
        """The mean time between the request's tokens after its first (None with fewer than two)."""
        if self.first_at is None or completion_tokens < 2:
            return None
        return (self.last - self.first_at) / (completion_tokens - 1)

    def delta(self, first: bool, queue_time_s: float | None = None) -> None:
        now = time.perf_counter()
        if first:
            self.first_at = now
            if self.on_first is not None:
                self.on_first()
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
