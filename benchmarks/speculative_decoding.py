"""Speculative decoding (n-gram prompt lookup, or a draft model) on vs off: decode tokens/s side by side, alternating.

    python -m benchmarks.speculative_decoding [--model SPEC] [--batches 1,8,64] [--rounds 3] [--threads 1]
    python -m benchmarks.speculative_decoding --proposer draft [--draft-layers 1] ...

With ``--proposer draft`` the target is the same shape written as a checkpoint by transformers (random
weights, initializer range 0.08 so that greedy output loops as a trained model's repeats would not), and the
draft is that checkpoint cut to its first ``--draft-layers`` layers (same embeddings, LM head and first
layers: it agrees with the target on part of the tokens; random models agree little, so the acceptance is
printed next to the speed).

Two engines over the same random-weight model (``--model``: a ``random_weights`` spec, default a small
Qwen3-MoE shape), one with ``speculative="ngram"``, one without, built once; each round runs every case on
both, alternating which goes first; the median tokens/s of each and the median of the rounds' own ratios
(spec / off, the two runs of a round side by side) are reported. Workloads:

- ``repeating``: each prompt is a random passage written twice (a text and its copy, as in "repeat this"),
  decoded greedily. A random-weight model does not copy text the way a trained one does, but its greedy
  output falls into loops within a few dozen tokens, which prompt lookup predicts; the acceptance rate is
  printed so the reader sees how much was predictable.
- ``sampled``: random prompts, temperature 1 (seeded): nothing repeats, drafts are rarely proposed or
  accepted (the cost of looking and of the few wrong guesses).

Decode tokens/s counts the tokens generated after every request's first step (prefill excluded), over the
time from then to the last request's end; every request asks for ``--max-tokens`` and ignores EOS.
"""

import argparse
import copy
import random
import statistics
import tempfile
import time

import torch

from engine import LLM, SamplingParams

DEFAULT_MODEL = ("qwen3-30b-a3b:hidden_size=256,intermediate_size=512,moe_intermediate_size=128,num_hidden_layers=4,"
                 "num_attention_heads=4,num_key_value_heads=2,head_dim=64,num_experts=16,num_experts_per_tok=4,"
                 "vocab_size=4096,bos_token_id=0,eos_token_id=1")


def write_target_and_draft(directory: str, draft_layers: int) -> tuple[str, str]:
    """(target, draft) checkpoint directories: DEFAULT_MODEL's shape with random weights, and its first layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
        vocab_size=4096, bos_token_id=0, eos_token_id=1, max_position_embeddings=2048, initializer_range=0.08)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    target, draft = f"{directory}/target", f"{directory}/draft"
    model.save_pretrained(target)
    cut = copy.deepcopy(model)
    cut.model.layers = cut.model.layers[:draft_layers]
    cut.config.num_hidden_layers = draft_layers
    cut.save_pretrained(draft)
    return target, draft


def _prompts(workload: str, batch: int, vocab: int, rng: random.Random) -> list[list[int]]:
    if workload == "repeating":
        passages = [[rng.randrange(2, vocab) for _ in range(48)] for _ in range(batch)]
        return [p + p for p in passages]
    return [[rng.randrange(2, vocab) for _ in range(96)] for _ in range(batch)]


def _params(workload: str, batch: int, max_tokens: int) -> list[SamplingParams]:
    if workload == "repeating":
        return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * batch
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True) for i in range(batch)]


def decode_rate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int, int, int]:
    """(decode tokens/s, decode tokens, drafts proposed, drafts accepted) of one run to completion."""
    engine = llm.engine
    before = engine.stats()
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    first_step_done: set[str] = set()
    tokens = 0
    start = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in first_step_done:
                tokens += len(out.token_ids)
            first_step_done.add(out.request_id)
        if start is None and len(first_step_done) == len(prompts):
            start = time.perf_counter()
    elapsed = time.perf_counter() - start
    after = engine.stats()
    return (tokens / elapsed, tokens, after.spec_draft_tokens - before.spec_draft_tokens,
            after.spec_accepted_tokens - before.spec_accepted_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="random_weights spec")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--speculative-max-batch", type=int, default=None, help="default: the engine's default")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--proposer", choices=["ngram", "draft"], default="ngram")
    ap.add_argument("--draft-layers", type=int, default=1, help="--proposer draft: the draft's layers (of 4)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: verification runs through the decode CUDA graphs")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(dtype=args.dtype, device=args.device, num_kv_blocks=2048, block_size=16,
                  max_num_seqs=max(batches), max_num_batched_tokens=8192, enable_prefix_caching=False)
    spec_kw = dict(speculative=args.proposer, num_speculative_tokens=args.num_speculative_tokens)
    if args.speculative_max_batch is not None:
        spec_kw["speculative_max_batch"] = args.speculative_max_batch
    name = args.proposer
    if name == "draft":
        target, spec_kw["speculative_model"] = write_target_and_draft(tempfile.mkdtemp(), args.draft_layers)
        model_name = f"{target} (draft: its first {args.draft_layers} layers)"
    else:
        target, common["random_weights"] = "bench", args.model
        model_name = args.model
    engines = {"off": LLM(model=target, **common), name: LLM(model=target, **common, **spec_kw)}
    vocab = engines["off"].engine.model_config.vocab_size
    print(f"model {model_name}\nthreads {args.threads}, max_tokens {args.max_tokens}, K {args.num_speculative_tokens}, "
          f"rounds {args.rounds} (median)")
    print(f"{'workload':<10} {'batch':>5} {'off tok/s':>10} {name + ' tok/s':>12} {'ratio':>6} {'accept':>7} {'drafts/tok':>10}")
    # accept: drafts accepted / proposed; drafts/tok: drafts proposed per decode token (over the speculating runs)
    for workload in ("repeating", "sampled"):
        for batch in batches:
            rng = random.Random(batch)
            prompts = _prompts(workload, batch, vocab, rng)
            params = _params(workload, batch, args.max_tokens)
            rates: dict[str, list[float]] = {"off": [], name: []}
            drafts = accepted = produced = 0
            for r in range(args.rounds):
                order = ["off", name] if r % 2 == 0 else [name, "off"]
                for which in order:
                    rate, tokens, d, a = decode_rate(engines[which], prompts, params)
                    rates[which].append(rate)
                    if which == name:
                        drafts, accepted, produced = drafts + d, accepted + a, produced + tokens
            off, on = statistics.median(rates["off"]), statistics.median(rates[name])
            # The median of each round's own ratio: the two runs of a round share the machine's load of the moment.
            ratio = statistics.median(b / a for a, b in zip(rates["off"], rates[name]))
            print(f"{workload:<10} {batch:>5} {off:>10.1f} {on:>12.1f} {ratio:>5.2f}x "
                  f"{accepted / drafts if drafts else 0:>7.2f} {drafts / produced if produced else 0:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
