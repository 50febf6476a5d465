"""Shared system prompt on a hybrid linear-attention model: prefix cache on vs off.

    python -m benchmarks.hybrid_prefix [--requests 64] [--system-tokens 1000] [--concurrency 4] [--json]

A random-weight Qwen3.5-MoE text model (every parameter drawn at random,
built with transformers; its layers alternate Gated DeltaNet and full
attention as the published checkpoints' do, 3 to 1) serves ``--requests``
requests that share one ``--system-tokens``-token system prompt and add their
own 40-60-token user part, greedy, ``--output-tokens`` tokens each (EOS
ignored). A closed loop keeps ``--concurrency`` requests in flight. The same
requests run with the prefix cache on, then off, in fresh engines.

Printed per mode: the share of prompt tokens served from the cache (each
request's ``num_cached_tokens``: on this model a hit counts only up to the
linear layers' last state checkpoint), time to first token p50 / p90 from
each request's submission; then the cache-off / cache-on TTFT ratios and
whether every request's tokens are equal between the two runs.
"""

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

# Qwen3.5-35B-A3B's text layout scaled down: three Gated DeltaNet layers to one full-attention layer.
MODEL_CONFIG = dict(
    vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
    shared_expert_intermediate_size=512, max_position_embeddings=4096, initializer_range=0.05,
    eos_token_id=4095, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)


def write_model(path: str, seed: int) -> int:
    """Save the random model to ``path``; returns its parameter count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.hf_models import randomize_constants_

    config = AutoConfig.for_model("qwen3_5_moe_text", **MODEL_CONFIG)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms, decay rates and biases too: nothing left at its constant init
        randomize_constants_(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def make_requests(num: int, system_tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = MODEL_CONFIG["vocab_size"]
    system = [rng.randrange(1, vocab - 1) for _ in range(system_tokens)]
    return [system + [rng.randrange(1, vocab - 1) for _ in range(rng.randint(40, 60))] for _ in range(num)]


@dataclass(slots=True)
class ModeResult:
    mode: str
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    ttft_s: list[float] = field(repr=False)
    tokens: list[list[int]] = field(repr=False)

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    def ttft(self, q: float) -> float:
        return statistics.quantiles(self.ttft_s, n=100, method="inclusive")[round(q * 100) - 1]


def run_mode(path: str, prompts: list[list[int]], caching: bool, args) -> ModeResult:
    """The prompts through one fresh engine, ``args.concurrency`` in flight; TTFT from each submission."""
    from engine import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", device="cpu", cpu_threads=1, enable_prefix_caching=caching,
              max_num_seqs=args.concurrency, state_checkpoint_interval=args.state_checkpoint_interval)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    # Warm-up outside the measurement, on tokens the workload never uses (ids above its range: none shared).
    engine.add_request([MODEL_CONFIG["vocab_size"] - 2] * 48, params, request_id="warm")
    while engine.step_needed():
        engine.step()
    queue = list(enumerate(prompts))
    submitted: dict[str, float] = {}
    ttft = [0.0] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    cached = [0] * len(prompts)
    start = time.perf_counter()
    while queue or engine.step_needed():
        while queue and len(submitted) < args.concurrency:
            i, prompt = queue.pop(0)
            submitted[str(i)] = time.perf_counter()
            engine.add_request(prompt, params, request_id=str(i))
        for out in engine.step():
            i = int(out.request_id)
            if out.token_ids and not tokens[i]:
                ttft[i] = time.perf_counter() - submitted[out.request_id]
            tokens[i] += out.token_ids
            cached[i] = out.num_cached_tokens
            if out.finished:
                del submitted[out.request_id]
    seconds = time.perf_counter() - start
    llm.engine.close()
    return ModeResult("cache on" if caching else "cache off", seconds, sum(map(len, prompts)), sum(cached), ttft,
                      tokens)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--state-checkpoint-interval", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    prompts = make_requests(args.requests, args.system_tokens, args.seed)
    with tempfile.TemporaryDirectory(prefix="moegate-hybrid-") as path:
        num_params = write_model(path, args.seed)
        results = [run_mode(path, prompts, caching, args) for caching in (True, False)]
    on, off = results
    report = {
        "num_params": num_params, "args": vars(args),
        "results": [dict({k: v for k, v in asdict(r).items() if k not in ("ttft_s", "tokens")},
                         cached_share=r.cached_share, ttft_p50_s=r.ttft(0.5), ttft_p90_s=r.ttft(0.9)) for r in results],
        "ttft_p50_ratio": off.ttft(0.5) / on.ttft(0.5), "ttft_p90_ratio": off.ttft(0.9) / on.ttft(0.9),
        "outputs_equal": on.tokens == off.tokens,
        "num_outputs_differing": sum(a != b for a, b in zip(on.tokens, off.tokens)),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"model: random Qwen3.5-MoE text, {num_params / 1e6:.1f}M parameters; {args.requests} requests, "
              f"{args.system_tokens}-token system prompt, {args.concurrency} in flight")
        for r in results:
            print(f"{r.mode:9s}  cached {r.cached_share:6.1%} of {r.prompt_tokens} prompt tokens  TTFT p50 "
                  f"{1e3 * r.ttft(0.5):7.1f} ms  p90 {1e3 * r.ttft(0.9):7.1f} ms  {r.seconds:6.1f} s")
        print(f"TTFT off / on: p50 {report['ttft_p50_ratio']:.2f}x  p90 {report['ttft_p90_ratio']:.2f}x; "
              f"outputs equal: {report['outputs_equal']} ({report['num_outputs_differing']} differ)")
    return report


if __name__ == "__main__":
    main()
