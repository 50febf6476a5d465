"""Many LoRA adapters vs the base model: the same requests, generated side by side, tokens/s and their ratio.

    python -m benchmarks.lora_throughput [--shape small|realistic] [--requests 64] [--adapters 8] [--rank 16]
        [--max-tokens 32] [--rounds 5] [--device cpu] [--dtype float32]

A random small Qwen3-MoE checkpoint (written by transformers) and ``--adapters`` PEFT-format adapters of rank
``--rank`` on every attention projection and both fused expert tensors (random factors, written directly in
PEFT's layout). Two engines: one serving the adapters, one the base model alone. Each round runs the same
``--requests`` random prompts through both (alternating which goes first): with adapters, request i runs under
adapter i mod N; on the base engine, under none. Reported: tokens/s of each (all generated tokens over the
wall time of the whole batch) and the median and range of the rounds' own ratios (adapters / base; goal >= 0.8).

What the adapters cost depends mostly on how their expert factors compare in bytes with the experts themselves
(printed as "expert LoRA bytes / expert bytes"): every decode step reads both. Per layer that is
adapters * rank * (2*hidden + 3*moe_intermediate) against 3 * moe_intermediate * hidden, whatever the number
of experts. ``--shape``:

- ``small`` (default): hidden 256, moe_intermediate 128, 16 experts (top-4), 4 layers. 8 adapters of rank 16
  are 117% of the experts' bytes: about 7x more LoRA-heavy than a real model.
- ``realistic``: Qwen3-30B-A3B's hidden 2048 and moe_intermediate 768 (so the same 17% for 8 adapters of rank
  16 as on that model), with 8 experts (top-2; as many pairs per (expert, adapter) group in decode as the small
  shape), 16 heads and 2 layers so that 3 rounds run in a few minutes on 2 cores.
"""

import argparse
import json
import os
import random
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

from engine import LLM, RequestPolicy, SamplingParams

SHAPE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
             vocab_size=4096, bos_token_id=0, eos_token_id=1, max_position_embeddings=2048)
# Qwen3-30B-A3B's hidden and expert widths (so its adapter:expert byte ratio), fewer heads, experts and layers.
# Top-2 of 8 keeps the small shape's pairs per (expert, adapter) group at 64 decode tokens and halves the work.
REALISTIC_SHAPE = dict(SHAPE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                       num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                       num_experts=8, num_experts_per_tok=2)
SHAPES = {"small": SHAPE, "realistic": REALISTIC_SHAPE}
QWEN3_30B_A3B = dict(hidden_size=2048, moe_intermediate_size=768)


def expert_lora_ratio(shape: dict, adapters: int, rank: int) -> float:
    """The adapters' expert factors (gate/up and down, A and B) over the experts' own weights, in bytes."""
    h, i = shape["hidden_size"], shape["moe_intermediate_size"]
    return adapters * rank * (2 * h + 3 * i) / (3 * i * h)


def write_base(path: str, shape: dict = SHAPE) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", **shape)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def write_base_and_adapters(tmp: str, num_adapters: int, rank: int, shape: dict = SHAPE) -> list[str]:
    """The base model in ``tmp/base`` and adapters ``ad0..`` beside it (seeds 1..n); returns their names."""
    write_base(f"{tmp}/base", shape)
    names = [f"ad{k}" for k in range(num_adapters)]
    for k, name in enumerate(names):
        write_adapter(f"{tmp}/{name}", rank, seed=k + 1, shape=shape)
    return names


def write_adapter(path: str, rank: int, seed: int, shape: dict = SHAPE) -> None:
    """PEFT's layout: lora_A [r, in], lora_B [out, r] per projection; fused experts A [E*r, in], B [out, r*E]."""
    g = torch.Generator().manual_seed(seed)
    h, d, e, i = shape["hidden_size"], shape["head_dim"], shape["num_experts"], shape["moe_intermediate_size"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        pre = f"base_model.model.model.layers.{layer}"
        for name, (fan_in, fan_out) in shapes.items():
            tensors[f"{pre}.self_attn.{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.05
            tensors[f"{pre}.self_attn.{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.05
        tensors[f"{pre}.mlp.experts.base_layer.lora_A.weight"] = torch.randn(e * rank, h, generator=g) * 0.05
        tensors[f"{pre}.mlp.experts.base_layer.lora_B.weight"] = torch.randn(2 * i, rank * e, generator=g) * 0.05
        tensors[f"{pre}.mlp.experts.lora_A.weight"] = torch.randn(e * rank, i, generator=g) * 0.05
        tensors[f"{pre}.mlp.experts.lora_B.weight"] = torch.randn(h, rank * e, generator=g) * 0.05
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(shapes), "target_parameters": ["mlp.experts.gate_up_proj",
                                                                         "mlp.experts.down_proj"]}, f)


def run(llm: LLM, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> float:
    """Tokens/s of the whole batch."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for p, a in zip(prompts, adapters):
        engine.add_request(p, params, policy=RequestPolicy(lora_adapter=a))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="small", choices=list(SHAPES),
                    help="small: the adapters' expert factors outweigh the experts; realistic: Qwen3-30B-A3B's ratio")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the experts' deltas then run the Triton kernel)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        shape = SHAPES[args.shape]
        names = write_base_and_adapters(tmp, args.adapters, args.rank, shape)
        common = dict(model=f"{tmp}/base", dtype=args.dtype, device=args.device, num_kv_blocks=1024, block_size=16)
        engines = {"base": LLM(**common),
                   "lora": LLM(**common, lora_adapters=",".join(f"{n}={tmp}/{n}" for n in names),
                               max_loras=args.adapters, max_lora_rank=args.rank)}
        rng = random.Random(0)
        prompts = [[rng.randrange(2, shape["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        per = {"base": [None] * args.requests, "lora": [names[i % len(names)] for i in range(args.requests)]}
        run(engines["base"], prompts[:4], per["base"][:4], 4)  # warm both once
        run(engines["lora"], prompts[:4], per["lora"][:4], 4)
        speeds: dict[str, list[float]] = {"base": [], "lora": []}
        ratios = []
        for r in range(args.rounds):
            order = ["base", "lora"] if r % 2 == 0 else ["lora", "base"]
            got = {name: run(engines[name], prompts, per[name], args.max_tokens) for name in order}
            for name in got:
                speeds[name].append(got[name])
            ratios.append(got["lora"] / got["base"])
        print(f"{args.requests} requests, {args.adapters} adapters of rank {args.rank} (attention + experts), "
              f"{args.prompt_len}-token prompts, {args.max_tokens} new tokens, {args.device} {args.dtype}, "
              f"{args.threads} thread(s)")
        print(f"  shape {args.shape}: hidden {shape['hidden_size']}, moe_intermediate {shape['moe_intermediate_size']}, "
              f"{shape['num_experts']} experts (top-{shape['num_experts_per_tok']}), {shape['num_hidden_layers']} layers; "
              f"expert LoRA bytes / expert bytes {expert_lora_ratio(shape, args.adapters, args.rank):.0%} "
              f"(Qwen3-30B-A3B with the same adapters: {expert_lora_ratio(QWEN3_30B_A3B, args.adapters, args.rank):.0%})")
        for name in ("base", "lora"):
            print(f"  {name:5s} {statistics.median(speeds[name]):8.1f} tokens/s")
        print(f"  ratio lora/base (median of rounds): {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-"
              f"{max(ratios):.2f}x over {len(ratios)} rounds (goal >= 0.8x)")


if __name__ == "__main__":
    main()
