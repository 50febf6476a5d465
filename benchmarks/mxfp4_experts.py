"""gpt-oss's routed experts in MXFP4 against bf16 and 8 bits: weight memory (arithmetic, any machine) and the
fused MoE kernel's tokens/s at gpt-oss-20b's expert shape (CUDA), every mode in one run.

    python -m benchmarks.mxfp4_experts memory                 # bytes of expert weights per mode, gpt-oss-20b/120b
    python -m benchmarks.mxfp4_experts kernel --tokens 1,8,64,512 --rounds 5

``memory``: the gpt-oss presets built on the meta device as the engine builds them (``build_random_model`` with
each ``--quantization``), bytes of the routed experts (weights, scales, biases) summed from each parameter's numel
and element size.

``kernel``: one MoE layer of gpt-oss-20b (E=32, top-4, H=I=2880, clamped SwiGLU, biases) through
``moe_kernels.fused_moe`` on the Triton backend, experts bf16, int8, fp8 and mxfp4 (each quantized from the same
bf16 weights); per token count the modes are timed in turn (CUDA graphs, weights flushed from L2 before each
call), ``--rounds`` times; median and range of tokens/s per mode.
"""

import argparse
import statistics
import sys

import torch

MODES = (None, "int8", "fp8", "mxfp4")  # None: bf16 experts
SHAPE_20B = dict(num_experts=32, top_k=4, hidden=2880, inter=2880)


def _expert_bytes(model: torch.nn.Module) -> int:
    from engine.layers.moe import ExpertWeights

    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, ExpertWeights)
               for p in m.parameters())


def memory() -> None:
    from engine.loading.quantization import scheme_for_option
    from engine.loading.random_weights import build_random_model, random_model_config

    print("routed-expert bytes (weights, scales and biases), GiB; ratio to bf16")
    for preset in ("gpt-oss-20b", "gpt-oss-120b"):
        base = None
        cells = []
        for mode in MODES:
            scheme = scheme_for_option(mode) if mode else None
            model = build_random_model(random_model_config(preset), torch.bfloat16, torch.device("meta"), "torch", 1,
                                       quantization=scheme)
            n = _expert_bytes(model)
            base = base or n
            cells.append(f"{mode or 'bf16'} {n / 2**30:.2f} ({n / base:.3f}x)")
        print(f"  {preset:14} " + ", ".join(cells))


def _layer(mode: str | None, device: torch.device, seed: int = 0) -> dict:
    from moe_kernels.quant import QuantScheme, quantize

    e, h, i = SHAPE_20B["num_experts"], SHAPE_20B["hidden"], SHAPE_20B["inter"]
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(e, h, i, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    args = dict(w13_bias=torch.randn(e, 2 * i, device=device, dtype=torch.bfloat16, generator=gen),
                w2_bias=torch.randn(e, h, device=device, dtype=torch.bfloat16, generator=gen),
                activation="clamped_swiglu")
    if mode is not None:
        scheme = QuantScheme(mode)
        (w13, args["w13_scale"]), (w2, args["w2_scale"]) = quantize(w13, scheme, 2), quantize(w2, scheme)
    return dict(w13=w13, w2=w2, args=args, bytes=sum(t.numel() * t.element_size() for t in (w13, w2)))


def kernel(tokens: list[int], rounds: int) -> None:
    import moe_kernels
    from moe_kernels.timing import capture_graph, median_ms

    device = torch.device("cuda")
    layers = {mode or "bf16": _layer(mode, device) for mode in MODES}
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
    h, e, k = SHAPE_20B["hidden"], SHAPE_20B["num_experts"], SHAPE_20B["top_k"]
    print(torch.cuda.get_device_name(device), f"gpt-oss-20b expert layer: E={e} top-{k} H=I={h}")
    for name, layer in layers.items():
        print(f"  {name}: expert weight bytes {layer['bytes'] / 2**20:.0f} MiB")
    print(f"{'tokens':>6} " + " ".join(f"{name + ' tok/s (range)':>30}" for name in layers))
    for t in tokens:
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
        weights, ids = moe_kernels.route(torch.randn(t, e, device=device), k, renormalize=True)
        calls = {}
        for name, layer in layers.items():
            def call(layer=layer):
                return moe_kernels.fused_moe(x, layer["w13"], layer["w2"], weights, ids, backend="triton",
                                             **layer["args"])
            graph = capture_graph(call, device)
            calls[name] = graph.replay if graph is not None else call
        times = {name: [] for name in layers}
        for _ in range(rounds):  # modes in turn, so drifting clocks fall on all
            for name, fn in calls.items():
                times[name].append(median_ms(fn, device, reps=20, warmup=3, flush=flush))
        cells = []
        for name, ms in times.items():
            rates = sorted(t / (m / 1e3) for m in ms)
            cells.append(f"{statistics.median(rates):>12.0f} ({rates[0]:.0f}-{rates[-1]:.0f})")
        print(f"{t:>6} " + " ".join(f"{c:>30}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mxfp4_experts", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("memory", help="bytes of expert weights per mode (any machine)")
    p = sub.add_parser("kernel", help="fused MoE tokens/s per mode at gpt-oss-20b's expert shape (CUDA)")
    p.add_argument("--tokens", default="1,8,64,512", help="comma-separated token counts (default 1,8,64,512)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of all modes per token count (default 5)")
    args = parser.parse_args(argv)
    if args.command == "memory":
        memory()
    elif not torch.cuda.is_available():
        print("kernel needs CUDA", file=sys.stderr)
        return 2
    else:
        kernel([int(t) for t in args.tokens.split(",")], args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
