"""Search launch configs for one MoE layer shape and write them as JSON: ``python -m moe_kernels.tune``.

    python -m moe_kernels.tune --E 8 --H 4096 --I 14336 --dtype bfloat16 [--topk 2] [--tokens 1,16,...]

For each token count it times, on random routing, every row tile (BLOCK_M,
sorted or not) with the best tile of each GEMM for that BLOCK_M, and keeps
the fastest total (alignment + kernel 1 + kernel 2). The file is keyed by
(E, N=2I, K=H, dtype, device name) and lands in ``--out`` (default: the
package's ``configs/``, where ``launch_config`` looks first after
``$MOEGATE_MOE_CONFIG_DIR``).

Timings mean something only on the GPU the file is named after. Without CUDA
it refuses, unless TRITON_INTERPRET=1 is set, tiny shapes are given and
``--out`` is explicit: a dry run of the search under the CPU interpreter.

Legend: T tokens, H hidden, I expert intermediate, E experts, k top-k, S = T*k.
"""

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

from moe_kernels.bench import median_ms
from moe_kernels.launch_config import CONFIG_DIR, ENV_CONFIG_DIR, GemmConfig, LaunchConfig, config_file_name, device_name
from moe_kernels.routing import route

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GPU_TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 8192, 16384)
INTERPRETER_TOKENS = (1, 16, 64)
INTERPRETER_MAX_DIM = 128  # H and I under the interpreter: it runs every program in Python
INTERPRETER_MAX_EXPERTS = 16

# Search spaces: (BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) per GEMM, and BLOCK_M.
GPU_SPACE = dict(BLOCK_M=(16, 32, 64, 128), BLOCK_N=(32, 64, 128, 256), BLOCK_K=(32, 64, 128, 256),
                 GROUP_M=(1, 8), num_warps=(4, 8), num_stages=(2, 3, 4, 5))
QUICK_SPACE = dict(BLOCK_M=(16, 64, 128), BLOCK_N=(64, 128), BLOCK_K=(64, 128), GROUP_M=(1, 8), num_warps=(4, 8),
                   num_stages=(3, 4))
INTERPRETER_SPACE = dict(BLOCK_M=(16, 32), BLOCK_N=(16, 32), BLOCK_K=(32,), GROUP_M=(1,), num_warps=(4,), num_stages=(2,))
UNSORTED_MAX_TOKENS = 16  # the no-alignment path is only ever worth it for a handful of tokens


def _shared_memory_bytes(block_m: int, cfg: GemmConfig, weight_tiles: int, elem_bytes: int) -> int:
    # Pipelined operand tiles: one activation tile plus 1 (w2) or 2 (w13: gate and up) weight tiles per stage.
    return cfg.num_stages * (block_m * cfg.BLOCK_K + weight_tiles * cfg.BLOCK_N * cfg.BLOCK_K) * elem_bytes


def gemm_candidates(space: dict, block_m: int, weight_tiles: int, elem_bytes: int, smem_limit: int) -> list[GemmConfig]:
    """Every GEMM config of ``space`` whose operand tiles fit in shared memory."""
    out = []
    for bn, bk, group_m, warps, stages in itertools.product(
        space["BLOCK_N"], space["BLOCK_K"], space["GROUP_M"], space["num_warps"], space["num_stages"]
    ):
        cfg = GemmConfig(bn, bk, group_m, warps, stages)
        if _shared_memory_bytes(block_m, cfg, weight_tiles, elem_bytes) <= smem_limit:
            out.append(cfg)
    return out


def _fastest(run, candidates: list[GemmConfig], device, reps: int, warmup: int) -> tuple[float, GemmConfig | None]:
    best = (float("inf"), None)
    for cfg in candidates:
        try:
            ms = median_ms(lambda: run(cfg), device, reps, warmup)
        except Exception:  # noqa: BLE001 out of registers/shared memory on this GPU: not a candidate
            continue
        best = min(best, (ms, cfg), key=lambda pair: pair[0])
    return best


def tune_one(num_tokens: int, E: int, k: int, H: int, I: int, dtype: torch.dtype, device: torch.device,  # noqa: E741
             space: dict, smem_limit: int, reps: int, warmup: int) -> tuple[LaunchConfig, float]:
    """Best LaunchConfig for ``num_tokens`` and its total time in ms."""
    from moe_kernels.triton_backend import invoke_w2, invoke_w13, slot_blocks

    gen = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, H, device=device, dtype=dtype, generator=gen)  # [T, H]
    w13 = torch.randn(E, 2 * I, H, device=device, dtype=dtype, generator=gen) / H**0.5  # [E, 2I, H]
    w2 = torch.randn(E, H, I, device=device, dtype=dtype, generator=gen) / I**0.5  # [E, H, I]
    topk_weights, topk_ids = route(torch.randn(num_tokens, E, device=device, generator=gen), k, renormalize=True)
    slot_weights = topk_weights.reshape(-1).contiguous()  # [S]
    inter = torch.empty(num_tokens * k, I, device=device, dtype=dtype)  # [S, I]
    slot_out = torch.empty(num_tokens * k, H, device=device, dtype=dtype)  # [S, H]

    best = (float("inf"), None)
    sorted_choices = (True, False) if num_tokens <= UNSORTED_MAX_TOKENS else (True,)
    for align, block_m in itertools.product(sorted_choices, space["BLOCK_M"]):
        if block_m > 16 and (not align or block_m > 2 * num_tokens * k):
            continue  # unsorted blocks use one row; huge tiles for few slots are pure padding
        placeholder = LaunchConfig(align, block_m, GemmConfig(16, 16), GemmConfig(16, 16))
        align_ms = median_ms(lambda: slot_blocks(topk_ids, E, placeholder), device, reps, warmup)
        blocks = slot_blocks(topk_ids, E, placeholder)
        elem = x.element_size()
        ms1, cfg1 = _fastest(lambda c: invoke_w13(x, w13, inter, blocks, k, c),
                             gemm_candidates(space, block_m, 2, elem, smem_limit), device, reps, warmup)
        ms2, cfg2 = _fastest(lambda c: invoke_w2(inter, w2, slot_weights, slot_out, blocks, c),
                             gemm_candidates(space, block_m, 1, elem, smem_limit), device, reps, warmup)
        if cfg1 is None or cfg2 is None:
            continue
        total = align_ms + ms1 + ms2
        if total < best[0]:
            best = (total, LaunchConfig(align, block_m, cfg1, cfg2))
    if best[1] is None:
        raise RuntimeError(f"no candidate config ran for T={num_tokens}")
    return best[1], best[0]


def _refusal(args, interpreting: bool) -> str | None:
    if not interpreting:
        return None if torch.cuda.is_available() else (
            "moe_kernels.tune needs a CUDA GPU (or TRITON_INTERPRET=1 with tiny shapes for a dry run)"
        )
    if max(args.H, args.I) > INTERPRETER_MAX_DIM or args.E > INTERPRETER_MAX_EXPERTS:
        return (f"under TRITON_INTERPRET=1 only tiny shapes are tuned (H, I <= {INTERPRETER_MAX_DIM}, "
                f"E <= {INTERPRETER_MAX_EXPERTS}); got E={args.E} H={args.H} I={args.I}")
    if args.out is None:
        return "under TRITON_INTERPRET=1 pass --out DIR: interpreter timings must not land in the package configs"
    return None


def _format(data: dict) -> str:
    # One line per token bucket, so tuned files read (and diff) as a table.
    head = ",\n".join(f" {json.dumps(key)}: {json.dumps(value)}" for key, value in data.items() if key != "configs")
    rows = ",\n".join(f"  {json.dumps(tokens)}: {json.dumps(cfg)}" for tokens, cfg in data["configs"].items())
    return f"{{\n{head},\n \"configs\": {{\n{rows}\n }}\n}}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--E", type=int, required=True, help="experts")
    parser.add_argument("--H", type=int, required=True, help="hidden size")
    parser.add_argument("--I", type=int, required=True, help="expert intermediate size")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--topk", type=int, default=2, help="experts per token in the random routing (default 2)")
    parser.add_argument("--tokens", help="comma-separated token counts (default: a dense ladder 1..16384)")
    parser.add_argument("--quick", action="store_true", help="a smaller search space")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", help=f"output folder (default: ${ENV_CONFIG_DIR} or the package configs/)")
    args = parser.parse_args(argv)
    if min(args.E, args.H, args.I, args.topk, args.reps) < 1 or args.topk > args.E:
        parser.error("E, H, I, topk, reps must be positive and topk <= E")
    try:
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else None
    except ValueError:
        parser.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")

    interpreting = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")
    refusal = _refusal(args, interpreting)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2

    dtype = DTYPES[args.dtype]
    if not interpreting:
        device = torch.device("cuda")
        space = QUICK_SPACE if args.quick else GPU_SPACE
        props = torch.cuda.get_device_properties(device)
        smem_limit = getattr(props, "shared_memory_per_block_optin", 99 * 1024)
        tokens, warmup = tokens or GPU_TOKENS, 2
    else:
        device, space, smem_limit = torch.device("cpu"), INTERPRETER_SPACE, 1 << 30
        tokens, warmup = tokens or INTERPRETER_TOKENS, 0
        args.reps = 1

    name = device_name(device)
    out_dir = Path(args.out or os.environ.get(ENV_CONFIG_DIR) or CONFIG_DIR)
    configs = {}
    with torch.inference_mode():
        for num_tokens in tokens:
            cfg, ms = tune_one(num_tokens, args.E, args.topk, args.H, args.I, dtype, device, space, smem_limit,
                               args.reps, warmup)
            configs[str(num_tokens)] = cfg.to_dict()
            print(f"T={num_tokens:>6}: {ms:9.3f} ms  {cfg}", file=sys.stderr)

    import triton

    data = {
        "comment": f"written by moe_kernels.tune with topk={args.topk}, reps={args.reps}",
        "E": args.E, "N": 2 * args.I, "K": args.H, "dtype": args.dtype, "device": name,
        "triton": triton.__version__, "torch": torch.__version__,
        "configs": configs,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / config_file_name(args.E, 2 * args.I, args.H, args.dtype, name)
    path.write_text(_format(data))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
