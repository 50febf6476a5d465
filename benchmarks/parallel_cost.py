"""What tensor and expert parallelism cost per step: bytes each collective moves, and a predicted step time.

    python -m benchmarks.parallel_cost                     # the tables in docs/scaling.md
    python -m benchmarks.parallel_cost --measure-plan      # also time rank 0's plan broadcast here (2 gloo ranks)

A model, not a measurement of several GPUs. Per rank it counts the weights one
step must read and the FLOPs it must do (from the real per-rank module shapes,
built on the meta device), takes the larger of bytes / bandwidth and FLOPs /
peak as the floor, multiplies it by the time / floor ratio measured for the
same kind of step on one GPU (docs/performance.md), and adds each collective
at an assumed link bandwidth plus a fixed latency per collective. Expert loads
are the expectation under uniform routing (real routers are skewed: the
slowest rank sets the step). Legend: T tokens in the step, H hidden, k top-k,
E experts, N ranks.
"""

import argparse
import time
from dataclasses import dataclass

import torch

from engine.distributed.collectives import TensorParallel
from engine.distributed.expert_parallel import ExpertParallel
from engine.layers.moe import SparseMoeBlock
from engine.loading.random_weights import random_model_config
from engine.models import MODEL_REGISTRY

BF16 = 2
MODELS = {
    "Mixtral-8x7B": "mixtral-8x7b",
    # Qwen/Qwen3-235B-A22B's shape, as overrides of the 30B preset (same family).
    "Qwen3-235B-A22B": "qwen3-30b-a3b:hidden_size=4096,num_hidden_layers=94,num_attention_heads=64,"
                       "num_key_value_heads=4,num_experts=128,num_experts_per_tok=8,moe_intermediate_size=1536,"
                       "intermediate_size=12288",
}
# Measured on one H100 (docs/performance.md, "Engine on one GPU"): step time over its floor, per kind of step.
MEASURED_RATIO = {"decode C=1": 2.38, "decode C=32": 1.42, "decode C=256": 1.65, "prefill 8192": 2.85}
WORKLOADS = {  # name: (requests, tokens computed per request, context each reads)
    "decode C=1": (1, 1, 1024),
    "decode C=32": (32, 1, 1024),
    "decode C=256": (256, 1, 1024),
    "prefill 8192": (1, 8192, 0),
}


@dataclass(frozen=True, slots=True)
class Link:
    bandwidth: float  # bytes/s each rank moves through a collective (bus bandwidth)
    latency: float  # seconds of fixed cost per collective


@dataclass(frozen=True, slots=True)
class Device:
    bandwidth: float  # memory bytes/s
    peak: float  # bf16 FLOP/s


def shape_only_group(size: int, expert_parallel: bool) -> TensorParallel:
    """Rank 0 of ``size`` ranks, for building per-rank module shapes on the meta device (no collectives run)."""
    tp = TensorParallel.shape_only(size)
    if expert_parallel:
        tp.expert_parallel = ExpertParallel(tp)
    return tp


@dataclass(frozen=True, slots=True)
class RankShape:
    dense_params: int  # per rank, multiplied by every token (attention, norms, routers, dense MLPs, shared experts)
    lm_head_params: int
    expert_params: int  # one local expert (a 1/N slice under tensor parallelism, whole under expert parallelism)
    local_experts: int
    num_experts: int
    top_k: int
    moe_layers: int
    layers: int
    hidden: int
    vocab: int
    kv_bytes_per_token: int  # this rank's K and V of one token, all layers
    attn_flops_per_pair: int  # this rank's heads


def rank_shape(spec: str, size: int, expert_parallel: bool) -> RankShape:
    config = random_model_config(spec)
    tp = shape_only_group(size, expert_parallel)
    with torch.device("meta"):
        model = MODEL_REGISTRY[config.architecture](config, moe_backend="torch", max_positions=1, tp=tp)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    routed = sum(b.experts.w13.numel() + b.experts.w2.numel() for b in blocks)
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    total = sum(p.numel() for p in model.parameters())
    local = blocks[0].experts.w13.shape[0]
    attn = model.model.layers[0].self_attn
    return RankShape(
        dense_params=total - routed - embed.numel() - lm_head.numel(), lm_head_params=lm_head.numel(),
        expert_params=routed // (len(blocks) * local), local_experts=local, num_experts=blocks[0].expert_tokens.numel(),
        top_k=blocks[0].top_k, moe_layers=len(blocks), layers=config.num_layers, hidden=config.hidden_size,
        vocab=config.vocab_size, kv_bytes_per_token=2 * config.num_layers * attn.num_kv_heads * config.head_dim * BF16,
        attn_flops_per_pair=4 * config.num_layers * attn.num_heads * config.head_dim,
    )


def weights_gb(s: RankShape) -> float:
    return (s.dense_params + 2 * s.lm_head_params + s.moe_layers * s.local_experts * s.expert_params) * BF16 / 1e9


def compute_seconds(s: RankShape, n: int, expert_parallel: bool, requests: int, tokens: int, context: int,
                    device: Device) -> tuple[float, str]:
    """This rank's floor for one step (memory or compute bound, whichever is larger)."""
    t = requests * tokens
    hit = s.num_experts * (1 - (1 - s.top_k / s.num_experts) ** t)  # distinct experts a layer's tokens reach
    read_experts = hit * (s.local_experts / s.num_experts) if expert_parallel else hit  # of this rank's experts
    slots = t * s.top_k / n if expert_parallel else t * s.top_k  # token slots this rank's experts compute
    pairs = requests * (tokens * context + tokens * (tokens + 1) // 2)
    moved = ((s.dense_params + s.lm_head_params + s.moe_layers * read_experts * s.expert_params) * BF16
             + requests * (context + tokens) * s.kv_bytes_per_token)
    flops = (2 * t * s.dense_params + 2 * s.moe_layers * slots * s.expert_params + 2 * requests * s.lm_head_params
             + pairs * s.attn_flops_per_pair)
    memory, compute = moved / device.bandwidth, flops / device.peak
    return max(memory, compute), "memory" if memory >= compute else "compute"


def collectives(s: RankShape, n: int, expert_parallel: bool, t: int, logits: int) -> list[tuple[str, int, int]]:
    """(collective, bytes this rank moves, times per step) for one step of T tokens on N ranks."""
    if n == 1:
        return []
    row = s.hidden * BF16
    ring = 2 * (n - 1) / n  # an all-reduce moves this much of its buffer through each rank
    out = [("embedding all-reduce", int(ring * t * row), 1),
           ("attention all-reduce", int(ring * t * row), s.layers),
           ("logits all-gather", int((n - 1) / n * logits * s.vocab * BF16), 1)]
    dense_layers = s.layers - s.moe_layers
    if dense_layers:
        out.append(("dense MLP all-reduce", int(ring * t * row), dense_layers))
    if not expert_parallel:
        out.append(("MoE all-reduce", int(ring * t * row), s.moe_layers))
        return out
    leaving = t * s.top_k / n * (n - 1) / n  # slots of this rank's token share bound for other ranks
    out += [("MoE slot counts all-to-all", 8 * n, s.moe_layers),
            ("MoE dispatch all-to-all (rows + expert ids)", int(leaving * (row + 4)), s.moe_layers),
            ("MoE combine all-to-all", int(leaving * row), s.moe_layers),
            ("MoE token shares all-gather", int((n - 1) / n * t * row), s.moe_layers)]
    return out


def predict(name: str, spec: str, n: int, expert_parallel: bool, device: Device, link: Link) -> list[dict]:
    s = rank_shape(spec, n, expert_parallel)
    rows = []
    for workload, (requests, tokens, context) in WORKLOADS.items():
        floor, bound = compute_seconds(s, n, expert_parallel, requests, tokens, context, device)
        comm = collectives(s, n, expert_parallel, requests * tokens, requests)
        comm_bytes = sum(b * k for _, b, k in comm)
        comm_s = sum(k * (link.latency + b / link.bandwidth) for _, b, k in comm)
        step = floor * MEASURED_RATIO[workload] + comm_s
        rows.append(dict(model=name, ranks=n, mode="TP+EP" if expert_parallel else "TP", workload=workload,
                         weights_gb=weights_gb(s), floor_ms=floor * 1e3, bound=bound, comm_mb=comm_bytes / 1e6,
                         collectives=sum(k for _, _, k in comm), comm_ms=comm_s * 1e3, step_ms=step * 1e3,
                         tok_s=requests * tokens / step, per_layer=comm))
    return rows


def print_tables(rows: list[dict]) -> None:
    print("| model | ranks | mode | weights GB/rank | workload | floor ms (bound) | collectives/step | "
          "MB moved/rank | comm ms | predicted ms/step | tok/s |")
    print("|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['ranks']} | {r['mode']} | {r['weights_gb']:.1f} | {r['workload']} | "
              f"{r['floor_ms']:.2f} ({r['bound']}) | {r['collectives']} | {r['comm_mb']:.2f} | {r['comm_ms']:.2f} | "
              f"{r['step_ms']:.2f} | {r['tok_s']:,.0f} |")


def print_per_layer(rows: list[dict]) -> None:
    print("\nBytes one rank moves per collective (each row runs `times` per step):\n")
    print("| model | ranks | mode | workload | collective | bytes/rank | times |")
    print("|---|---:|---|---|---|---:|---:|")
    for r in rows:
        if r["workload"] in ("decode C=32", "prefill 8192"):
            for what, b, k in r["per_layer"]:
                print(f"| {r['model']} | {r['ranks']} | {r['mode']} | {r['workload']} | {what} | {b:,} | {k} |")


def _time_plan(rank: int, world: int, address: str, sizes: list[int], repeats: int) -> dict[int, float]:
    from engine.core.scheduler import ScheduledRequest
    from engine.distributed.groups import RankGroups, RankInfo

    groups = RankGroups(RankInfo(rank, world, rank, address), torch.device("cpu"), timeout_s=60)
    tp = TensorParallel(groups)
    out = {}
    for c in sizes:
        # A decode step of C requests with 1,024-token contexts: 64 block ids each, one new token.
        plan = [ScheduledRequest(None, 1, list(range(i * 64, i * 64 + 64)), True, 1024, [7]) for i in range(c)]
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            tp.broadcast_object(plan if rank == 0 else None)
            times.append(time.perf_counter() - start)
        out[c] = sorted(times)[len(times) // 2] * 1e3
    groups.close()
    return out


def measure_plan_broadcast(sizes=(1, 32, 256), repeats=50) -> dict[int, float]:
    from tests.distributed.ranks import run_ranks  # the benchmark reuses the test harness's rank launcher

    results = run_ranks(_time_plan, 2, list(sizes), repeats, timeout_s=120)
    status, value = results[0]
    if status != "ok":
        raise RuntimeError(value)
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bandwidth-gbs", type=float, default=3022, help="memory bandwidth (measured on one H100)")
    p.add_argument("--peak-tflops", type=float, default=808.6, help="bf16 peak (measured on one H100)")
    p.add_argument("--link-gbs", type=float, default=360, help="assumed collective bus bandwidth per rank (NVLink)")
    p.add_argument("--latency-us", type=float, default=20, help="assumed fixed cost per collective")
    p.add_argument("--measure-plan", action="store_true", help="time the step plan's broadcast on 2 gloo ranks here")
    args = p.parse_args()
    device = Device(args.bandwidth_gbs * 1e9, args.peak_tflops * 1e12)
    link = Link(args.link_gbs * 1e9, args.latency_us * 1e-6)
    rows = []
    for name, spec, sizes in (("Mixtral-8x7B", MODELS["Mixtral-8x7B"], (1, 2)),
                              ("Qwen3-235B-A22B", MODELS["Qwen3-235B-A22B"], (8,))):
        for n in sizes:
            rows += predict(name, spec, n, False, device, link)
            if n > 1:
                rows += predict(name, spec, n, True, device, link)
    print_tables(rows)
    print_per_layer(rows)
    if args.measure_plan:
        print("\nRank 0's plan broadcast (pickled, gloo over loopback, 2 ranks), median ms:")
        for c, ms in measure_plan_broadcast().items():
            print(f"  decode step of {c} requests: {ms:.3f} ms")


if __name__ == "__main__":
    main()
