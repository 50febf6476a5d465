"""gpt-oss's routed experts in MXFP4 (and in INT4, Kimi-K2.5's format) against bf16 and 8 bits: weight memory (arithmetic, any machine) and the
fused MoE kernel's tokens/s at gpt-oss-20b's expert shape (CUDA), every mode in one run.

    python -m benchmarks.mxfp4_experts memory                 # bytes of expert weights per mode, gpt-oss-20b/120b
    python -m benchmarks.mxfp4_experts kernel --tokens 1,8,64,512 --rounds 5 [--planes] [--swap 1,4] [--modes ..]
    python -m benchmarks.mxfp4_experts resources [--tokens 1,8,64,512] [--gemv [--planes]]   # no GPU: sm_90 code
    python -m benchmarks.mxfp4_experts resources --modes mxfp4 --tokens 8,64,512 --swap 1   # swapped operands

``memory``: the gpt-oss presets built on the meta device as the engine builds them (``build_random_model`` with
each ``--quantization``), bytes of the routed experts (weights, scales, biases) summed from each parameter's numel
and element size.

``resources``: the launches ``fused_moe_triton`` makes at gpt-oss-20b's expert shape on an H100 (its launch configs,
its argument specialization), each compiled for sm_90 on this machine: registers, spilled bytes, shared memory, and
the SASS instructions (all, and global loads) of each kernel, and those of its K loop, also per weight value a step
reads (``per_value``: the decode's cost, where a 4-bit layer is bound by it). Run the file with ``PYTHONPATH`` at
another checkout (or another Triton) to compare its kernels.

``kernel``: one MoE layer of gpt-oss-20b (E=32, top-4, H=I=2880, clamped SwiGLU, biases) through
``moe_kernels.fused_moe`` on the Triton backend, experts bf16, int8, fp8, mxfp4 and int4 (each quantized from the
same bf16 weights; int4 as Kimi's checkpoints store it, ``moe_kernels.int4``); per token count the modes are timed in turn (CUDA graphs, weights flushed from L2 before each
call), ``--rounds`` times; median and range of tokens/s per mode. ``--planes`` adds mxfp4 and int4 with the
launch config they look up but its 4-bit decode forced to tiles in K order and to nibble planes
(``moe_kernels.planes_triton``), both kernels, in the same rounds: an A/B of the decode in one process.
``--swap 1,4`` adds mxfp4 with the launch config it looks up forced onto the swapped-operand grouped GEMMs
(``moe_kernels.swapped_triton``) with each SPLIT_K listed (``swapped``: a matrix-vector config's tiles as grouped
GEMM tiles, slots sorted by expert, at least 64 weight rows and at most 128 values along K a tile), "mxfp4/swap-k1", "mxfp4/swap-k4", in the same
rounds; ``--modes`` keeps only the modes listed (bf16, int8, fp8, mxfp4, int4). ``resources --swap N`` compiles the
same forced launch (SPLIT_K N; the split-K sums, an elementwise second pass, are left out of the table).
"""

import argparse
import dataclasses
import os
import re
import statistics
import subprocess
import sys
import tempfile

import torch

MODES = (None, "int8", "fp8", "mxfp4", "int4")  # None: bf16 experts
SWAP_MIN_BLOCK_N = 64  # weight rows of a swapped tile: wgmma's M per warp group on sm_90
SWAP_MAX_BLOCK_K = 128  # the tuner's largest swapped step (tune_moe.SWAP_SPACES): the decoded tile stays in registers
SHAPE_20B = dict(num_experts=32, top_k=4, hidden=2880, inter=2880)


def _expert_bytes(model: torch.nn.Module) -> int:
    from engine.layers.moe import ExpertWeights

    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, ExpertWeights)
               for p in m.parameters())


def memory() -> None:
    from engine.loading.random_weights import build_random_model, random_model_config
    from moe_kernels.quant import QuantScheme

    print("routed-expert bytes (weights, scales and biases), GiB; ratio to bf16")
    for preset in ("gpt-oss-20b", "gpt-oss-120b"):
        base = None
        cells = []
        for mode in MODES:
            scheme = QuantScheme(mode) if mode else None
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


def _decode_variants(layers: dict) -> dict:
    """Each 4-bit layer twice more, as "<mode>/tiles" and "<mode>/planes": the launch config looked up with
    ``PLANES`` forced off and on in both kernels (they differ where that config takes the matrix-vector path)."""
    return {f"{name}/{variant}": {**layer, "planes": variant == "planes"} for name, layer in layers.items()
            if name in ("mxfp4", "int4") for variant in ("tiles", "planes")}


def swapped(config, split_k: int):
    """``config`` (a ``LaunchConfig``) forced onto the swapped-operand grouped GEMMs with ``split_k``: a
    matrix-vector config's tiles as grouped ones, slots sorted by expert, BLOCK_N at least SWAP_MIN_BLOCK_N and
    BLOCK_K at most SWAP_MAX_BLOCK_K, a warp group (4 warps) at most per 64 weight rows (more would hold copies of
    the same decoded rows: compiled for sm_90, w2 at one token with 8 warps took twice the instructions per value)."""
    from moe_kernels.launch_config import as_grouped

    def force(gemm):
        rows = max(gemm.BLOCK_N, SWAP_MIN_BLOCK_N)
        return dataclasses.replace(gemm, BLOCK_N=rows, BLOCK_K=min(gemm.BLOCK_K, SWAP_MAX_BLOCK_K),
                                   num_warps=min(gemm.num_warps, 4 * rows // SWAP_MIN_BLOCK_N), PLANES=False,
                                   SWAP=True, SPLIT_K=split_k)

    config = as_grouped(config)
    return dataclasses.replace(config, align=True, w13=force(config.w13), w2=force(config.w2))


def _swap_variants(layers: dict, split_ks: list[int]) -> dict:
    """The mxfp4 layer once more per SPLIT_K, as "mxfp4/swap-k<n>": its looked-up config forced by ``swapped``."""
    return {f"mxfp4/swap-k{n}": {**layers["mxfp4"], "swap": n} for n in split_ks}


def _call(x, layer: dict, weights, ids):
    import moe_kernels
    from moe_kernels.triton_backend import default_config, fused_moe_triton

    if "planes" not in layer and "swap" not in layer:  # as the engine calls it
        return moe_kernels.fused_moe(x, layer["w13"], layer["w2"], weights, ids, backend="triton", **layer["args"])
    config = default_config(x, layer["w13"])
    if "swap" in layer:
        config = swapped(config, layer["swap"])
    else:
        config = dataclasses.replace(config, w13=dataclasses.replace(config.w13, PLANES=layer["planes"]),
                                     w2=dataclasses.replace(config.w2, PLANES=layer["planes"]))
    return fused_moe_triton(x, layer["w13"], layer["w2"], weights, ids, config=config, **layer["args"])


def kernel(tokens: list[int], rounds: int, planes: bool = False, modes: tuple = MODES,
           swap: list[int] | None = None) -> None:
    import moe_kernels
    from moe_kernels.timing import capture_graph, median_ms

    device = torch.device("cuda")
    layers = {mode or "bf16": _layer(mode, device) for mode in modes}
    if planes:
        layers.update(_decode_variants(layers))
    if swap:
        layers.update(_swap_variants(layers, swap))
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
                return _call(x, layer, weights, ids)
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


H100_NAME = "NVIDIA H100 80GB HBM3"  # the device name launch configs are looked up by


# The matrix-vector launch tuned for one token on an H100 (moe_kernels/configs/E=64,N=2048,K=2048,...): ``--gemv``.
GEMV_LAUNCH = dict(align=False, BLOCK_M=16, gemv=True,
                   w13=dict(BLOCK_N=16, BLOCK_K=128, GROUP_M=1, num_warps=8, num_stages=4),
                   w2=dict(BLOCK_N=16, BLOCK_K=512, GROUP_M=1, num_warps=8, num_stages=2))


def _capture_launches(mode: str | None, num_tokens: int, config: dict | None = None,
                      swap: int | None = None) -> list[tuple]:
    """(kernel, args, kwargs) of each launch ``fused_moe_triton`` makes for one call at gpt-oss-20b's expert shape on
    an H100, recorded instead of launched: CPU tensors of the real shapes (never read), the kernels compiled (not
    interpreted), the launch config an H100 looks up (or ``config``, a ``LaunchConfig`` as a dict), for mxfp4 with
    ``swap`` forced onto the swapped-operand kernels with that SPLIT_K (``swapped``)."""
    from moe_kernels.launch_config import LaunchConfig
    from moe_kernels import gemv_kernels, swapped_triton, triton_backend
    from moe_kernels import int4
    from moe_kernels.mxfp4 import scale_shape as mxfp4_scale_shape
    from moe_kernels.quant import QuantScheme, scale_shape

    if triton_backend.INTERPRETED:
        raise RuntimeError("resources compiles the kernels: run it without TRITON_INTERPRET=1")
    e, h, i, k = SHAPE_20B["num_experts"], SHAPE_20B["hidden"], SHAPE_20B["inter"], SHAPE_20B["top_k"]
    bf16 = torch.bfloat16
    shapes = {"w13": (e, 2 * i, h), "w2": (e, h, i)}
    args = dict(w13_bias=torch.empty(e, 2 * i, dtype=bf16), w2_bias=torch.empty(e, h, dtype=bf16),
                activation="clamped_swiglu")
    weights = {}
    for name, shape in shapes.items():
        if mode is None:
            weights[name] = torch.empty(shape, dtype=bf16)
            continue
        scheme = QuantScheme(mode)
        weights[name] = torch.empty(scheme.stored_shape(shape), dtype=scheme.dtype)
        if mode == "mxfp4":
            args[f"{name}_scale"] = torch.empty(mxfp4_scale_shape(shape), dtype=torch.uint8)
        elif mode == "int4":
            args[f"{name}_scale"] = torch.empty(int4.scale_shape(shape), dtype=bf16)
        else:
            args[f"{name}_scale"] = torch.empty(scale_shape(shape, None), dtype=torch.float32)
    x = torch.empty(num_tokens, h, dtype=bf16)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(num_tokens)]).to(torch.int32)
    topk_weights = torch.full((num_tokens, k), 1.0 / k)

    launches = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append((self.fn, a, kw))

    patches = [(triton_backend, "_check_inputs", lambda *a: None),
               (triton_backend, "_device_name", lambda device: H100_NAME)]
    patches += [(module, name, Recorder(getattr(module, name))) for module, name in
                ((triton_backend, "_w13_act_kernel"), (triton_backend, "_w2_weighted_kernel"),
                 (gemv_kernels, "w13_gemv_kernel"), (gemv_kernels, "w2_gemv_sum_kernel"),
                 (swapped_triton, "w13_swapped_kernel"), (swapped_triton, "w2_swapped_kernel"),
                 (swapped_triton, "w13_split_sum_kernel"), (swapped_triton, "w2_split_sum_kernel"))]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        launch = LaunchConfig.from_dict(config) if config else None
        if swap is not None and mode == "mxfp4":  # the swapped kernels take MXFP4 weights alone
            launch = swapped(launch or triton_backend.default_config(x, weights["w13"]), swap)
        triton_backend.fused_moe_triton(x, weights["w13"], weights["w2"], topk_weights, ids, config=launch, **args)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
    return launches


def _sm90_resources(fn, args: tuple, kwargs: dict) -> dict:
    """Compile one recorded launch for sm_90 as the runtime would (its argument specialization: 16-byte aligned
    pointers, integers divisible by 16) and read the cubin's resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage))
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    c = dict(bound)
    loop = _k_loop_instructions(sass)
    tiles = 2 if "w13" in fn.fn.__name__ else 1  # w13's programs read a gate and an up tile per step
    threads = 32 * kwargs.get("num_warps", 4)
    return dict(kernel=fn.fn.__name__, QUANT=c.get("QUANT"), BLOCK_M=c.get("BLOCK_M"), BLOCK_N=c["BLOCK_N"],
                BLOCK_K=c["BLOCK_K"], PLANES=c.get("PLANES"), SPLIT=c.get("SPLIT"), warps=kwargs.get("num_warps"),
                stages=kwargs.get("num_stages"), registers=int(found["REG"]),
                spill_bytes=int(found["LOCAL"]) + int(found["STACK"]), shared_bytes=compiled.metadata.shared,
                sass=len(ops), global_loads=sum(op.startswith("LDG") for op in ops), k_loop=loop,
                per_value=round(loop * threads / (tiles * c["BLOCK_N"] * c["BLOCK_K"]), 2))


def _k_loop_instructions(sass: str) -> int:
    """SASS instructions of the innermost loop (the K loop): the shortest span a backward branch closes, of more
    than 20 instructions (shorter ones are the compiler's spin loops). Per thread and step, so per weight value
    it is this times the threads over the values a step reads (``per_value``)."""
    lines = re.findall(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", sass)
    index = {int(address, 16): i for i, (address, _) in enumerate(lines)}
    spans = []
    for i, (address, text) in enumerate(lines):
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) <= int(address, 16) and int(target.group(1), 16) in index:
            spans.append(i - index[int(target.group(1), 16)] + 1)
    return min((n for n in spans if n > 20), default=0)


def resources(tokens: list[int], modes: tuple = (None, "int8", "mxfp4", "int4"), config: dict | None = None,
              swap: int | None = None) -> list[dict]:
    rows = []
    for mode in modes:
        for t in tokens:
            for fn, args, kwargs in _capture_launches(mode, t, config, swap):
                if "BLOCK_K" not in kwargs:
                    continue  # the split-K sums: elementwise, no K loop
                rows.append(dict(mode=mode or "bf16", tokens=t, **_sm90_resources(fn, args, kwargs)))
    return rows


def _modes(names: str) -> tuple:
    """--modes as MODES' entries (bf16 is None), refusing an unknown one."""
    modes = tuple(None if name == "bf16" else name for name in names.split(","))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; known: bf16, {', '.join(m for m in MODES if m)}")
    return modes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mxfp4_experts", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("memory", help="bytes of expert weights per mode (any machine)")
    p = sub.add_parser("kernel", help="fused MoE tokens/s per mode at gpt-oss-20b's expert shape (CUDA)")
    p.add_argument("--tokens", default="1,8,64,512", help="comma-separated token counts (default 1,8,64,512)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of all modes per token count (default 5)")
    p.add_argument("--planes", action="store_true", help="also mxfp4 and int4 with the looked-up launch config's "
                   "4-bit decode forced to tiles and to nibble planes (PLANES), timed in the same rounds")
    p.add_argument("--swap", help="comma-separated SPLIT_K values: also mxfp4 with the looked-up launch config forced "
                   "onto the swapped-operand grouped GEMMs with each, timed in the same rounds")
    p.add_argument("--modes", default="bf16,int8,fp8,mxfp4,int4", help="comma-separated modes (default all)")
    p = sub.add_parser("resources", help="registers, spills, shared memory, SASS of the sm_90 kernels (no GPU)")
    p.add_argument("--tokens", default="1,8,64,512", help="comma-separated token counts (default 1,8,64,512)")
    p.add_argument("--gemv", action="store_true", help="the matrix-vector launch tuned for one token (GEMV_LAUNCH)")
    p.add_argument("--planes", action="store_true", help="with --gemv: 4-bit weights decoded as nibble planes")
    p.add_argument("--swap", type=int, help="SPLIT_K: the looked-up (or --gemv) launch forced onto the "
                   "swapped-operand grouped GEMMs (MXFP4 weights)")
    p.add_argument("--modes", default="bf16,int8,mxfp4,int4", help="comma-separated modes (default bf16,int8,mxfp4,"
                   "int4)")
    args = parser.parse_args(argv)
    if args.command == "memory":
        memory()
    elif args.command == "resources":
        config = None
        if args.gemv:
            config = {**GEMV_LAUNCH, **{g: {**GEMV_LAUNCH[g], "PLANES": args.planes} for g in ("w13", "w2")}}
        for r in resources([int(t) for t in args.tokens.split(",")], _modes(args.modes), config, args.swap):
            print(f"{r['mode']:>5} T={r['tokens']:<4} {r['kernel']:<20} QUANT={r['QUANT']} BLOCK_M={r['BLOCK_M']} "
                  f"N={r['BLOCK_N']} K={r['BLOCK_K']} PLANES={r['PLANES']} SPLIT={r['SPLIT']} warps={r['warps']} stages={r['stages']}: "
                  f"registers={r['registers']} spilled={r['spill_bytes']} shared={r['shared_bytes']} "
                  f"sass={r['sass']} global_loads={r['global_loads']} k_loop={r['k_loop']} "
                  f"per_value={r['per_value']}")
    elif not torch.cuda.is_available():
        print("kernel needs CUDA", file=sys.stderr)
        return 2
    else:
        swap = [int(n) for n in args.swap.split(",")] if args.swap else None
        if swap and "mxfp4" not in args.modes.split(","):
            parser.error("--swap needs mxfp4 among --modes")
        kernel([int(t) for t in args.tokens.split(",")], args.rounds, args.planes, _modes(args.modes), swap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
