"""Per-class objectives in loadgen's reports: each record judged by its class's bounds (else the run's), goodput
and attainment per tenant and class against a plain loop over random records; the scenario key and the console."""

import io
import random

import pytest
from rich.console import Console

from loadgen.metrics import analyze
from loadgen.records import RequestRecord
from loadgen.report import summary_table
from loadgen.scenario import scenario_from_dict


def _record(i, rng) -> RequestRecord:
    ok = rng.random() < 0.8
    sent, ttft = rng.uniform(0, 5), rng.uniform(0.01, 1.0)
    itl = [rng.uniform(0.005, 0.1) for _ in range(rng.randrange(0, 6))]
    return RequestRecord(i, rng.choice(["a", "b"]), rng.choice(["realtime", "batch", "standard"]), scheduled_s=sent,
                         sent_s=sent, first_byte_s=sent + 0.001, first_token_s=sent + ttft if ok else None,
                         end_s=sent + ttft + sum(itl), itl_s=itl if ok else [], prompt_tokens=10,
                         completion_tokens=len(itl) + 1 if ok else 0, status=200 if ok else 503, ok=ok,
                         usage_source="usage", attempt_statuses=[200 if ok else 503])


def test_goodput_and_attainment_per_class_bounds():
    rng = random.Random()
    records = [_record(i, rng) for i in range(200)]
    run_slo = {"e2e": rng.uniform(0.3, 1.0)}
    by_class = {"realtime": {"ttft": rng.uniform(0.1, 0.5), "itl": rng.uniform(0.02, 0.08)},
                "batch": {"e2e": rng.uniform(0.5, 2.0)}}
    a = analyze(records, {"a": 1.0, "b": 1.0}, 5.0, run_slo, by_class)

    def good(r):  # the reference: the record's own class's bounds, else the run's
        if not r.ok:
            return False
        bounds = by_class.get(r.priority, run_slo)
        values = {"ttft": r.first_token_s - r.sent_s, "e2e": r.end_s - r.sent_s,
                  "itl": sum(r.itl_s) / len(r.itl_s) if r.itl_s else None}
        return all(values[k] is None or values[k] <= v for k, v in bounds.items())

    for groups, key in ((a["tenants"], lambda r: r.tenant), (a["priorities"], lambda r: r.priority)):
        for name, summary in groups.items():
            mine = [r for r in records if key(r) == name]
            met = [r for r in mine if good(r)]
            assert summary["attainment"] == pytest.approx(len(met) / len(mine))
            assert summary["goodput"] == pytest.approx(len(met) / 5.0)
            assert summary["goodput_tokens"] == sum(r.completion_tokens for r in met)
    out = io.StringIO()
    Console(file=out, width=300).print(summary_table("Requests", {"all": a["overall"]}, True))
    assert f"{100 * a['overall']['attainment']:.0f}%" in out.getvalue()


def test_scenario_reads_bounds_per_class():
    sc = scenario_from_dict({"base_url": "http://127.0.0.1:1/v1", "duration": 1,
                             "slo_by_priority": {"realtime": "ttft=500ms,itl=60ms"},
                             "tenants": [{"name": "a", "rate": 1}]})
    assert sc.slo_by_priority == {"realtime": {"ttft": 0.5, "itl": 0.06}}
    with pytest.raises(ValueError, match="unknown SLO"):
        scenario_from_dict({"base_url": "http://x/v1", "duration": 1, "slo_by_priority": {"rt": "fast=1ms"},
                            "tenants": [{"name": "a", "rate": 1}]})
