"""``compare-batching``: static vs dynamic vs continuous batching, same model, same Poisson workload, several rates.

The engine runs in-process (``engine.llm.LLM``). Arrivals follow wall-clock
Poisson timestamps: a request is added to the engine once its arrival time
has passed, then the engine steps; each request's first-token and finish
times are recorded as they happen. Latencies count from the arrival time, so
a request that arrives during a step waits for that step, as it would in a
server. The strategies (engine/core/config.py, ``batching``):

- ``static``: a batch starts when ``max_num_seqs`` requests wait (or the
  stream of arrivals has ended) and runs until its last request finishes.
- ``dynamic``: the same, but a batch also starts ``max_wait_ms`` after its
  oldest request arrived.
- ``continuous``: requests join and leave the running batch at every step.

Workload: prompt lengths uniform in [16, 1024], output lengths uniform in
[8, 512] times ``output_scale`` (EOS ignored, greedy); the same requests for
every strategy and rate. The prefix cache is off, so repeated prompts across
rates do not turn into cache hits. The records are the online runs'
``RequestRecord``s and go through the same summary code.
"""

import argparse
import json
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field

from loadgen.arrivals import ArrivalConfig, arrival_times
from loadgen.batch_gate import STRATEGIES, BatchGate
from loadgen.metrics import summarize
from loadgen.records import RequestRecord

# The offline bench model's layout, halved (2 layers, hidden 256): same family and expert routing,
# about 4x cheaper per token, so nine runs fit in a few minutes on a 2-core CPU.
COMPARE_MODEL_CONFIG = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, moe_intermediate_size=128, intermediate_size=512)


@dataclass(slots=True)
class CompareConfig:
    """One comparison: every strategy at every rate over the same requests."""

    rates: list[float] = field(default_factory=lambda: [2.0, 4.0, 8.0])
    num_requests: int = 48
    strategies: list[str] = field(default_factory=lambda: list(STRATEGIES))
    prompt_range: tuple[int, int] = (16, 1024)
    output_range: tuple[int, int] = (8, 512)
    output_scale: float = 0.25
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_wait_ms: float = 500.0
    seed: int = 0
    model: str | None = None  # a checkpoint dir; None builds the small random bench model
    # One torch thread: on a shared CPU, two OpenMP threads spin-wait whenever another process holds a core,
    # and a run slows down 10-20x at random (measured on the 2-core dev box); one thread only shares.
    threads: int = 1

    def __post_init__(self) -> None:
        if not self.rates or any(not r > 0 for r in self.rates):
            raise ValueError("--rates must be a list of rates > 0 (requests/s)")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise ValueError(f"unknown strategies {unknown}: use {','.join(STRATEGIES)}")
        if self.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        if not 0 < self.output_scale <= 1:
            raise ValueError("--output-scale must be in (0, 1]")
        if self.threads < 1:
            raise ValueError("--threads must be >= 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-seqs and --max-num-batched-tokens must be >= 1")

    @property
    def scaled_output_range(self) -> tuple[int, int]:
        lo, hi = self.output_range
        return max(1, round(lo * self.output_scale)), max(1, round(hi * self.output_scale))


def _kv_blocks(config: CompareConfig, block_size: int = 16) -> int:
    """Room for a full batch of the longest requests (the engine's 2 GB CPU default, times three engines, is waste)."""
    longest = config.prompt_range[1] + config.scaled_output_range[1]
    return config.max_num_seqs * -(-longest // block_size) + 16


def make_requests(config: CompareConfig, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, from the seed."""
    rng = random.Random(config.seed)
    lo, hi = config.scaled_output_range
    return [([rng.randrange(1, vocab - 1) for _ in range(rng.randint(*config.prompt_range))], rng.randint(lo, hi))
            for _ in range(config.num_requests)]


def drive(engine, strategy: str, batch_size: int, max_wait_ms: float, requests: list[tuple[list[int], int]],
          arrivals: list[float]) -> tuple[list[RequestRecord], float]:
    """Feed ``requests`` through a ``strategy`` gate into ``engine`` at wall-clock ``arrivals`` (seconds), step
    until all finish; returns the records and the seconds taken."""
    from engine import SamplingParams

    records = [RequestRecord(i, "bench", scheduled_s=t, sent_s=t, input_len=len(p), max_tokens=n,
                             prompt_tokens=len(p), usage_source="usage")
               for i, ((p, n), t) in enumerate(zip(requests, arrivals))]
    last_token: dict[int, float] = {}
    gate = BatchGate(engine, strategy, batch_size, max_wait_ms / 1e3)
    start = time.perf_counter()
    added = 0
    while added < len(requests) or gate.has_unfinished():
        now = time.perf_counter() - start
        while added < len(requests) and arrivals[added] <= now:
            prompt, n = requests[added]
            gate.submit(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), str(added))
            added += 1
        if added == len(requests):
            gate.close()  # static/dynamic batching may start a partial batch: nothing more will come
        outputs = gate.step()
        t = time.perf_counter() - start
        for out in outputs:
            if not out.token_ids:
                continue
            r = records[int(out.request_id)]
            i = int(out.request_id)
            if r.first_token_s is None:
                r.first_token_s = t
            else:
                r.itl_s.append(t - last_token[i])
            last_token[i] = t
            r.completion_tokens = out.num_output_tokens
            if out.finished:
                r.end_s, r.ok, r.status, r.finish_reason = t, True, 200, out.finish_reason
        if not outputs and added < len(requests):
            # Nothing ran (idle, or a batch still filling): sleep until the next arrival, in short naps so a
            # dynamic batch's deadline is not overslept.
            time.sleep(max(0.0, min(arrivals[added] - (time.perf_counter() - start), 0.005)))
    return records, time.perf_counter() - start


def run_compare(config: CompareConfig, echo=print) -> dict:
    """Every strategy at every rate; returns the report body (rows plus each run's summary)."""
    import torch

    from engine import LLM, SamplingParams
    from loadgen.bench_model import BENCH_MODEL_CONFIG

    threads_before = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    tmp = None
    model = config.model
    try:
        if model is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            tmp = tempfile.TemporaryDirectory(prefix="moegate-compare-")
            model = tmp.name
            hf_config = AutoConfig.for_model("qwen3_moe", **{**BENCH_MODEL_CONFIG, **COMPARE_MODEL_CONFIG})
            torch.manual_seed(config.seed)
            AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).save_pretrained(model)
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            vocab = json.load(f)["vocab_size"]
        requests = make_requests(config, vocab)
        engines = {}
        for strategy in config.strategies:
            llm = LLM(model=model, dtype="float32", device="cpu", max_num_seqs=config.max_num_seqs,
                      max_num_batched_tokens=config.max_num_batched_tokens,
                      enable_prefix_caching=False, seed=config.seed, num_kv_blocks=_kv_blocks(config))
            llm.generate([requests[0][0]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up, not timed
            engines[strategy] = llm.engine
        runs = []
        # Strategies take turns at each rate, so a slow spell of a shared machine does not land on one of them.
        for rate in config.rates:
            arrivals = list(arrival_times(ArrivalConfig("poisson", rate), config.seed, len(requests)))
            for strategy, engine in engines.items():
                cpu = time.process_time()
                records, seconds = drive(engine, strategy, config.max_num_seqs, config.max_wait_ms, requests, arrivals)
                cpu = time.process_time() - cpu
                assert all(r.ok and r.completion_tokens == n for r, (_, n) in zip(records, requests))
                runs.append({"strategy": strategy, "rate": rate, "seconds": seconds, "cpu_seconds": cpu,
                             "summary": summarize(records, seconds), "records": [r.to_dict() for r in records]})
                echo(_line(runs[-1]))
    finally:
        torch.set_num_threads(threads_before)  # a caller in the same process (a test run) keeps its setting
        if tmp is not None:
            tmp.cleanup()
    return {"config": asdict(config), "output_range_used": config.scaled_output_range, "runs": runs}


def _line(run: dict) -> str:
    s = run["summary"]
    lat = s["latency_s"]
    return (f"{run['strategy']:10s} rate {run['rate']:5.2f}/s: {s['request_throughput']:6.2f} req/s "
            f"{s['output_token_throughput']:8.1f} tok/s  e2e p50 {lat['e2e']['p50']:6.2f} s  p99 {lat['e2e']['p99']:6.2f} s"
            f"  ({run['seconds']:.1f} s)")


# "CPU s": this process's CPU time during the run. On a shared machine it shows contention: a run whose CPU
# time is far below (wall s x busy fraction) waited for cores that other processes held.
TABLE_COLUMNS = ["strategy", "offered req/s", "achieved req/s", "output tok/s", "TTFT p50 s", "TTFT p99 s",
                 "E2E p50 s", "E2E p99 s", "wall s", "CPU s"]


def table_rows(body: dict) -> list[list]:
    rows = []
    for run in sorted(body["runs"], key=lambda r: (r["rate"], STRATEGIES.index(r["strategy"]))):
        s = run["summary"]
        lat = s["latency_s"]
        rows.append([run["strategy"], f"{run['rate']:g}", f"{s['request_throughput']:.2f}",
                     f"{s['output_token_throughput']:.1f}", f"{lat['ttft']['p50']:.2f}", f"{lat['ttft']['p99']:.2f}",
                     f"{lat['e2e']['p50']:.2f}", f"{lat['e2e']['p99']:.2f}", f"{run['seconds']:.1f}",
                     f"{run['cpu_seconds']:.1f}"])
    return rows


def compare_html(body: dict) -> str:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from loadgen.report_html import PALETTE, lines_page

    fig = make_subplots(rows=2, cols=2, subplot_titles=("Requests/s", "Output tokens/s", "E2E latency p50 (s)",
                                                        "E2E latency p99 (s)"), vertical_spacing=0.14)
    for i, strategy in enumerate(s for s in STRATEGIES if any(r["strategy"] == s for r in body["runs"])):
        runs = sorted((r for r in body["runs"] if r["strategy"] == strategy), key=lambda r: r["rate"])
        x = [r["rate"] for r in runs]
        series = [[r["summary"]["request_throughput"] for r in runs], [r["summary"]["output_token_throughput"] for r in runs],
                  [r["summary"]["latency_s"]["e2e"]["p50"] for r in runs], [r["summary"]["latency_s"]["e2e"]["p99"] for r in runs]]
        for j, ys in enumerate(series):
            fig.add_trace(go.Scatter(x=x, y=ys, name=strategy, legendgroup=strategy, showlegend=j == 0,
                                     mode="lines+markers", line=dict(color=PALETTE[i], width=2)),
                          row=j // 2 + 1, col=j % 2 + 1)
    fig.update_xaxes(title_text="offered requests/s (Poisson)")
    fig.update_yaxes(rangemode="tozero")
    cfg = body["config"]
    lo, hi = body["output_range_used"]
    intro = [f"{cfg['num_requests']} requests per run; prompts {cfg['prompt_range'][0]}-{cfg['prompt_range'][1]} tokens; "
             f"outputs {lo}-{hi} tokens (the 8-512 range scaled by {cfg['output_scale']:g}); "
             f"max_num_seqs {cfg['max_num_seqs']}, max_num_batched_tokens {cfg['max_num_batched_tokens']}, "
             f"dynamic max_wait_ms {cfg['max_wait_ms']:g}; torch threads {cfg['threads']}; seed {cfg['seed']}."]
    return lines_page("moegate loadgen compare-batching", intro, TABLE_COLUMNS, table_rows(body),
                      [("Throughput and latency per strategy", fig, 720)])


def register(subparsers) -> None:
    p = subparsers.add_parser("compare-batching", help="static vs dynamic vs continuous batching on one Poisson workload")
    p.add_argument("--rates", default="2,4,8", help="Poisson arrival rates, requests/s (default 2,4,8)")
    p.add_argument("--num-requests", type=int, default=48, help="requests per run (default 48)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--output-scale", type=float, default=0.25,
                   help="multiply the 8-512 output lengths by this (default 0.25: 2-128, to fit a small CPU)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="also the static/dynamic batch size (default 8)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-wait-ms", type=float, default=500.0, help="dynamic batching's wait for a fuller batch")
    p.add_argument("--model", default=None, help="checkpoint dir (default: a small random Qwen3-MoE bench model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady on a shared CPU)")
    p.add_argument("--out", default=None, help="directory for compare-batching.json and compare-batching.html")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from loadgen.report import markdown_table, print_table, write_json

    try:
        rates = [float(x) for x in args.rates.split(",") if x]
    except ValueError:
        raise ValueError(f"--rates must be comma-separated numbers, got {args.rates!r}") from None
    config = CompareConfig(rates=rates, num_requests=args.num_requests,
                           strategies=[s for s in args.strategies.split(",") if s], output_scale=args.output_scale,
                           max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           max_wait_ms=args.max_wait_ms, seed=args.seed, model=args.model, threads=args.threads)
    lo, hi = config.scaled_output_range
    if config.output_scale != 1:
        print(f"note: output lengths scaled by {config.output_scale:g}: {lo}-{hi} tokens instead of "
              f"{config.output_range[0]}-{config.output_range[1]} (--output-scale 1 for the full range)")
    body = run_compare(config, echo=lambda line: print(line, flush=True))
    print_table("Batching strategies (same requests, Poisson arrivals)", TABLE_COLUMNS, table_rows(body))
    if args.markdown:
        print(markdown_table(TABLE_COLUMNS, table_rows(body)))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_json(os.path.join(args.out, "compare-batching.json"), "compare-batching", body)
        with open(os.path.join(args.out, "compare-batching.html"), "w", encoding="utf-8") as f:
            f.write(compare_html(body))
        print(f"wrote {args.out}/compare-batching.json, compare-batching.html")
    return 0
