"""Metrics against numpy and against hand computations."""

import random

import numpy as np
import pytest

from loadgen.metrics import analyze, describe, fairness, jain_index, meets_slo, percentile, summarize, time_series
from loadgen.records import RequestRecord, csv_row
from loadgen.scenario import parse_duration, parse_slo


def make_record(index=0, tenant="a", sent=0.0, ttft=0.1, itl=(0.02, 0.02), prompt=10, status=200, ok=True,
                priority=None, **kw) -> RequestRecord:
    """A finished streamed request: first token at sent+ttft, then one chunk per ITL."""
    first = sent + ttft
    return RequestRecord(index, tenant, priority, scheduled_s=sent, sent_s=sent, first_byte_s=sent + 0.01,
                         first_token_s=first, end_s=first + sum(itl), itl_s=list(itl), prompt_tokens=prompt,
                         completion_tokens=len(itl) + 1, status=status, ok=ok, usage_source="usage",
                         attempt_statuses=[status], **kw)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentiles_match_numpy(n):
    rng = random.Random(n)
    xs = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)
    d = describe(xs)
    assert d["mean"] == pytest.approx(np.mean(xs)) and d["max"] == max(xs) and d["count"] == n
    assert d["p99"] == pytest.approx(np.percentile(xs, 99))
    assert describe([]) is None


def test_jain_index_by_hand():
    assert jain_index([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain_index([1, 2, 3]) == pytest.approx(36 / (3 * 14))  # (1+2+3)^2 / (3 * (1+4+9))
    assert jain_index([]) is None and jain_index([0, 0]) is None


def test_fairness_weighs_shares():
    # a (weight 3) served 30+10 = 40 tokens per request x 3 = 120 tokens; b (weight 1) 40; c (weight 1) 40.
    recs = [make_record(i, "a", prompt=30, itl=[0.01] * 9) for i in range(3)]
    recs += [make_record(3, "b", prompt=30, itl=[0.01] * 9), make_record(4, "c", prompt=30, itl=[0.01] * 9)]
    f = fairness(recs, {"a": 3, "b": 1, "c": 1})
    assert f["tenants"]["a"]["served_tokens"] == 120 and f["tenants"]["a"]["share"] == pytest.approx(0.6)
    assert all(v["normalized_share"] == pytest.approx(1.0) for v in f["tenants"].values())
    assert f["jain_index"] == pytest.approx(1.0)
    # Equal weights, same service split 3:1:1 -> normalised shares 1.8, 0.6, 0.6.
    g = fairness(recs, {"a": 1, "b": 1, "c": 1})
    assert g["jain_index"] == pytest.approx(3.0 ** 2 / (3 * (1.8 ** 2 + 0.6 ** 2 + 0.6 ** 2)))
    # A failed request serves nothing; a tenant that sent nothing is left out.
    h = fairness(recs + [make_record(5, "b", status=500, ok=False)], {"a": 3, "b": 1, "c": 1, "idle": 1})
    assert "idle" not in h["tenants"] and h["tenants"]["b"]["served_tokens"] == 40


def test_summary_numbers():
    recs = [make_record(0, sent=0.0, ttft=0.1, itl=[0.02, 0.04]),  # e2e 0.16, tpot 0.03
            make_record(1, sent=1.0, ttft=0.3, itl=[0.05, 0.05]),  # e2e 0.40, tpot 0.05
            make_record(2, sent=2.0, status=429, ok=False, retry_after_s=[2.0]),
            RequestRecord(3, "a", scheduled_s=2.5, sent_s=2.5, end_s=2.6, status=0, error="refused")]
    recs[2].first_token_s = None
    s = summarize(recs, duration_s=4.0, slo={"ttft": 0.2})
    assert s["requests"] == 4 and s["ok"] == 2 and s["failed"] == 2
    assert s["errors_by_status"] == {"429": 1, "no response": 1} and s["http_429"] == 1
    assert s["request_throughput"] == pytest.approx(0.5) and s["output_token_throughput"] == pytest.approx(6 / 4)
    lat = s["latency_s"]
    assert lat["ttft"]["mean"] == pytest.approx(0.2) and lat["ttft"]["max"] == pytest.approx(0.3)
    assert lat["e2e"]["p50"] == pytest.approx((0.16 + 0.40) / 2)
    assert lat["tpot"]["p50"] == pytest.approx(0.04)
    assert lat["itl"]["count"] == 4 and lat["itl"]["p50"] == pytest.approx(0.045)
    assert s["retry_after_s"]["max"] == 2.0
    assert s["goodput"] == pytest.approx(1 / 4) and s["goodput_fraction"] == pytest.approx(1 / 4)  # only the first
    assert meets_slo(recs[1], {"tpot": 0.0501}) and not meets_slo(recs[1], {"tpot": 0.0499})
    assert meets_slo(recs[0], {"itl": 0.03}) and not meets_slo(recs[0], {"e2e": 0.15})
    assert not meets_slo(recs[2], {})


def test_time_series_in_flight_and_throughput():
    # a in flight over [0, 1.0] (first token 0.5), b over [0.5, 1.5] (first token 1.0); windows of 0.25 s.
    recs = [make_record(0, sent=0.0, ttft=0.5, itl=[0.25, 0.25]), make_record(1, "b", sent=0.5, ttft=0.5, itl=[0.5])]
    ts = time_series(recs, {"a": 1, "b": 1}, duration_s=2.0, num_bins=8)
    assert ts["in_flight"] == [1, 2, 2, 1, 1, 0, 0, 0]  # sampled at each window's end, end excluded
    assert ts["waiting"] == [1, 1, 1, 0, 0, 0, 0, 0]
    # a's 3 tokens spread over [0.5, 1.0] -> 6 tok/s there; b's 2 over [1.0, 1.5] -> 4 tok/s.
    assert ts["output_tok_s"] == pytest.approx([0, 0, 6, 6, 4, 4, 0, 0])
    assert sum(x * ts["bin_s"] for x in ts["output_tok_s"]) == pytest.approx(5)
    assert ts["jain"][0] is None  # only a in flight


def test_analyze_groups_by_tenant_and_priority():
    recs = [make_record(0, "a", priority="realtime"), make_record(1, "b", priority="batch"),
            make_record(2, "c", priority="batch", itl=[0.01] * 5)]
    a = analyze(recs, {"a": 1, "b": 1, "c": 1}, 1.0)
    assert set(a["tenants"]) == {"a", "b", "c"} and set(a["priorities"]) == {"realtime", "batch"}
    assert a["priorities"]["batch"]["requests"] == 2
    served_b, served_c = 13, 16  # prompt 10 + 3 completion tokens; prompt 10 + 6
    assert a["fairness"]["by_priority"]["batch"] == pytest.approx(jain_index([served_b / 29 * 2, served_c / 29 * 2]))


def test_csv_row_and_round_trip():
    r = make_record(retry_after_s=[1.0, 2.5])
    row = csv_row(r)
    assert row["ttft_s"] == pytest.approx(0.1) and row["itl_mean_s"] == pytest.approx(0.02) and row["retry_after_s"] == "1;2.5"
    assert RequestRecord.from_dict(r.to_dict()) == r


def test_slo_and_duration_parsing():
    assert parse_slo("ttft=500ms,tpot=50ms") == {"ttft": 0.5, "tpot": 0.05}
    assert parse_slo({"e2e": "2s"}) == {"e2e": 2.0}
    assert parse_duration("2m") == 120 and parse_duration("1.5") == 1.5
    for bad in ("ttft", "latency=5ms", "ttft=fast", "ttft=0"):
        with pytest.raises(ValueError):
            parse_slo(bad)
