"""Benchmark the routed-expert backends on real MoE layer shapes: ``python -m benchmarks.moe_backends``.

Legend: T tokens, H hidden, I expert intermediate, E experts, k top-k, S = T*k slots.

For each model shape and token count (bfloat16, random routing) it times the
Triton backend, the torch per-expert loop and ``torch._grouped_mm`` (where this
torch has it) with CUDA events (median of ``--reps``, L2 flushed by a read before each
call; Triton and grouped_mm as CUDA-graph replays, as the engine's decode
graphs run them, the host-syncing torch loop eagerly), and reports achieved TFLOP/s and GB/s next to the peaks measured in the
same run: a large bf16 ``torch.matmul`` and a large device-to-device copy.
GB/s counts only expert weight bytes actually read (experts that received at
least one token); activations are left out, so at large T the GB/s column
understates traffic and TFLOP/s is the column to read.

``--smoke`` runs the same code path on tiny shapes on the CPU, with Triton's
interpreter and ``time.perf_counter``: numbers are meaningless, it only proves
the script runs end to end. Without CUDA and without ``--smoke`` it exits 2.
"""

import argparse
import functools
import json
import os
import sys
from dataclasses import asdict, dataclass, replace

import torch

from moe_kernels.routing import route
from moe_kernels.timing import capture_graph, median_ms
from moe_kernels.grouped_backend import fused_moe_grouped
from moe_kernels.torch_backend import fused_moe_loop


@dataclass(frozen=True, slots=True)
class MoeShape:
    name: str
    E: int
    k: int
    H: int
    I: int  # noqa: E741 (the legend's letter)


MODELS = (
    MoeShape("mixtral-8x7b", E=8, k=2, H=4096, I=14336),
    MoeShape("qwen3-30b-a3b", E=128, k=8, H=2048, I=768),
    MoeShape("olmoe-1b-7b", E=64, k=8, H=2048, I=1024),
)
TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
GRAPH_BACKENDS = ("triton", "grouped_mm")  # host-sync free: timed as CUDA graph replays

SMOKE_MODELS = (MoeShape("tiny-8x2", E=8, k=2, H=64, I=32), MoeShape("tiny-16x4", E=16, k=4, H=32, I=48))
SMOKE_TOKENS = (1, 16, 40)


@dataclass(frozen=True, slots=True)
class Profile:
    """Sizes of one run: the real benchmark or the CPU smoke run."""

    models: tuple[MoeShape, ...]
    tokens: tuple[int, ...]
    reps: int
    warmup: int
    peak_matmul_n: int  # n of the n x n x n matmul that measures peak TFLOP/s
    copy_bytes: int  # size of the buffer copied to measure bandwidth
    flush_bytes: int  # L2 flush buffer, read before each timed call (0: none)


GPU_PROFILE = Profile(MODELS, TOKENS, reps=20, warmup=3, peak_matmul_n=8192, copy_bytes=2 << 30, flush_bytes=256 << 20)
SMOKE_PROFILE = Profile(SMOKE_MODELS, SMOKE_TOKENS, reps=2, warmup=1, peak_matmul_n=256, copy_bytes=16 << 20, flush_bytes=0)


def _matmul_tflops(profile: Profile, device: torch.device, dtype: torch.dtype) -> float:
    n = profile.peak_matmul_n
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    ms = median_ms(lambda: torch.matmul(a, b), device, profile.reps, profile.warmup)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def _copy_gbps(profile: Profile, device: torch.device) -> float:
    src = torch.empty(profile.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, profile.reps, profile.warmup)
    return 2 * profile.copy_bytes / (ms * 1e-3) / 1e9  # a copy reads and writes every byte


def measure_peaks(profile: Profile, device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(dense matmul TFLOP/s, copy GB/s) measured on this device now; buffers are freed on return."""
    return _matmul_tflops(profile, device, dtype), _copy_gbps(profile, device)


def backends() -> dict:
    """name -> fused-MoE callable; ``torch._grouped_mm`` only where this torch has it."""
    from moe_kernels.triton_backend import fused_moe_triton

    fns = {"triton": fused_moe_triton, "torch-loop": fused_moe_loop}
    if hasattr(torch, "_grouped_mm"):
        fns["grouped_mm"] = fused_moe_grouped  # the torch backend's grouped path, where the device and dtype allow
    return fns


def bench_shape(shape: MoeShape, num_tokens: int, profile: Profile, device: torch.device, dtype: torch.dtype,
                weights: tuple[torch.Tensor, torch.Tensor], flush: torch.Tensor | None) -> list[dict]:
    """Time every backend on one (shape, T); one record per backend."""
    w13, w2 = weights
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, shape.H, device=device, dtype=dtype, generator=gen)  # [T, H]
    logits = torch.randn(num_tokens, shape.E, device=device, generator=gen)  # [T, E]
    topk_weights, topk_ids = route(logits, shape.k, renormalize=True)  # [T, k]
    active = int(torch.unique(topk_ids).numel())
    flops = 6 * num_tokens * shape.k * shape.H * shape.I  # 2*S*H*2I + 2*S*I*H, activation ignored
    weight_bytes = active * 3 * shape.H * shape.I * w13.element_size()
    reference = fused_moe_loop(x, w13, w2, topk_weights, topk_ids).float()
    records = []
    for name, fn in backends().items():
        record = dict(model=shape.name, T=num_tokens, backend=name, active_experts=active)
        try:
            err = (fn(x, w13, w2, topk_weights, topk_ids).float() - reference).norm() / reference.norm().clamp_min(1e-30)
            call = functools.partial(fn, x, w13, w2, topk_weights, topk_ids)
            # The torch loop reads expert counts on the host: it cannot be captured, so it is timed eagerly.
            graph = capture_graph(call, device) if name in GRAPH_BACKENDS else None
            ms = median_ms(graph.replay if graph else call, device, profile.reps, profile.warmup, flush)
            timing = "graph" if graph is not None else "eager"
            del graph
        except Exception as e:  # a backend this torch/GPU cannot run is reported, not fatal
            records.append({**record, "error": f"{type(e).__name__}: {e}".splitlines()[0][:120]})
            continue
        records.append({**record, "timing": timing,
                        "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12,
                        "gbps": weight_bytes / (ms * 1e-3) / 1e9, "rel_err_vs_torch": float(err)})
    return records


def run(profile: Profile, device: torch.device, dtype: torch.dtype) -> dict:
    """Measure peaks, then every model x token count x backend; returns everything as plain data."""
    peak_tflops, peak_gbps = measure_peaks(profile, device, dtype)
    flush = torch.ones(profile.flush_bytes, dtype=torch.uint8, device=device) if profile.flush_bytes else None
    records = []
    for shape in profile.models:
        gen = torch.Generator(device=device).manual_seed(0)
        w13 = torch.randn(shape.E, 2 * shape.I, shape.H, device=device, dtype=dtype, generator=gen) / shape.H**0.5  # [E, 2I, H]
        w2 = torch.randn(shape.E, shape.H, shape.I, device=device, dtype=dtype, generator=gen) / shape.I**0.5  # [E, H, I]
        for num_tokens in profile.tokens:
            records += bench_shape(shape, num_tokens, profile, device, dtype, (w13, w2), flush)
        del w13, w2
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for r in records:
        if "ms" in r:
            r["pct_peak_flops"] = 100 * r["tflops"] / peak_tflops
            r["pct_peak_bw"] = 100 * r["gbps"] / peak_gbps
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter smoke run)"
    return dict(device=name, dtype=str(dtype).removeprefix("torch."), peak_tflops=peak_tflops, peak_gbps=peak_gbps,
                models=[asdict(m) for m in profile.models], records=records)


def format_table(result: dict) -> str:
    lines = [
        f"device: {result['device']}  dtype: {result['dtype']}  measured peaks: "
        f"{result['peak_tflops']:.1f} TFLOP/s (dense matmul), {result['peak_gbps']:.0f} GB/s (device copy)",
        "GB/s = expert weight bytes of experts that received tokens / time",
        f"{'model':<15} {'T':>6} {'backend':<11} {'experts':>7} {'ms':>9} {'TFLOP/s':>8} {'%peak':>6} "
        f"{'GB/s':>7} {'%bw':>5} {'rel err':>8} timing",
    ]
    for r in result["records"]:
        head = f"{r['model']:<15} {r['T']:>6} {r['backend']:<11} {r['active_experts']:>7}"
        if "error" in r:
            lines.append(f"{head} n/a: {r['error']}")
        else:
            lines.append(f"{head} {r['ms']:>9.3f} {r['tflops']:>8.1f} {r['pct_peak_flops']:>6.1f} "
                         f"{r['gbps']:>7.0f} {r['pct_peak_bw']:>5.1f} {r['rel_err_vs_torch']:>8.1e} {r['timing']}")
    return "\n".join(lines)


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _model_names(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    unknown = sorted(set(names) - {m.name for m in MODELS})
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown model {unknown[0]!r}; known: {', '.join(m.name for m in MODELS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_backends", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--tokens", type=_positive_ints, help="comma-separated token counts (default: 1,16,64,256,1024,4096,16384)")
    parser.add_argument("--reps", type=lambda v: _positive_ints(v)[0], help="timed calls per measurement (median is reported)")
    parser.add_argument("--models", type=_model_names,
                        help=f"comma-separated model shapes (default: all of {', '.join(m.name for m in MODELS)})")
    parser.add_argument("--out", metavar="PATH", help="also write the JSON to PATH (the table is still printed)")
    args = parser.parse_args(argv)

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton_backend is imported (in backends())
        profile, device = SMOKE_PROFILE, torch.device("cpu")
    elif not torch.cuda.is_available():
        print("benchmarks.moe_backends needs a CUDA GPU (use --smoke for a CPU dry run of the same code)", file=sys.stderr)
        return 2
    else:
        profile, device = GPU_PROFILE, torch.device("cuda")
    if args.tokens:
        profile = replace(profile, tokens=args.tokens)
    if args.reps:
        profile = replace(profile, reps=args.reps)
    if args.models and not args.smoke:
        profile = replace(profile, models=tuple(m for m in MODELS if m.name in args.models))

    with torch.inference_mode():
        result = run(profile, device, torch.bfloat16)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
