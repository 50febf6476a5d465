"""Engine speed on one GPU against its floors and against transformers: ``python -m benchmarks.engine_gpu``.

One command, one process, a table at the end (``--json PATH`` also writes every number):

1. measured peaks: a big device copy (GB/s) and a big bf16 matmul (TFLOP/s);
2. decode: C concurrent requests (C in 1, 8, 32, 128, 256), each step timed;
   tokens/s = C / median step time; the floor is (dense weights + experts
   actually hit + KV read) / bandwidth, or FLOPs / peak if larger
   (``benchmarks.roofline``); every step checked against 2x the median;
3. prefill: one prompt of 512 and of 8192 tokens in one step each;
4. the same end-to-end workload (R requests, fixed prompt and output lengths)
   through moegate and through transformers on the same GPU: ``generate`` with
   one static batch and ``generate_batch`` (its continuous batching); the ratio.

The model is a real-size preset with RANDOM weights (``engine.loading.random_weights``,
default qwen3-30b-a3b, bf16), built directly on the GPU: nothing is downloaded.
Our engine runs with its defaults on CUDA (Triton attention and MoE, decode
CUDA graphs) and is freed before transformers builds its copy.

``--smoke`` runs the same code on the CPU with a tiny model, float32 and the
Triton interpreter (numbers meaningless; it proves the script runs, in CI).
Without CUDA and without ``--smoke`` it exits 2 with one line.
"""

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace

import torch

# The Qwen3-30B-A3B preset shrunk to CPU size (the interpreter pays per program, and most kernels run one per token
# and head or expert: top-2 of 4 experts, 2 query heads on 1 KV head).
SMOKE_SPEC = ("qwen3-30b-a3b:num_hidden_layers=2,hidden_size=64,intermediate_size=96,moe_intermediate_size=32,"
              "num_experts=4,num_experts_per_tok=2,num_attention_heads=2,num_key_value_heads=1,head_dim=16,"
              "vocab_size=256,bos_token_id=null,eos_token_id=255,max_position_embeddings=512")


@dataclass(frozen=True, slots=True)
class Profile:
    spec: str  # random-weights spec (engine.loading.random_weights)
    dtype: str
    concurrency: tuple[int, ...]
    decode_prompt_len: int
    decode_warmup_steps: int
    decode_steps: int
    prefill_lens: tuple[int, ...]
    prefill_reps: int
    e2e_requests: int  # the workload compared with transformers
    e2e_prompt_len: int
    e2e_output_len: int
    peak_matmul_n: int
    copy_bytes: int
    peak_reps: int
    profile_concurrency: int = 0  # profile one decode step at this concurrency (0: none)


GPU = Profile("qwen3-30b-a3b", "bfloat16", (1, 8, 32, 128, 256), 256, 4, 24, (512, 8192), 5, 128, 128, 64,
              8192, 2 << 30, 20)
# Every row of the GPU run, each with few tokens: the interpreter's time goes with its programs, one per token and
# head in most kernels, and in the MoE kernels one per routed slot up to 8 tokens (the untuned launch config sorts
# slots by expert from 9 tokens on: a block per expert). So the prompts the steps carry whole (the prefill rows, the
# 2 x 5 decode prompts, the 3 x 4 end-to-end ones) are 10 to 12 tokens.
SMOKE = Profile(SMOKE_SPEC, "float32", (1, 2), 5, 1, 2, (10, 12), 1, 3, 4, 3, 128, 4 << 20, 2)


def _log(msg: str) -> None:
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peaks(profile: Profile, device: torch.device) -> dict:
    from benchmarks.moe_backends import Profile as KernelProfile, measure_peaks as kernel_peaks

    p = KernelProfile((), (), profile.peak_reps, 2, profile.peak_matmul_n, profile.copy_bytes, 0)
    tflops, gbps = kernel_peaks(p, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    return {"peak_tflops": tflops, "bandwidth_gbps": gbps}


def build_engine(profile: Profile, device: torch.device, elementwise: str = "triton", dense_gemv: str = "measure",
                 **overrides):
    """The engine under test: every part in Triton (interpreted on the CPU), except what the arguments change
    to compare (``elementwise="torch"``: unfused norms/RoPE/routing; ``dense_gemv="off"``: F.linear only)."""
    from engine.core.config import EngineConfig, KernelChoice
    from engine.llm_engine import LLMEngine

    max_len = max(max(profile.prefill_lens), profile.decode_prompt_len + profile.decode_warmup_steps + profile.decode_steps + 8,
                  profile.e2e_prompt_len + profile.e2e_output_len) + 16
    kwargs = dict(
        model=f"random:{profile.spec.split(':')[0]}", random_weights=profile.spec, dtype=profile.dtype, device=device.type,
        max_num_seqs=max(max(profile.concurrency), profile.e2e_requests),
        max_num_batched_tokens=max(profile.prefill_lens), max_model_len=max_len, enable_prefix_caching=False,
    )
    if device.type == "cpu":  # the smoke run: the GPU code path, interpreted
        kwargs.update(num_kv_blocks=256)
        dense_gemv = "off" if dense_gemv == "measure" else dense_gemv  # no device timers to measure with
    kwargs.update(overrides)
    return LLMEngine(EngineConfig(**kwargs), KernelChoice("triton", elementwise, "triton", dense_gemv))


def _random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab - 1) for _ in range(length)]


def _params(max_tokens: int):
    from engine.core.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _timed_step(engine, alone: bool = False) -> float:
    """Seconds of one ``engine.step()``. With overlapped scheduling (the default on CUDA) a step queues its own
    work and returns after reading the previous step's tokens, so in a run of like steps (decode) the time
    between returns is the step time. ``alone``: the time of this step's own work, whatever ran before it
    (a prefill, a mixed step): the device is drained before, and waited for after."""
    if alone:
        _sync(engine.device)
    start = time.perf_counter()
    engine.step()
    if alone:
        _sync(engine.device)
    return time.perf_counter() - start


@contextlib.contextmanager
def _eager(engine):
    """Steps inside run every kernel from Python: the decode and the piecewise CUDA graphs set aside."""
    runner = engine.runner
    saved = runner.decode_graphs, runner.piecewise_graphs
    runner.set_graphs(None, None)
    try:
        yield
    finally:
        runner.set_graphs(*saved)


def _count_syncs(engine) -> int:
    """Host syncs in one whole eager step (scheduler, batch, forward, sampling; CUDA only, else 0).

    One is expected: the sampler reading the tokens. (Every EXPERT_LOAD_EVERY_CUDA-th step adds the
    expert-load read.) Eager because a graph replay launches nothing that could sync.
    """
    if engine.device.type != "cuda":
        return 0
    _sync(engine.device)
    with warnings.catch_warnings(record=True) as caught, _eager(engine):
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _experts_hit(engine) -> int:
    """Run one step eagerly with router hooks; experts hit summed over MoE layers."""
    from benchmarks.roofline import ExpertHits

    with _eager(engine), ExpertHits(engine.model) as hits:  # a replay runs no hooks
        engine.step()
    return hits.total()


def profile_step(engine, rows: int = 25) -> str:
    """Kernel-level profile of one eager step and of one graph-replayed step (CUDA only).

    The eager table says which kernels a step launches and how long each runs;
    the replay's kernel count and busy time against the step's wall time show
    how much of a small decode step is gaps between kernels.
    """
    from torch.profiler import ProfilerActivity, profile

    report = []
    for label, use_graphs in (("eager", False), ("graph replay", True)):
        with contextlib.nullcontext() if use_graphs else _eager(engine):
            engine.step()  # warm: the eager path may compile kernel variants the graphs did not need
            _sync(engine.device)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                seconds = _timed_step(engine, alone=True)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_ms = sum(e.device_time for e in kernels) / 1e3
        report.append(f"--- {label} step: {len(kernels)} kernels, {busy_ms:.2f} ms busy, {seconds * 1e3:.2f} ms wall")
        if not use_graphs:
            report.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows))
    return "\n".join(report)


def profile_decode(engine, profile: Profile, rng: random.Random) -> str:
    """``profile_step`` at ``profile.profile_concurrency`` decoding requests.

    Run last, after everything timed: the profiler's own overhead and the
    eager steps it runs should not land in any measured number.
    """
    conc, vocab = profile.profile_concurrency, engine.model_config.vocab_size
    ids = [engine.add_request(_random_prompt(rng, profile.decode_prompt_len, vocab), _params(64)) for _ in range(conc)]
    while (s := engine.stats()).step_prefill_tokens or s.num_running < conc:
        engine.step()
    text = profile_step(engine)
    for request_id in ids:
        engine.abort(request_id)
    return text


def num_moe_layers(engine) -> int:
    from engine.layers.moe import SparseMoeBlock

    return sum(isinstance(m, SparseMoeBlock) for m in engine.model.modules())


def bench_decode(engine, profile: Profile, peaks: dict, costs, rng: random.Random) -> list[dict]:
    from benchmarks.roofline import step_floor

    rows = []
    vocab = engine.model_config.vocab_size
    for conc in profile.concurrency:
        # Requests whose prefill ends early decode while the rest still prefill: leave room for those steps.
        prefill_steps = -(-conc * profile.decode_prompt_len // engine.config.max_num_batched_tokens) + 1
        max_tokens = prefill_steps + profile.decode_warmup_steps + profile.decode_steps + 8
        ids = [engine.add_request(_random_prompt(rng, profile.decode_prompt_len, vocab), _params(max_tokens))
               for _ in range(conc)]
        while True:  # prefill everyone (chunks) until every request is decoding
            engine.step()
            stats = engine.stats()
            if stats.step_prefill_tokens == 0 and stats.num_running == conc:
                break
            if stats.num_running < conc and not any(stats.num_waiting_by_priority.values()):
                raise RuntimeError(f"only {stats.num_running} of {conc} requests could run (KV pool too small?)")
        for _ in range(profile.decode_warmup_steps):
            engine.step()
        times, sched_ms, prep_ms = [], [], []
        for step in range(profile.decode_steps):
            if step == profile.decode_steps // 2:  # KV tokens the middle step reads (contexts differ by a few)
                kv_tokens = sum(r.num_tokens for r in engine.scheduler.running)
            times.append(_timed_step(engine))
            stats = engine.stats()
            sched_ms.append(stats.step_schedule_ms)
            prep_ms.append(stats.step_prepare_ms)
            assert stats.step_decode_tokens == conc and stats.step_prefill_tokens == 0
        syncs = _count_syncs(engine)
        hit = _experts_hit(engine)
        for request_id in ids:
            engine.abort(request_id)
        median = statistics.median(times)
        mid_ctx = round(kv_tokens / conc)
        floor = step_floor(
            costs, num_tokens=conc, num_logits=conc, experts_hit=hit, kv_tokens_read=kv_tokens,
            attn_pairs=kv_tokens, bandwidth_bytes_s=peaks["bandwidth_gbps"] * 1e9,
            peak_flops_s=peaks["peak_tflops"] * 1e12,
        )
        rows.append(dict(
            kind="decode", concurrency=conc, context=mid_ctx, tokens_per_s=conc / median, ms_per_step=median * 1e3,
            max_over_median=max(times) / median, steps_over_2x_median=sum(t > 2 * median for t in times),
            scheduler_ms=statistics.median(sched_ms), prepare_ms=statistics.median(prep_ms), host_syncs_per_step=syncs,
            experts_hit_per_layer=hit / max(num_moe_layers(engine), 1), floor_ms=floor.seconds * 1e3,
            floor_bound=floor.bound, floor_gb=floor.bytes / 1e9, floor_tflop=floor.flops / 1e12,
            time_over_floor=median / floor.seconds,
        ))
        _log(f"decode C={conc}: {rows[-1]['ms_per_step']:.2f} ms/step, {rows[-1]['time_over_floor']:.2f}x floor")
    return rows


def bench_prefill(engine, profile: Profile, peaks: dict, costs, rng: random.Random) -> list[dict]:
    from benchmarks.roofline import step_floor

    rows = []
    vocab = engine.model_config.vocab_size
    for length in profile.prefill_lens:
        times, hits = [], []
        for rep in range(profile.prefill_reps + 1):  # the first run warms up (allocator, kernel variants)
            engine.add_request(_random_prompt(rng, length, vocab), _params(1))
            if rep == profile.prefill_reps:  # the last run only counts the experts hit
                hits.append(_experts_hit(engine))
            else:
                times.append(_timed_step(engine, alone=True))
                assert engine.stats().step_prefill_tokens == length, "the prompt did not fit in one step"
            while engine.has_unfinished():
                engine.step()
        times = times[1:] or times
        median = statistics.median(times)
        floor = step_floor(
            costs, num_tokens=length, num_logits=1, experts_hit=hits[0], kv_tokens_read=0,
            attn_pairs=length * (length + 1) // 2, bandwidth_bytes_s=peaks["bandwidth_gbps"] * 1e9,
            peak_flops_s=peaks["peak_tflops"] * 1e12,
        )
        rows.append(dict(
            kind="prefill", tokens=length, tokens_per_s=length / median, ms_per_step=median * 1e3,
            step_ms=[round(t * 1e3, 3) for t in times],
            floor_ms=floor.seconds * 1e3, floor_bound=floor.bound, floor_gb=floor.bytes / 1e9,
            floor_tflop=floor.flops / 1e12, time_over_floor=median / floor.seconds,
        ))
        _log(f"prefill {length}: {rows[-1]['tokens_per_s']:.0f} tok/s, {rows[-1]['time_over_floor']:.2f}x floor")
    return rows


def e2e_workload(profile: Profile, vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    return [_random_prompt(rng, profile.e2e_prompt_len, vocab) for _ in range(profile.e2e_requests)]


def bench_e2e_moegate(engine, prompts: list[list[int]], output_len: int) -> dict:
    _sync(engine.device)
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, _params(output_len))
    produced = 0
    steps = []  # (seconds, decode tokens, prefill tokens, replayed from a graph)
    graphs = engine.runner.decode_graphs
    while engine.has_unfinished():
        replays, t0 = graphs.replays if graphs else 0, time.perf_counter()
        produced += sum(len(o.token_ids) for o in engine.step())
        stats = engine.stats()
        steps.append((time.perf_counter() - t0, stats.step_decode_tokens, stats.step_prefill_tokens,
                      bool(graphs and graphs.replays > replays)))
    seconds = time.perf_counter() - start
    assert produced == len(prompts) * output_len, (produced, len(prompts) * output_len)
    # Where the time went: a slow end-to-end run shows here as eager decode steps or long prefill steps.
    decode = [t for t, d, p, _ in steps if p == 0 and d]
    breakdown = dict(
        steps=len(steps), prefill_steps=sum(p > 0 for _, _, p, _ in steps),
        prefill_step_s=round(sum(t for t, _, p, _ in steps if p > 0), 4), decode_step_s=round(sum(decode), 4),
        decode_step_median_ms=round(statistics.median(decode) * 1e3, 3) if decode else None,
        eager_decode_steps=sum(1 for _, d, p, g in steps if p == 0 and d and not g),
        host_s_outside_steps=round(seconds - sum(t for t, *_ in steps), 4),
    )
    _log(f"moegate end to end breakdown: {breakdown}")
    return dict(system="moegate", output_tokens=produced, seconds=seconds, tokens_per_s=produced / seconds, **breakdown)


def _hf_model(model_config, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    with torch.device(device):  # random init directly on the device: no CPU copy of a real-size model
        model = AutoModelForCausalLM.from_config(model_config.hf_config, dtype=dtype)
    return model.eval()


def bench_e2e_hf(model_config, dtype: torch.dtype, device: torch.device, prompts: list[list[int]], output_len: int) -> list[dict]:
    """transformers on the same prompts: one static batch with generate(), and generate_batch().

    Not under inference_mode: generate_batch's worker thread updates tensors made here in place.
    """
    from transformers import GenerationConfig

    with torch.no_grad():
        model = _hf_model(model_config, dtype, device)
    experts = getattr(model.config, "_experts_implementation", None)
    rows = []
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    modes = {
        "generate (one static batch)": lambda: torch.no_grad()(model.generate)(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len, min_new_tokens=output_len,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        ),
    }
    if hasattr(model, "generate_batch"):
        gen = GenerationConfig(do_sample=False, max_new_tokens=output_len, eos_token_id=-1, pad_token_id=0)
        cb_config = None
        if device.type == "cpu":  # the smoke run: sizing its cache from host memory takes ~25 s; give it a small one
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            cb_config = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512)
        # warmup: its CUDA graph capture; on the CPU it only costs time.
        modes["generate_batch (continuous batching)"] = lambda: model.generate_batch(
            inputs=prompts, generation_config=gen, continuous_batching_config=cb_config, warmup=device.type == "cuda")
    for name, run in modes.items():
        try:
            _sync(device)
            start = time.perf_counter()
            out = run()
            _sync(device)
            seconds = time.perf_counter() - start
        except Exception as e:  # a mode this transformers/GPU cannot run is reported, not fatal
            rows.append(dict(system=f"transformers {name}", error=f"{type(e).__name__}: {e}".splitlines()[0][:160]))
            continue
        if isinstance(out, dict):
            produced = sum(len(r.generated_tokens) for r in out.values())
        else:
            produced = (out.shape[1] - ids.shape[1]) * out.shape[0]
        if produced != len(prompts) * output_len:
            rows.append(dict(system=f"transformers {name}", error=f"produced {produced} of {len(prompts) * output_len} tokens"))
            continue
        rows.append(dict(system=f"transformers {name}", experts_implementation=experts, output_tokens=produced,
                         seconds=seconds, tokens_per_s=produced / seconds))
        _log(f"{rows[-1]['system']}: {rows[-1]['tokens_per_s']:.1f} tok/s")
    del model
    return rows


def run(profile: Profile, device: torch.device, skip_hf: bool = False, elementwise: str = "triton",
        dense_gemv: str = "measure", quantization: str | None = None) -> dict:
    from benchmarks.roofline import model_costs

    _log(f"measuring peaks on {device}")
    peaks = measure_peaks(profile, device)
    _log(f"building {profile.spec} (random weights) on {device}")
    engine = build_engine(profile, device, elementwise=elementwise, dense_gemv=dense_gemv, quantization=quantization)
    # Which projections run the Triton gemv at which row counts, as measured at engine start.
    dense_gemv_choices = [c.to_dict() for c in engine.dense_gemv_choices]
    dense_gemv_table = None
    if engine.dense_gemv_choices:
        from engine.transforms.gemv_select import format_choices

        dense_gemv_table = format_choices(engine.dense_gemv_choices)
    costs = model_costs(engine.model)
    rng = random.Random(0)
    decode = bench_decode(engine, profile, peaks, costs, rng)
    prefill = bench_prefill(engine, profile, peaks, costs, rng)
    prompts = e2e_workload(profile, engine.model_config.vocab_size)
    e2e = [bench_e2e_moegate(engine, prompts, profile.e2e_output_len)]
    _log(f"moegate end to end: {e2e[0]['tokens_per_s']:.1f} tok/s")
    decode_profile = None
    if profile.profile_concurrency and device.type == "cuda":
        decode_profile = profile_decode(engine, profile, rng)
        _log(f"profile of one decode step at C={profile.profile_concurrency}:\n{decode_profile}")
    model_config, dtype = engine.model_config, engine.dtype
    graphs, pieces = engine.runner.decode_graphs, engine.runner.piecewise_graphs
    report = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run, Triton interpreter)",
        torch=torch.__version__, profile=asdict(profile), dtype=str(dtype).removeprefix("torch."),
        attention_backend=engine.kernels.attention, elementwise_backend=engine.kernels.elementwise, cuda_graph_sizes=list(graphs.sizes) if graphs else None,
        piecewise_token_sizes=list(pieces.sizes) if pieces else None, piecewise_capture_s=pieces.capture_s if pieces else None,
        kv_blocks=engine.scheduler.kv.pool.num_blocks, costs=asdict(costs), decode_profile=decode_profile,
        dense_gemv=dense_gemv, quantization=quantization, dense_gemv_choices=dense_gemv_choices, dense_gemv_table=dense_gemv_table, **peaks,
    )
    del engine, graphs, pieces
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not skip_hf:
        import transformers

        report["transformers"] = transformers.__version__
        e2e += bench_e2e_hf(model_config, dtype, device, prompts, profile.e2e_output_len)
    baselines = [r for r in e2e[1:] if "tokens_per_s" in r]
    if baselines:
        best = max(baselines, key=lambda r: r["tokens_per_s"])
        report["moegate_over_best_transformers"] = e2e[0]["tokens_per_s"] / best["tokens_per_s"]
    report.update(decode=decode, prefill=prefill, e2e=e2e)
    return report


def format_table(report: dict) -> str:
    p = report["profile"]
    lines = [
        f"moegate engine benchmark: {p['spec']} with RANDOM weights, {report['dtype']}, {report['device']}, "
        f"attention {report['attention_backend']}, elementwise {report['elementwise_backend']}, "
        f"CUDA graphs {report['cuda_graph_sizes'] and 'on' or 'off'}, piecewise CUDA graphs "
        f"{report.get('piecewise_token_sizes') and 'on' or 'off'}, dense gemv {report.get('dense_gemv', 'auto')}, "
        f"experts {report.get('quantization') or report['dtype']}",
        f"measured peaks: {report['bandwidth_gbps']:.0f} GB/s (device copy), {report['peak_tflops']:.1f} TFLOP/s (matmul)",
        "",
    ]
    if report.get("dense_gemv_table"):
        lines += ["dense projections, Triton gemv vs F.linear (measured at engine start):", report["dense_gemv_table"], ""]
    lines += [
        f"{'workload':<22} {'tok/s':>10} {'ms/step':>9} {'floor ms':>9} {'bound':>7} {'time/floor':>10} "
        f"{'max/med':>7} {'>2x med':>7} {'sched ms':>8} {'syncs':>5}",  # syncs: per eager step (1 expected)
    ]
    for r in report["decode"]:
        lines.append(
            f"{'decode C=' + str(r['concurrency']) + ' ctx~' + str(r['context']):<22} {r['tokens_per_s']:>10.1f} "
            f"{r['ms_per_step']:>9.2f} {r['floor_ms']:>9.3f} {r['floor_bound']:>7} {r['time_over_floor']:>10.2f} "
            f"{r['max_over_median']:>7.2f} {r['steps_over_2x_median']:>7} {r['scheduler_ms']:>8.2f} {r['host_syncs_per_step']:>5}"
        )
    for r in report["prefill"]:
        lines.append(
            f"{'prefill ' + str(r['tokens']) + ' tokens':<22} {r['tokens_per_s']:>10.1f} {r['ms_per_step']:>9.2f} "
            f"{r['floor_ms']:>9.3f} {r['floor_bound']:>7} {r['time_over_floor']:>10.2f}"
        )
    lines += ["", f"end to end: {p['e2e_requests']} requests, prompt {p['e2e_prompt_len']}, "
                  f"output {p['e2e_output_len']} tokens (greedy, EOS ignored)"]
    ours = report["e2e"][0]["tokens_per_s"]
    for r in report["e2e"]:
        if "error" in r:
            lines.append(f"  {r['system']:<48} n/a: {r['error']}")
        else:
            lines.append(f"  {r['system']:<48} {r['tokens_per_s']:>10.1f} output tok/s   "
                         f"moegate/this {ours / r['tokens_per_s']:>6.2f}x")
    decode1 = next((r for r in report["decode"] if r["concurrency"] == 1), None)
    lines.append("")
    if decode1:
        lines.append(f"goal: decode at batch 1 within 1.5x of its floor: {decode1['time_over_floor']:.2f}x")
    if "moegate_over_best_transformers" in report:
        lines.append(f"goal: output tok/s >= 10x the best transformers mode: {report['moegate_over_best_transformers']:.2f}x")
    slow = sum(r["steps_over_2x_median"] for r in report["decode"])
    lines.append(f"check: decode steps slower than 2x their median: {slow}")
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def emit(report: dict, json_path: str | None, table: str) -> int:
    """Write ``report`` as JSON to ``json_path`` (if given), print ``table``; the exit status."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the same code on the CPU: tiny model, Triton interpreter")
    parser.add_argument("--preset", help="random-weights spec (default qwen3-30b-a3b; e.g. olmoe-1b-7b, gpt-oss-20b, "
                        "deepseek-v2-lite (MLA), mixtral-8x7b or gpt-oss-120b on an H200, "
                        "glm-4.5-air:num_hidden_layers=12 with 8-bit experts)")
    parser.add_argument("--concurrency", type=_ints, help="decode concurrencies (default 1,8,32,128,256)")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the transformers comparison")
    parser.add_argument("--elementwise", choices=("torch", "triton"), default="triton",
                        help="norms/RoPE/routing kernels (torch: unfused, to compare)")
    parser.add_argument("--dense-gemv", choices=("measure", "off", "on"), default="measure",
                        help="the dense gemv (off: cuBLAS for every projection, to compare; on: everywhere)")
    parser.add_argument("--profile", type=int, metavar="C", default=0,
                        help="print a kernel profile of one decode step at concurrency C (CUDA)")
    parser.add_argument("--quantization", choices=("fp8", "fp8-block", "int8"), default=None,
                        help="routed experts in 8 bits (the engine's --quantization); the transformers comparison "
                             "stays unquantized, so use it with --skip-hf")
    parser.add_argument("--json", metavar="PATH", help="also write the full report as JSON to PATH")
    args = parser.parse_args(argv)

    if args.smoke:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported
        profile, device = SMOKE, torch.device("cpu")
    elif not torch.cuda.is_available():
        print("benchmarks.engine_gpu: no CUDA device (use --smoke for a CPU run of the same code)", file=sys.stderr)
        return 2
    else:
        profile, device = GPU, torch.device("cuda")
    if args.preset:
        profile = replace(profile, spec=args.preset)
    if args.concurrency:
        profile = replace(profile, concurrency=args.concurrency)
    if args.profile:
        profile = replace(profile, profile_concurrency=args.profile)
    report = run(profile, device, skip_hf=args.skip_hf, elementwise=args.elementwise, dense_gemv=args.dense_gemv,
                 quantization=args.quantization)
    return emit(report, args.json, format_table(report))


if __name__ == "__main__":
    sys.exit(main())
