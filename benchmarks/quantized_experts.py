"""8-bit routed experts: weight memory of every preset, and CPU decode speed INT8 vs float32, in one run.

    python -m benchmarks.quantized_experts memory       # bytes per preset, bf16 vs each --quantization
    python -m benchmarks.quantized_experts cpu-decode   # decode tokens/s, experts float vs int8, side by side

``memory``: each preset of ``engine.loading.random_weights`` built on the meta device exactly as the engine
builds it (``build_random_model``: same modules, same 8-bit parameters and float32 scales), bytes summed
from every parameter's numel and element size; then the same code on a 2-layer slice of each preset really
allocated on the CPU, its storage bytes counted and checked against the meta count of that slice.

``cpu-decode``: four engines of one random-weight model on the CPU: float32 and bfloat16, each with its
experts in the model dtype and in int8; decode steps at each concurrency timed in turn (one step of each
engine, then again) so the machine's noise falls on all; medians reported.
"""

import argparse
import random
import statistics
import sys
import time

import torch

QUANTIZATIONS = ("fp8", "fp8-block", "int8")
# Shape for cpu-decode: experts dominate (as in the real presets), small enough for a 2-core VM.
CPU_SPEC = ("qwen3-30b-a3b:num_hidden_layers=4,hidden_size=1024,moe_intermediate_size=512,num_experts=32,"
            "num_experts_per_tok=4,num_attention_heads=8,num_key_value_heads=2,head_dim=128,vocab_size=8192")


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f}"


def _weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameter bytes, routed-expert bytes with their scales) from each parameter's numel and dtype."""
    from engine.layers.moe import ExpertWeights

    def nbytes(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    experts = [m for m in model.modules() if isinstance(m, ExpertWeights)]
    return nbytes(model.parameters()), sum(nbytes(m.parameters()) for m in experts)


def _storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storages the parameters really occupy (each storage once)."""
    seen = {}
    for p in model.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def _build(spec: str, quantization: str | None, device: str):
    from engine.loading.quantization import scheme_for_option
    from engine.loading.random_weights import build_random_model, random_model_config

    scheme = scheme_for_option(quantization) if quantization else None
    return build_random_model(random_model_config(spec), torch.bfloat16, torch.device(device), "torch", 1,
                              quantization=scheme)


def memory() -> None:
    from engine.loading.random_weights import PRESETS

    print("weight memory (GiB) with bf16 dense weights; experts bf16 vs 8-bit (scales included)")
    print(f"{'preset':20} {'bf16 total':>10} {'experts':>8}" + "".join(f" {q + ' total':>16}" for q in QUANTIZATIONS)
          + f" {'saved (int8)':>12}")
    for name in PRESETS:
        total, experts = _weight_bytes(_build(name, None, "meta"))
        row = f"{name:20} {_gb(total):>10} {_gb(experts):>8}"
        for q in QUANTIZATIONS:
            q_total, _ = _weight_bytes(_build(name, q, "meta"))
            row += f" {_gb(q_total):>9} ({q_total / total:.2f}x)"
        row += f" {_gb(total - q_total):>12}"
        print(row)
    print("\nreal allocation on the CPU of a 2-layer slice of each preset (MiB), against the meta count:")
    for name in PRESETS:
        spec = f"{name}:num_hidden_layers=2"
        cells = []
        for q in (None, "int8", "fp8-block"):
            model = _build(spec, q, "cpu")
            real, (counted, _) = _storage_bytes(model), _weight_bytes(_build(spec, q, "meta"))
            cells.append(f"{q or 'bf16'} {real / 2**20:.0f}{'' if real == counted else ' (meta said %d)' % counted}")
            del model
        print(f"  {name:20} " + ", ".join(cells))


# (activation dtype, --quantization) pairs cpu-decode runs side by side.
CPU_VARIANTS = (("float32", None), ("float32", "int8"), ("bfloat16", None), ("bfloat16", "int8"))


def _engine(spec: str, dtype: str, quantization: str | None, max_seqs: int):
    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model="random", random_weights=spec, dtype=dtype, device="cpu", kernels="torch",
                                  max_num_seqs=max_seqs, num_kv_blocks=512, enable_prefix_caching=False,
                                  quantization=quantization))


def cpu_decode(concurrency: list[int], steps: int, spec: str) -> None:
    from engine.core.sampling_params import SamplingParams

    engines = {f"{dtype}+{q}" if q else dtype: _engine(spec, dtype, q, max(concurrency)) for dtype, q in CPU_VARIANTS}
    for name, e in engines.items():
        total, experts = _weight_bytes(e.model)
        print(f"{name}: weights {total / 2**20:.0f} MiB, experts {experts / 2**20:.0f} MiB")
    vocab = next(iter(engines.values())).model_config.vocab_size
    print(f"{spec}\ntorch threads {torch.get_num_threads()}; decode tokens/s from the median step of {steps} steps, "
          "the engines stepping in turn")
    print(f"{'concurrency':>11} " + " ".join(f"{name:>14}" for name in engines))
    for conc in concurrency:
        rng = random.Random(conc)
        params = SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True)
        prompts = [[rng.randrange(1, vocab - 1) for _ in range(16)] for _ in range(conc)]
        ids = {name: [e.add_request(p, params) for p in prompts] for name, e in engines.items()}
        for e in engines.values():
            for _ in range(3):  # prefill, then warm decode steps
                e.step()
        times = {name: [] for name in engines}
        for _ in range(steps):
            for name, e in engines.items():
                start = time.perf_counter()
                e.step()
                times[name].append(time.perf_counter() - start)
        print(f"{conc:>11} " + " ".join(f"{conc / statistics.median(t):>14.1f}" for t in times.values()))
        for name, e in engines.items():
            for request_id in ids[name]:
                e.abort(request_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantized_experts", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("memory", help="weight bytes per preset, bf16 vs 8-bit experts")
    p = sub.add_parser("cpu-decode", help="CPU decode tokens/s, experts float vs int8, side by side")
    p.add_argument("--concurrency", default="1,8", help="comma-separated (default 1,8)")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per engine and concurrency")
    p.add_argument("--spec", default=CPU_SPEC, help="random-weights spec")
    args = parser.parse_args(argv)
    if args.command == "memory":
        memory()
    else:
        cpu_decode([int(c) for c in args.concurrency.split(",")], args.steps, args.spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
