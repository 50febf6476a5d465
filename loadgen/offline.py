"""Offline throughput: our engine vs transformers on one fixed workload, measured side by side.

The workload: N requests, prompt lengths uniform in [16, 512], output
lengths uniform in [8, 256] via max_tokens with EOS ignored, greedy, on a
random-weight Qwen3-MoE-shaped model (about 37M parameters), float32.
Each system gets the same requests; throughput is useful output tokens per
second of wall time (static batches pay for padding and for waiting on the
longest request of each batch: that is the point of the comparison).
"""

import json
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from loadgen.bench_model import BENCH_MODEL_CONFIG, BenchRequest, make_workload, write_bench_model

@dataclass(slots=True)
class BenchResult:
    system: str
    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run_moegate(path: str, reqs: list[BenchRequest], **engine_kwargs) -> BenchResult:
    from engine import LLM, SamplingParams

    llm = LLM(model=path, **{"dtype": "float32", "device": "cpu", **engine_kwargs})
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == sum(r.max_tokens for r in reqs), "every request must produce exactly max_tokens"
    return BenchResult("moegate", seconds, produced)


def _load_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def run_hf_static(path: str, reqs: list[BenchRequest], batch_size: int = 16) -> BenchResult:
    """transformers generate() in static batches (left-padded), each run to its longest request."""
    model = _load_hf(path)
    start = time.perf_counter()
    produced = 0
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt):] = 1
        longest = max(r.max_tokens for r in batch)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )
        assert out.shape[1] == width + longest
        produced += sum(r.max_tokens for r in batch)  # tokens past a request's max_tokens are waste
    return BenchResult(f"transformers generate (static batches of {batch_size})", time.perf_counter() - start, produced)


@torch.inference_mode()
def run_hf_continuous(path: str, reqs: list[BenchRequest]) -> BenchResult:
    """transformers' own continuous batching (the manager behind generate_batch), per-request max_new_tokens."""
    from transformers import GenerationConfig

    model = _load_hf(path)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(r.max_tokens for r in reqs))
    start = time.perf_counter()
    produced = 0
    with model.continuous_batching_context_manager(generation_config=gen, block=True, timeout=30, warmup=False) as manager:
        ids = [manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.max_tokens, eos_token_id=-1) for i, r in enumerate(reqs)]
        pending = set(ids)
        while pending:
            result = manager.get_result(timeout=60)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped early")
                continue
            if result.is_finished() and result.request_id in pending:
                pending.discard(result.request_id)
                produced += len(result.generated_tokens)
    return BenchResult("transformers generate_batch (continuous)", time.perf_counter() - start, produced)


SYSTEMS = ("moegate", "hf-static", "hf-continuous")


def run(num_requests: int, seed: int, systems: list[str], model_dir: str | None, engine_kwargs: dict,
        workload: str = "mixed") -> dict:
    tmp = None
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="moegate-bench-")
        model_dir = tmp.name
        num_params = write_bench_model(model_dir, seed)
    else:
        num_params = None
    if workload == "shared-prefix":
        from loadgen.shared_prefix import run_shared_prefix

        report = run_shared_prefix(model_dir, num_requests, seed, engine_kwargs)
        report["num_params"] = num_params
        if tmp is not None:
            tmp.cleanup()
        return report
    reqs = make_workload(num_requests, seed, BENCH_MODEL_CONFIG["vocab_size"])
    results = []
    for system in systems:
        if system == "moegate":
            results.append(run_moegate(model_dir, reqs, **engine_kwargs))
        elif system == "hf-static":
            results.append(run_hf_static(model_dir, reqs))
        elif system == "hf-continuous":
            results.append(run_hf_continuous(model_dir, reqs))
        r = results[-1]
        print(f"{r.system:45s} {r.output_tokens:7d} tokens {r.seconds:8.1f} s {r.tokens_per_s:9.1f} tok/s", flush=True)
    report = {
        "num_requests": num_requests, "seed": seed, "num_params": num_params, "torch_threads": torch.get_num_threads(),
        "engine_kwargs": engine_kwargs, "results": [dict(asdict(r), tokens_per_s=r.tokens_per_s) for r in results],
    }
    ours = next((r for r in results if r.system == "moegate"), None)
    baselines = [r for r in results if r.system != "moegate"]
    if ours and baselines:
        best = max(baselines, key=lambda r: r.tokens_per_s)
        report["ratio_vs_best_baseline"] = ours.tokens_per_s / best.tokens_per_s
        print(f"moegate / best baseline ({best.system}): {report['ratio_vs_best_baseline']:.2f}x")
    if tmp is not None:
        tmp.cleanup()
    return report


def register(subparsers) -> None:
    p = subparsers.add_parser("offline", help="offline throughput: moegate vs transformers on a fixed workload")
    p.add_argument("--workload", choices=["mixed", "shared-prefix"], default="mixed",
                   help="mixed: moegate vs transformers; shared-prefix: moegate with the prefix cache on vs off")
    p.add_argument("--num-requests", type=int, default=None, help="default 128 (mixed) or 256 (shared-prefix)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--model", default=None, help="checkpoint dir (default: build the random bench model)")
    p.add_argument("--random-weights", metavar="SPEC", default=None,
                   help="moegate alone on a RANDOM-weight model of a real shape, on the default device and dtype: a "
                        "preset (qwen3-30b-a3b, olmoe-1b-7b, ...) or a config.json path (see engine.loading.random_weights)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--json", action="store_true", help="print the report as JSON at the end")
    p.add_argument("--out", default=None, help="also write the report to this JSON file (loadgen's common format)")
    p.set_defaults(func=_main)


def _main(args) -> int:
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    num_requests = args.num_requests or (256 if args.workload == "shared-prefix" else 128)
    if unknown or num_requests < 1:
        raise ValueError(f"unknown systems {unknown}" if unknown else "--num-requests must be >= 1")
    engine_kwargs = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    model = args.model
    if args.random_weights:  # transformers needs a checkpoint: `python -m benchmarks.engine_gpu` compares them on a GPU
        from engine.loading.random_weights import random_model_config, served_name

        if args.workload != "mixed":
            raise ValueError("--random-weights runs the mixed workload")
        random_model_config(args.random_weights)  # a bad spec is a ValueError: one line, exit 2
        engine_kwargs.update(random_weights=args.random_weights, dtype="auto", device="auto")
        systems, model = ["moegate"], served_name(args.random_weights)
    report = run(num_requests, args.seed, systems, model, engine_kwargs, workload=args.workload)
    _print_summary(report)
    if args.out:
        from loadgen.report import write_json

        write_json(args.out, f"offline-{args.workload}", report)
        print(f"wrote {args.out}")
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _print_summary(report: dict) -> None:
    """The same table code as the online reports."""
    from loadgen.report import print_table

    rows = []
    for r in report["results"]:
        name = r.get("system") or r.get("mode")
        row = [name, r["output_tokens"], f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.1f}"]
        if "prefill_tokens" in r:
            row.append(r["prefill_tokens"])
        rows.append(row)
    columns = ["system", "output tokens", "seconds", "output tok/s"]
    if any("prefill_tokens" in r for r in report["results"]):
        columns.append("prefill tokens")
    print_table(f"Offline ({report.get('workload', 'mixed')}, {report['num_requests']} requests)", columns, rows)
