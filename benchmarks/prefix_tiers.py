"""Prefix-cache tiers on a multi-tenant multi-turn workload: how much prompt is served from cache, and TTFT,
with a device pool holding about a quarter of the tenants' system prompts.

    python -m benchmarks.prefix_tiers [--tenants 64] [--system-len 1000] [--turns 3] [--concurrency 4]
                                      [--threads 2] [--model SPEC] [--no-repeat 24] [--rounds 3]
                                      [--overhead-only]

One process, the same random-weight model (default: a small Qwen3-MoE, hidden 256, 4 layers, 16 experts) and
the same workload for every mode, run one after another:

* ``unlimited``: a device pool that holds everything (the ceiling of what a cache can serve);
* ``device``: a pool of about a quarter of the system prompts' blocks, no tiers;
* ``tiers``: the same pool, with a host tier that holds everything (``host_cache_gb``).

Workload (``loadgen.conversations``): one conversation per tenant with its own system prompt (every 8th tenant
uses tenant 0's verbatim, so only the cache salt keeps them apart), ``turns`` turns of 20-60 new user tokens
and 16 generated tokens; turn t of every tenant, round robin, ``concurrency`` requests in flight (the next one
starts when one finishes). A tenant's next turn comes after every other tenant's: by then its blocks have left
a pool of a quarter of the prompts.

Reported: prompt tokens served from cache (the engine's ``num_cached_tokens``: every tier), their fraction of
the unlimited pool's, TTFT (time from adding a request to its first token) p50/p90, and cross-tenant hits:
cached tokens beyond the leading blocks the request shares with its own tenant's earlier sequences (prompts and
replies), which must be 0. Then the overhead where nothing repeats (``--no-repeat`` unique prompts of
``system-len`` tokens through the small pool, so every request evicts): total time with tiers over without,
rounds alternating, median of the ratios of wall time and of the process's CPU time; and, less exposed to a shared machine's noise, the host time the
tiers' copies took (``ModelRunner.tier_copy_ms``, on the CPU the copies themselves) over the run's time.
"""

import argparse
import random
import statistics
import time

import torch

from engine.core.block_pool import hash_block_tokens
from engine.core.config import EngineConfig
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from loadgen.conversations import tenant_conversations

SMALL = ("qwen3-30b-a3b:hidden_size=256,num_hidden_layers=4,num_experts=16,num_experts_per_tok=4,"
         "moe_intermediate_size=128,intermediate_size=512,num_attention_heads=4,num_key_value_heads=2,head_dim=64,"
         "vocab_size=8192")
BLOCK = 16


def _engine(model: str, num_blocks: int, host_gb: float, max_len: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model="bench", random_weights=model, device="cpu", dtype="float32",
                                  block_size=BLOCK, num_kv_blocks=num_blocks, max_model_len=max_len,
                                  max_num_batched_tokens=2048, host_cache_gb=host_gb))


def _hashes(tokens: list[int], salt: str) -> list[bytes]:
    out, parent = [], None
    for i in range(len(tokens) // BLOCK):
        parent = hash_block_tokens(parent, tokens[i * BLOCK:(i + 1) * BLOCK], salt)
        out.append(parent)
    return out


def run_conversations(engine: LLMEngine, convs, turns: int, concurrency: int) -> dict:
    """Every tenant's turn t, round robin, ``concurrency`` in flight; per request: prompt length, cached tokens,
    TTFT, and cached tokens no earlier sequence of its own tenant explains."""
    for c in convs:
        c.replies.clear()
    order = [(t, c) for t in range(turns) for c in convs]
    params = SamplingParams(temperature=0.0, max_tokens=convs[0].max_tokens, ignore_eos=True)
    own: dict[str, set[bytes]] = {c.tenant: set() for c in convs}  # hashes of each tenant's earlier sequences
    pending: dict[str, tuple] = {}
    prompt_tokens = cached = cross = 0
    ttft: list[float] = []
    start = time.perf_counter()
    nxt = 0
    while nxt < len(order) or pending:
        while nxt < len(order) and len(pending) < concurrency:
            turn, conv = order[nxt]
            if len(conv.replies) < turn:
                break  # its previous turn is still running (only with tiny tenant counts)
            prompt = conv.prompt(turn)
            rid = engine.add_request(prompt, params, policy=RequestPolicy(tenant=conv.tenant, cache_salt=conv.tenant))
            pending[rid] = (conv, prompt, time.perf_counter(), None, [])
            nxt += 1
        for out in engine.step():
            conv, prompt, added, first, tokens = pending[out.request_id]
            if first is None and out.token_ids:
                first = time.perf_counter()
                ttft.append(first - added)
            tokens += out.token_ids
            pending[out.request_id] = (conv, prompt, added, first, tokens)
            if out.finished:
                del pending[out.request_id]
                conv.replies.append(tokens)
                hashes = _hashes(prompt, conv.tenant)
                legit = 0
                while legit < len(hashes) and hashes[legit] in own[conv.tenant]:
                    legit += 1
                cross += max(0, out.num_cached_tokens - legit * BLOCK)
                own[conv.tenant].update(_hashes(prompt + tokens, conv.tenant))
                prompt_tokens += len(prompt)
                cached += out.num_cached_tokens
    seconds = time.perf_counter() - start
    ttft.sort()
    return dict(seconds=seconds, prompt_tokens=prompt_tokens, cached=cached, cross=cross,
                ttft_p50=statistics.median(ttft), ttft_p90=ttft[int(0.9 * (len(ttft) - 1))], requests=len(ttft))


def run_unique(engine: LLMEngine, prompts: list[list[int]], concurrency: int) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) to run every prompt (4 output tokens each, ``concurrency`` in
    flight). CPU time is what a busy shared machine disturbs least: other processes' work is not counted."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    queue = list(prompts)
    live = 0
    while queue or live:
        while queue and live < concurrency:
            engine.add_request(queue.pop(0), params, policy=RequestPolicy(tenant="solo", cache_salt="solo"))
            live += 1
        live -= sum(o.finished for o in engine.step())
    return time.perf_counter() - start, time.process_time() - cpu


def run_modes(args, convs, turns: int, everything: int, quarter: int, max_len: int) -> None:
    """The conversations through each mode: cache served, TTFT, cross-tenant hits."""
    results = {}
    for mode, blocks, host_gb in (("unlimited", everything, 0.0), ("device", quarter, 0.0), ("tiers", quarter, 4.0)):
        engine = _engine(args.model, blocks, host_gb, max_len)
        r = results[mode] = run_conversations(engine, convs, turns, args.concurrency)
        stats = engine.stats()
        host = {f: sum(getattr(s, f) for s in stats.cache_tiers if s.tier == "host")
                for f in ("hits", "misses", "bytes_in", "bytes_out")}
        print(f"{mode:9s} cached {r['cached']:7d}/{r['prompt_tokens']:7d} prompt tokens  "
              f"TTFT p50 {r['ttft_p50'] * 1e3:7.1f} ms p90 {r['ttft_p90'] * 1e3:7.1f} ms  {r['seconds']:6.1f} s  "
              f"cross-tenant cached tokens {r['cross']}  host {host if host_gb else '-'}", flush=True)
        engine.close()
    full, dev, tiers = results["unlimited"], results["device"], results["tiers"]
    fraction = tiers["cached"] / full["cached"] if full["cached"] else float("nan")
    speedup = dev["ttft_p50"] / tiers["ttft_p50"]
    print(f"served from cache, tiers vs unlimited pool: {fraction:.1%} (goal >= 90%)")
    print(f"TTFT p50, device pool alone / tiers: {speedup:.2f}x (goal >= 3x)")
    print(f"cross-tenant cached tokens, all modes: {sum(r['cross'] for r in results.values())} (goal 0)")


def run_overhead(args, quarter: int, max_len: int) -> None:
    """Where nothing repeats: tiers on vs off, rounds alternating."""
    rng = random.Random(args.seed + 1)
    ratios, cpu_ratios, copy_shares = [], [], []
    for k in range(args.rounds):
        prompts = [[rng.randrange(1, 8191) for _ in range(args.system_len)] for _ in range(args.no_repeat)]
        times = {}
        for mode in (("device", "tiers") if k % 2 == 0 else ("tiers", "device")):
            engine = _engine(args.model, quarter, 4.0 if mode == "tiers" else 0.0, max_len)
            run_unique(engine, prompts[:2], args.concurrency)  # warm-up (not timed)
            copy_ms = engine.runner.tier_copy_ms
            times[mode] = run_unique(engine, prompts[2:], args.concurrency)
            if mode == "tiers":
                copy_shares.append((engine.runner.tier_copy_ms - copy_ms) / 1e3 / times[mode][0])
            engine.close()
        ratios.append(times["tiers"][0] / times["device"][0])
        cpu_ratios.append(times["tiers"][1] / times["device"][1])
        print(f"no-repeat round {k}: device {times['device'][0]:.2f} s ({times['device'][1]:.2f} s CPU), "
              f"tiers {times['tiers'][0]:.2f} s ({times['tiers'][1]:.2f} s CPU), ratio {ratios[-1]:.3f} "
              f"(CPU {cpu_ratios[-1]:.3f}), tier copies {copy_shares[-1]:.2%} of the tiers run", flush=True)
    print(f"overhead where nothing repeats: {statistics.median(ratios) - 1:+.1%} wall time, "
          f"{statistics.median(cpu_ratios) - 1:+.1%} CPU time (medians of {args.rounds} rounds, range "
          f"{min(cpu_ratios) - 1:+.1%} to {max(cpu_ratios) - 1:+.1%}), tier copies "
          f"{statistics.median(copy_shares):.2%} of the run's time (goal < 2%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tenants", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=SMALL)
    ap.add_argument("--no-repeat", type=int, default=24, help="unique prompts per overhead round (0: skip)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overhead-only", action="store_true", help="only the no-repeat overhead rounds")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    turns, max_tokens, user = args.turns, 16, (20, 60)
    convs = tenant_conversations(args.tenants, args.system_len, turns, user, max_tokens, 8192, args.seed,
                                 shared_every=8)
    longest = args.system_len + turns * (user[1] + max_tokens)
    max_len = longest + 64
    everything = args.tenants * (-(-max_len // BLOCK)) + 64
    quarter = max(args.tenants * args.system_len // BLOCK // 4, args.concurrency * (-(-max_len // BLOCK)))
    print(f"{args.tenants} tenants x {args.system_len}-token system prompts, {turns} turns, "
          f"{args.concurrency} in flight; pools: unlimited {everything} blocks, small {quarter} blocks of {BLOCK}",
          flush=True)
    if not args.overhead_only:
        run_modes(args, convs, turns, everything, quarter, max_len)
    if args.no_repeat:
        run_overhead(args, quarter, max_len)

if __name__ == "__main__":
    main()
