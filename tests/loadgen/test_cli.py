"""`moegate loadgen ...` end to end against the stub, and bad input as one line with exit code 2."""

import json
import subprocess
import sys

import pytest
import yaml

from gateway.cli import main
from loadgen.offline import _print_summary
from tests.loadgen.stub_server import Behaviour, StubState, StubThread


@pytest.fixture(scope="module")
def stub():
    state = StubState({"k": Behaviour(first_token_s=0.01, interval_s=0.002)})
    with StubThread(state) as server:
        yield server


def test_run_writes_every_report(stub, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["loadgen", "run", "--base-url", stub.base_url, "--api-key", "k", "--rate", "100", "--num-requests", "12",
               "--input-len", "uniform:4,8", "--output-len", "6", "--slo", "ttft=1s", "--out", str(out),
               "--no-progress", "--seed", "5"])
    text = capsys.readouterr().out
    assert rc == 0 and "Requests" in text and "12 / 12" in text and "goodput" in text and "(seed 5)" in text
    body = json.loads((out / "results.json").read_text())
    assert body["analysis"]["overall"]["ok"] == 12 and len(body["records"]) == 12
    assert body["analysis"]["overall"]["completion_tokens"] == 72
    assert len((out / "results.csv").read_text().strip().splitlines()) == 13
    assert "Plotly.newPlot" in (out / "report.html").read_text()
    # `report` rebuilds the page from the JSON alone.
    assert main(["loadgen", "report", str(out / "results.json"), "-o", str(tmp_path / "again.html")]) == 0
    assert "moegate loadgen report" in (tmp_path / "again.html").read_text()


def test_run_json_and_scenario_file(stub, tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"tenants": [
        {"name": "a", "api_key": "k", "concurrency": 2, "num_requests": 4, "dataset": {"input_len": 4, "output_len": 3}},
        {"name": "b", "api_key": "k", "rate": 50, "num_requests": 3, "weight": 3, "dataset": {"input_len": 4, "output_len": 3}},
    ]}))
    rc = main(["loadgen", "run", "--scenario", str(path), "--base-url", stub.base_url, "--json"])
    analysis = json.loads(capsys.readouterr().out)
    assert rc == 0 and analysis["tenants"]["a"]["ok"] == 4 and analysis["tenants"]["b"]["ok"] == 3
    assert analysis["fairness"]["tenants"]["b"]["weight_share"] == pytest.approx(0.75)


def test_sweep_finds_saturation_then_rates_below(stub, tmp_path, capsys):
    rc = main(["loadgen", "sweep", "--base-url", stub.base_url, "--api-key", "k", "--num-requests", "6",
               "--input-len", "4", "--output-len", "3", "--sweep-points", "2", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    steps = json.loads((tmp_path / "sweep.json").read_text())["steps"]
    assert [s["label"] for s in steps][0] == "saturation" and len(steps) == 3
    saturation = steps[0]["analysis"]["overall"]["request_throughput"]
    assert [s["offered_rate"] for s in steps[1:]] == pytest.approx([saturation / 3, 2 * saturation / 3])
    assert all(s["analysis"]["overall"]["ok"] == 6 for s in steps)
    assert "Plotly.newPlot" in (tmp_path / "sweep.html").read_text()


@pytest.mark.parametrize("argv, message", [
    (["run", "--base-url", "http://127.0.0.1:1/v1"], "--rate"),
    (["run", "--rate", "1"], "--base-url"),
    (["run", "--base-url", "http://x/v1", "--rate", "1", "--input-len", "uniform:9"], "length distribution"),
    (["run", "--base-url", "http://x/v1", "--rate", "1", "--slo", "ttft=soon"], "duration"),
    (["run", "--base-url", "http://x/v1", "--rate", "-2"], "rate"),
    (["run", "--base-url", "http://x/v1", "--rate", "2", "--concurrency", "3"], "closed loop"),
    (["run", "--scenario", "missing.yaml"], "cannot read"),
    (["run", "--scenario", "x.yaml", "--rate", "3"], "--rate"),
    (["run", "--base-url", "http://x/v1", "--dataset", "sharegpt", "--rate", "1"], "sharegpt"),
    (["sweep", "--base-url", "http://x/v1", "--rate", "3"], "sweep chooses"),
    (["compare-batching", "--rates", "1,fast"], "--rates"),
    (["compare-batching", "--strategies", "static,magic"], "unknown strategies"),
    (["compare-batching", "--output-scale", "0"], "--output-scale"),
    (["report", "nothing.json"], "cannot read"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    rc = main(["loadgen", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_usage_errors_through_the_console_script():
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "loadgen", "run", "--rate", "x"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--rate" in r.stderr


def test_offline_uses_the_report_code(tmp_path, capsys):
    from loadgen.report import write_json

    report = {"num_requests": 2, "results": [{"system": "moegate", "seconds": 2.0, "output_tokens": 50, "tokens_per_s": 25.0}]}
    _print_summary(report)
    assert "moegate" in capsys.readouterr().out
    write_json(str(tmp_path / "o.json"), "offline-mixed", report)
    body = json.loads((tmp_path / "o.json").read_text())
    assert body["kind"] == "offline-mixed" and body["results"][0]["tokens_per_s"] == 25.0 and body["machine"]["cpus"]
