"""Whole runs against the stub: several tenants from a YAML scenario, bounds, determinism, the written reports."""

import asyncio
import csv
import json
import statistics
import time

import pytest
import yaml
from aiohttp.test_utils import TestServer

from loadgen.arrivals import ArrivalConfig, arrival_times
from loadgen.report import write_csv, write_run_json
from loadgen.report_html import run_report_html
from loadgen.runner import run_scenario
from loadgen.scenario import load_scenario, scenario_from_dict
from tests.loadgen.stub_server import Behaviour, StubState, make_app

SCENARIO = {
    "seed": 3,
    "slo": "ttft=200ms",
    "defaults": {"dataset": {"kind": "synthetic", "input_len": "uniform:4,12", "output_len": "5"}},
    "tenants": [
        {"name": "fast", "api_key": "fast", "priority": "realtime", "weight": 2, "arrival": "poisson", "rate": 40,
         "num_requests": 40},
        {"name": "closed", "api_key": "closed", "priority": "standard", "concurrency": 3, "num_requests": 12,
         "api": "chat"},
        {"name": "limited", "api_key": "limited", "priority": "standard", "arrival": "constant", "rate": 20,
         "num_requests": 5},
        {"name": "nightly", "api_key": "nightly", "priority": "batch", "batch": {"num_requests": 6, "poll_interval_s": 0.05},
         "dataset": {"output_len": "9"}},
    ],
}

BEHAVIOURS = {"fast": Behaviour(interval_s=0.005), "closed": Behaviour(first_token_s=0.05, interval_s=0.005),
              "limited": Behaviour(status=429, retry_after="3"), "nightly": Behaviour(batch_delay_s=0.3)}


def _run(scenario_dict: dict, behaviours: dict):
    state = StubState(dict(behaviours))

    async def go():
        async with TestServer(make_app(state), host="127.0.0.1") as server:
            scenario = scenario_from_dict(scenario_dict, base_url=str(server.make_url("/v1")))
            return await run_scenario(scenario)

    return asyncio.run(go()), state


def test_multi_tenant_scenario(tmp_path):
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    assert load_scenario(str(path), base_url="http://x/v1").tenants[1].arrival.concurrency == 3  # the YAML form loads

    result, state = _run(SCENARIO, BEHAVIOURS)
    a = result.analysis
    t = a["tenants"]
    assert (t["fast"]["requests"], t["closed"]["requests"], t["limited"]["requests"]) == (40, 12, 5)
    assert t["fast"]["ok"] == 40 and t["closed"]["ok"] == 12 and t["fast"]["completion_tokens"] == 200
    # The closed loop kept exactly 3 in flight; open-loop requests left on their timetable.
    assert state.key_max_in_flight["closed"] == 3
    fast = [r for r in result.records if r.tenant == "fast"]
    assert statistics.median(r.queue_s for r in fast) < 0.02
    expected = list(arrival_times(ArrivalConfig("poisson", 40.0), seed=3 * 1_000_003 + 0 * 17 + 2, limit=40))
    assert sorted(r.scheduled_s for r in fast) == pytest.approx(expected)
    # Quotas: every 429 and its Retry-After is counted.
    assert t["limited"]["http_429"] == 5 and t["limited"]["errors_by_status"] == {"429": 5}
    assert t["limited"]["retry_after_s"]["min"] == 3.0 and a["overall"]["http_429"] == 5
    # Priority classes group tenants; the batch job is timed.
    assert a["priorities"]["standard"]["requests"] == 17 and a["priorities"]["realtime"]["requests"] == 40
    (job,) = result.batch_jobs
    assert job["status"] == "completed" and job["completed_lines"] == 6 and job["completion_tokens"] == 54
    # The stub starts its 0.3 s when it creates the batch, which is after the job was submitted and before the
    # client's created_s (the response's way back): a loaded machine moves created_s later, never the finish earlier.
    assert 0.3 - (job["created_s"] - job["submitted_s"]) <= job["turnaround_s"] < 0.3 + 0.5
    # closed's TTFT is >= 50 ms by construction, fast's near 0: both meet the 200 ms SLO, limited never does.
    assert t["closed"]["latency_s"]["ttft"]["min"] >= 0.05 and t["fast"]["goodput_fraction"] == 1.0
    assert t["limited"]["goodput_fraction"] == 0.0
    f = a["fairness"]
    assert set(f["tenants"]) == {"fast", "closed", "limited"} and f["tenants"]["limited"]["served_tokens"] == 0
    assert 0 < f["jain_index"] < 1

    # Reports: JSON with every record, CSV with a row each, HTML with its plots and no external script.
    write_run_json(str(tmp_path / "r.json"), result)
    write_csv(str(tmp_path / "r.csv"), result.records)
    body = json.loads((tmp_path / "r.json").read_text())
    assert body["kind"] == "run" and len(body["records"]) == 57
    assert all(t_["api_key"] in (None, "<redacted>") for t_ in body["scenario"]["tenants"])
    assert "fast" not in (tmp_path / "r.json").read_text().split('"api_key"')[1][:20]
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert len(rows) == 57 and {r["tenant"] for r in rows} == {"fast", "closed", "limited"}
    html = run_report_html(body)
    assert "<script src" not in html and "Plotly.newPlot" in html and html.count("Plotly.newPlot") == 4
    assert "Fairness over time" in html and "Batch jobs" in html


def test_duration_bounds_the_run_and_seeds_fix_the_prompts():
    scenario = {"duration": 0.5, "seed": 11, "tenants": [
        {"name": "t", "api_key": "k", "rate": 60, "dataset": {"input_len": "uniform:3,30", "output_len": "2"}}]}
    start = time.monotonic()
    first, state1 = _run(scenario, {})
    assert time.monotonic() - start < 3
    expected = len(list(arrival_times(ArrivalConfig("poisson", 60.0), seed=11 * 1_000_003 + 2, duration_s=0.5)))
    assert len(first.records) == expected and 15 <= expected <= 45
    assert all(r.scheduled_s < 0.5 for r in first.records)
    _, state2 = _run(scenario, {})
    _, state3 = _run({**scenario, "seed": 12}, {})
    prompts = [sorted(b["prompt"] for _, b in s.bodies) for s in (state1, state2, state3)]
    assert prompts[0] == prompts[1] and prompts[0] != prompts[2]


def test_warmup_requests_are_sent_first_and_left_out():
    scenario = {"warmup": 2, "tenants": [{"name": "t", "api_key": "k", "rate": 100, "num_requests": 3,
                                          "dataset": {"input_len": 3, "output_len": 2}}]}
    result, state = _run(scenario, {"k": Behaviour(first_token_s=0.05)})
    assert state.seen["k"] == 5 and len(result.records) == 3 and result.analysis["overall"]["ok"] == 3
    assert all(r.index >= 0 and r.sent_s >= 0 for r in result.records)
    assert result.duration_s < 0.5  # the clock started after the warm-up (2 x 50 ms one at a time)


@pytest.mark.parametrize("change, message", [
    ({"tenants": []}, "tenants"),
    ({"tenants": [{"name": "a", "rate": 1}]}, "never stop"),
    ({"tenants": [{"name": "a", "rate": 1, "num_requests": 1, "colour": "red"}]}, "unknown keys"),
    ({"tenants": [{"name": "a", "rate": 1, "num_requests": 1}, {"name": "a", "rate": 1, "num_requests": 1}]}, "unique"),
    ({"tenants": [{"name": "a", "num_requests": 1, "dataset": {"kind": "synthetic", "size": 3}}]}, "dataset"),
    ({"tenants": [{"name": "a", "num_requests": 1, "api_key_env": "MOEGATE_TEST_NOT_SET"}]}, "not set"),
    ({"tenants": [{"name": "a", "num_requests": 1}], "slo": "ttft=fast"}, "duration"),
    ({"tenants": [{"name": "a", "num_requests": 1}], "warmup": -1}, "warmup"),
])
def test_bad_scenarios(change, message):
    with pytest.raises(ValueError, match=message):
        scenario_from_dict({"base_url": "http://127.0.0.1:1/v1", **change})


def test_progress_counters():
    from loadgen.progress import Counters

    c = Counters(window_s=5.0)
    c._start -= 2.0  # two seconds into the run
    c.sent = 5
    for ok in (True, True, False, True):
        c.finished(ok)
    assert (c.done, c.failed, c.in_flight) == (4, 1, 1)
    assert c.rate() == pytest.approx(4 / 2.0, rel=0.05)  # not 4 / 5: only 2 s have passed


def test_the_documented_scenario_loads(monkeypatch):
    import pathlib
    import re

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "loadgen.md").read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    for name in ("ACME_KEY", "GLOBEX_KEY", "CRAWLER_KEY", "NIGHTLY_KEY"):
        monkeypatch.setenv(name, "mg-test")
    scenario = scenario_from_dict(yaml.safe_load(block))
    assert [t.name for t in scenario.tenants] == ["acme", "globex", "crawler", "nightly"]
    assert scenario.tenants[2].arrival.concurrency == 16 and scenario.tenants[3].batch.num_requests == 500
    assert scenario.tenants[1].arrival.burstiness == 0.5 and scenario.tenants[0].options.ignore_eos
    assert scenario.slo == {"ttft": 1.0, "tpot": 0.1} and scenario.duration_s == 120 and scenario.warmup == 2
