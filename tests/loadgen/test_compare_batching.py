"""compare-batching's driver: wall-clock arrivals into the in-process engine, per-request first-token/finish times."""

import pytest

from engine import LLM, SamplingParams
from loadgen.compare_batching import CompareConfig, compare_html, drive, run_compare, table_rows


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    # Two OpenMP threads stall for long spells when another process holds a core of a shared CPU.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _engine(model_dir: str, max_num_seqs: int = 3):
    llm = LLM(model=model_dir, max_num_seqs=max_num_seqs, max_num_batched_tokens=256, num_kv_blocks=128,
              enable_prefix_caching=False)
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_tokens=3))  # first forwards are slow: not timed
    return llm.engine


REQUESTS = [([5 + i, 6, 7, 8, 9, 10, 11, 12], 10) for i in range(5)]


def _check_records(records, arrivals):
    for r, (_, n), t in zip(records, REQUESTS, arrivals):
        assert r.ok and r.completion_tokens == n and r.scheduled_s == t
        assert t <= r.first_token_s <= r.end_s
        assert len(r.itl_s) == n - 1  # one token per step per running request


def test_static_batches_wait_to_fill_and_run_to_their_end(demo_model_dir):
    arrivals = [0.0, 0.05, 0.1, 0.15, 0.2]
    records, _ = drive(_engine(demo_model_dir), "static", 3, 50.0, REQUESTS, arrivals)
    _check_records(records, arrivals)
    # The first batch starts once 3 requests wait; the last two start only after that batch has ended.
    assert min(r.first_token_s for r in records[:3]) >= 0.1
    assert min(r.first_token_s for r in records[3:]) >= max(r.end_s for r in records[:3])


def test_continuous_admits_mid_batch(demo_model_dir):
    # A long request runs; a short one arriving just after it joins the running batch and finishes first.
    requests = [([5, 6, 7, 8, 9, 10, 11, 12], 300), ([9, 8, 7, 6, 5, 4, 3, 2], 5)]
    arrivals = [0.0, 0.02]
    (long, short), _ = drive(_engine(demo_model_dir, max_num_seqs=8), "continuous", 8, 50.0, requests, arrivals)
    assert long.completion_tokens == 300 and short.completion_tokens == 5
    assert long.first_token_s < short.first_token_s < short.end_s < long.end_s


def test_dynamic_starts_a_partial_batch_after_max_wait(demo_model_dir):
    arrivals = [0.0, 1.0, 2.0]
    dynamic, _ = drive(_engine(demo_model_dir), "dynamic", 3, 50.0, REQUESTS[:3], arrivals)
    static, _ = drive(_engine(demo_model_dir), "static", 3, 50.0, REQUESTS[:3], arrivals)
    assert 0.05 <= dynamic[0].first_token_s < 1.0  # started alone, max_wait_ms (50) after it arrived
    assert static[0].first_token_s >= 2.0  # static waited for the last arrival (the drain)


def test_run_compare_report(demo_model_dir):
    config = CompareConfig(rates=[40.0], num_requests=4, prompt_range=(4, 16), output_range=(2, 4),
                           output_scale=1.0, max_num_seqs=2, max_num_batched_tokens=64, model=demo_model_dir)
    body = run_compare(config, echo=lambda line: None)
    assert len(body["runs"]) == 3 and {r["strategy"] for r in body["runs"]} == {"static", "dynamic", "continuous"}
    for run in body["runs"]:
        s = run["summary"]
        assert s["ok"] == 4 and 8 <= s["completion_tokens"] <= 16
        assert s["request_throughput"] == pytest.approx(4 / run["seconds"])
    rows = table_rows(body)
    assert [r[0] for r in rows] == ["static", "dynamic", "continuous"] and {r[1] for r in rows} == {"40"}
    assert "Plotly.newPlot" in compare_html(body)
