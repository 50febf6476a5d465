"""From request records to numbers: latency statistics, throughput, goodput, errors, quotas, fairness, time series.

Percentiles interpolate linearly between closest ranks (numpy's default).
Goodput counts successful requests within every SLO bound: ttft, tpot and
e2e per request, itl on the request's mean inter-token latency; a request
with fewer than two tokens has no tpot/itl and is judged on the other bounds.
Each priority class may have its own bounds (``slo_by_priority``), which replace
the run's for its requests. Attainment is the share of a group's requests,
refused and failed ones included, that met their bounds; goodput tokens are the
completion tokens of those requests.

Fairness: a tenant's service is its served tokens (prompt + completion of
requests answered 200). Its normalised share is (its share of all service) /
(its share of the weights); Jain's index over those shares is 1 when service
follows the weights exactly and 1/n when one tenant gets everything.
"""

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from loadgen.records import RequestRecord

LATENCIES = ("ttft", "tpot", "itl", "e2e", "qtfb", "queue")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, like ``numpy.percentile``."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: Sequence[float]) -> dict | None:
    """count, mean, min, p50, p90, p99, max (None for no values)."""
    if not values:
        return None
    return {"count": len(values), "mean": sum(values) / len(values), "min": min(values), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99), "max": max(values)}


def jain_index(xs: Sequence[float]) -> float | None:
    """(sum x)^2 / (n * sum x^2): 1 for equal values, 1/n when one takes all; None for no values or all zero."""
    if not xs:
        return None
    square_sum = sum(x * x for x in xs)
    return None if square_sum == 0 else sum(xs) ** 2 / (len(xs) * square_sum)


def _latency_values(records: Iterable[RequestRecord], name: str) -> list[float]:
    if name == "itl":
        return [x for r in records if r.ok for x in r.itl_s]
    attr = name + "_s"
    return [v for r in records if (v := getattr(r, attr)) is not None and (r.ok or name in ("queue", "qtfb"))]


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    if not record.ok:
        return False
    checks = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2e": record.e2e_s,
              "itl": sum(record.itl_s) / len(record.itl_s) if record.itl_s else None}
    return all(checks[k] is None or checks[k] <= bound for k, bound in slo.items())


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: dict[str, float] | None = None,
              slo_by_priority: dict[str, dict[str, float]] | None = None) -> dict:
    """One group's numbers (a run, a tenant, a priority class). Rates are over the run's ``duration_s``; a record
    is judged by its priority class's bounds in ``slo_by_priority``, else by ``slo``."""
    slo, by_priority = slo or {}, slo_by_priority or {}

    def bounds(r: RequestRecord) -> dict[str, float]:
        return by_priority.get(r.priority, slo)
    ok = [r for r in records if r.ok]
    dur = max(duration_s, 1e-9)
    errors: dict[str, int] = defaultdict(int)
    for r in records:
        if not r.ok:
            errors[str(r.status) if r.status else "no response"] += 1
    retry_after = [v for r in records for v in r.retry_after_s]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    judged = [r for r in records if bounds(r)]
    good = [r for r in ok if bounds(r) and meets_slo(r, bounds(r))]
    return {
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "errors_by_status": dict(sorted(errors.items())),
        "http_429": sum(r.attempt_statuses.count(429) for r in records),  # retried ones included
        "retries": sum(r.retries for r in records),
        "retry_after_s": describe(retry_after),
        "duration_s": duration_s,
        "request_throughput": len(ok) / dur,
        "output_token_throughput": completion / dur,
        "total_token_throughput": (prompt + completion) / dur,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "cached_fraction": cached / prompt if prompt else None,
        "served_tokens": sum(r.served_tokens for r in records),
        "goodput": len(good) / dur if judged else None,
        "goodput_fraction": len(good) / len(judged) if judged else None,
        "attainment": len(good) / len(judged) if judged else None,
        "goodput_tokens": sum(r.completion_tokens for r in good) if judged else None,
        "goodput_token_throughput": sum(r.completion_tokens for r in good) / dur if judged else None,
        "latency_s": {name: describe(_latency_values(records, name)) for name in LATENCIES},
    }


def fairness(records: Sequence[RequestRecord], weights: dict[str, float]) -> dict:
    """Each tenant's share of served tokens against its weight, and Jain's index over the normalised shares.

    Tenants that sent nothing are left out (a share of nothing asked is not unfair).
    """
    served: dict[str, int] = defaultdict(int)
    for r in records:
        served[r.tenant] += r.served_tokens
    tenants = [t for t in weights if any(r.tenant == t for r in records)]
    total = sum(served[t] for t in tenants)
    weight_total = sum(weights[t] for t in tenants)
    per_tenant = {}
    for t in tenants:
        share = served[t] / total if total else 0.0
        weight_share = weights[t] / weight_total
        per_tenant[t] = {"served_tokens": served[t], "share": share, "weight": weights[t],
                         "weight_share": weight_share, "normalized_share": share / weight_share}
    return {"tenants": per_tenant, "jain_index": jain_index([v["normalized_share"] for v in per_tenant.values()])}


def group_by(records: Iterable[RequestRecord], key) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[key(r)].append(r)
    return dict(groups)


def _spread(bins: list[float], start: float, end: float, amount: float, width: float) -> None:
    """Add ``amount`` to ``bins`` spread evenly over [start, end) (all in the bin of ``start`` if it is a point)."""
    n = len(bins)
    if end <= start:
        bins[min(max(int(start / width), 0), n - 1)] += amount
        return
    rate = amount / (end - start)
    i = max(int(start / width), 0)
    while i < n and i * width < end:
        lo, hi = max(start, i * width), min(end, (i + 1) * width)
        if hi > lo:
            bins[i] += rate * (hi - lo)
        i += 1


def time_series(records: Sequence[RequestRecord], weights: dict[str, float], duration_s: float,
                num_bins: int = 60) -> dict:
    """Per-window numbers over the run.

    ``in_flight``: requests sent and not finished at the window's end;
    ``waiting``: of those, the ones without a first token yet (queued at the server);
    ``output_tok_s``: completion tokens spread over each request's streaming time;
    ``jain``: fairness among tenants with requests in flight during the window.
    """
    width = max(duration_s, 1e-3) / num_bins
    times = [(i + 1) * width for i in range(num_bins)]
    done = [0.0] * num_bins
    failed = [0.0] * num_bins
    out_tokens = [0.0] * num_bins
    per_tenant_tokens = {t: [0.0] * num_bins for t in weights}
    per_tenant_served = {t: [0.0] * num_bins for t in weights}
    active = {t: [False] * num_bins for t in weights}
    in_flight = [0] * num_bins
    waiting = [0] * num_bins
    for r in records:
        if r.sent_s is None:
            continue
        end = r.end_s if r.end_s is not None else duration_s
        first = r.first_token_s if r.first_token_s is not None else end
        idx = min(int(end / width), num_bins - 1)
        (done if r.ok else failed)[idx] += 1
        _spread(out_tokens, first, end, r.completion_tokens, width)
        if r.tenant in per_tenant_tokens:
            _spread(per_tenant_tokens[r.tenant], first, end, r.completion_tokens, width)
            _spread(per_tenant_served[r.tenant], first, end, r.served_tokens, width)
            for i in range(min(int(r.sent_s / width), num_bins - 1), idx + 1):
                active[r.tenant][i] = True
        for i, t in enumerate(times):
            if r.sent_s <= t < end:
                in_flight[i] += 1
                if t < first:
                    waiting[i] += 1
    jain = []
    for i in range(num_bins):
        live = [t for t in weights if active[t][i]]
        total_w = sum(weights[t] for t in live)
        total_s = sum(per_tenant_served[t][i] for t in live)
        if len(live) < 2 or total_s == 0:
            jain.append(None)
            continue
        jain.append(jain_index([(per_tenant_served[t][i] / total_s) / (weights[t] / total_w) for t in live]))
    return {
        "t_s": times, "bin_s": width,
        "completed_req_s": [x / width for x in done], "failed_req_s": [x / width for x in failed],
        "output_tok_s": [x / width for x in out_tokens],
        "tenant_output_tok_s": {t: [x / width for x in v] for t, v in per_tenant_tokens.items()},
        "in_flight": in_flight, "waiting": waiting, "jain": jain,
    }


def image_ttft(records: Sequence[RequestRecord]) -> dict | None:
    """Time to first token of the answered requests with images, split by whether any of their images was new
    (never sent before by the tenant) or all repeated earlier ones, which the server's encoder cache may hold;
    ``encoder_share``: (mean TTFT with new images - mean TTFT with repeated ones) / mean TTFT with new images,
    the part of a new image's time to first token the vision encoder takes by this estimate (None without both
    groups). None when no request carried images."""
    with_images = [r for r in records if r.images and r.ok and r.ttft_s is not None]
    if not any(r.images for r in records):
        return None
    new = [r.ttft_s for r in with_images if r.new_images]
    repeated = [r.ttft_s for r in with_images if not r.new_images]
    share = None
    if new and repeated:
        mean_new, mean_repeated = sum(new) / len(new), sum(repeated) / len(repeated)
        share = (mean_new - mean_repeated) / mean_new if mean_new > 0 else None
    return {"images": sum(r.images for r in records), "new_images": sum(r.new_images for r in records),
            "ttft_new_s": describe(new), "ttft_repeated_s": describe(repeated), "encoder_share": share}


def analyze(records: Sequence[RequestRecord], weights: dict[str, float], duration_s: float,
            slo: dict[str, float] | None = None, slo_by_priority: dict[str, dict[str, float]] | None = None) -> dict:
    """Everything the reports show: overall, per tenant, per priority class, fairness and time series."""
    by_priority = group_by((r for r in records if r.priority is not None), lambda r: r.priority)
    fair = fairness(records, weights)
    fair["by_priority"] = {
        p: fairness(rs, {t: weights[t] for t in weights if any(r.tenant == t for r in rs)})["jain_index"]
        for p, rs in by_priority.items()
    }
    by_tenant = group_by(records, lambda r: r.tenant)
    return {
        "duration_s": duration_s,
        "slo_s": slo or {},
        "slo_by_priority_s": slo_by_priority or {},
        "overall": summarize(records, duration_s, slo, slo_by_priority),
        "tenants": {t: summarize(by_tenant.get(t, []), duration_s, slo, slo_by_priority) for t in weights},
        "priorities": {p: summarize(rs, duration_s, slo, slo_by_priority) for p, rs in sorted(by_priority.items())},
        "fairness": fair,
        "images": image_ttft(records),
        "timeseries": time_series(records, weights, duration_s),
    }
