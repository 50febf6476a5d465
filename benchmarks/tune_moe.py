"""Search launch configs for one MoE layer shape and write them as JSON: ``python -m benchmarks.tune_moe``.

    python -m benchmarks.tune_moe --E 8 --H 4096 --I 14336 --dtype bfloat16 [--topk 2] [--tokens 1,16,...]
    python -m benchmarks.tune_moe --E 32 --topk 4 --H 2880 --I 2880 --quantization mxfp4   # gpt-oss-20b

For each token count it times, on random routing, every row tile (BLOCK_M,
sorted or not) with the best tile of each GEMM for that BLOCK_M, and keeps
the fastest total (alignment + kernel 1 + kernel 2), each timed as CUDA-graph
replays. The search space depends on the token-count regime (GPU_SPACES);
``--jobs`` processes compile every candidate first, so the search costs
minutes rather than an hour of serial compiles. The file is keyed by
(E, N=2I, K=H, dtype, device name) and lands in ``--out`` (default: the
package's ``configs/``, where ``launch_config`` looks first after
``$MOEGATE_MOE_CONFIG_DIR``).

``--quantization mxfp4`` tunes MXFP4 experts (``moe_kernels.mxfp4``: random
packed bytes and e8m0 scales; activations stay ``--dtype``): every BLOCK_K a
multiple of the 32-value scale group, and the file keyed by the quantization
too, the name ``launch_config`` looks up for such weights before the dtype's.
Its matrix-vector candidates decode the 4-bit tiles both ways, in K order and
as nibble planes (``PLANES``, ``moe_kernels.planes_triton``); the fastest of
each, per kernel and token count, goes to stderr (the A/B of the two decodes),
the fastest of all into the file. Its grouped-GEMM candidates take the tile
kernels and the swapped-operand ones (``SWAP``, with ``SPLIT_K``:
``moe_kernels.swapped_triton``, SWAP_SPACES); the fastest of each goes to
stderr the same way.

Timings mean something only on the GPU the file is named after. Without CUDA
it refuses, unless TRITON_INTERPRET=1 is set, tiny shapes are given and
``--out`` is explicit: a dry run of the search under the CPU interpreter.

Legend: T tokens, H hidden, I expert intermediate, E experts, k top-k, S = T*k.
"""

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moe_kernels.align import flat_ids
from moe_kernels.timing import capture_graph, median_ms
from moe_kernels.launch_config import CONFIG_DIR, ENV_CONFIG_DIR, GemmConfig, LaunchConfig, config_file_name, device_name
from moe_kernels.mxfp4 import VALUES_PER_SCALE
from moe_kernels.routing import route

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("mxfp4",)  # the quantizations with config files of their own (launch_config.quantization_name)
# Bytes a weight value takes in memory and in pipelined shared-memory tiles: MXFP4's half byte plus its scale byte
# per 32 values.
MXFP4_BYTES_PER_VALUE = 0.5 + 1 / VALUES_PER_SCALE
GPU_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
INTERPRETER_TOKENS = (1, 16, 64)
INTERPRETER_MAX_DIM = 128  # H and I under the interpreter: it runs every program in Python
INTERPRETER_MAX_EXPERTS = 16

# Search spaces by token-count regime, (largest T, space): decode sizes are
# memory-bound (narrow row tiles, deep pipelines, wide K steps to keep many
# bytes in flight); large T is matrix-bound (big tiles, 8 warps).
GPU_SPACES = (
    (64, dict(BLOCK_M=(16,), BLOCK_N=(32, 64, 128), BLOCK_K=(64, 128, 256), GROUP_M=(1,), num_warps=(4,),
              num_stages=(3, 4, 5))),
    (1024, dict(BLOCK_M=(16, 32, 64), BLOCK_N=(64, 128), BLOCK_K=(64, 128), GROUP_M=(8,), num_warps=(4, 8),
                num_stages=(3, 4))),
    (1 << 62, dict(BLOCK_M=(64, 128), BLOCK_N=(128, 256), BLOCK_K=(64, 128), GROUP_M=(8,), num_warps=(4, 8),
                   num_stages=(3, 4))),
)
INTERPRETER_SPACES = ((1 << 62, dict(BLOCK_M=(16, 32), BLOCK_N=(16, 32), BLOCK_K=(32,), GROUP_M=(1,), num_warps=(4,),
                                     num_stages=(2,))),)
# The matrix-vector kernels: no row tile; BLOCK_N x BLOCK_K float32 partial sums per program (no tl.dot: row tiles
# under 16, more programs for a handful of slots). PLANES: MXFP4 tiles as nibble planes too (ignored for others).
# num_stages: one, since it changes nothing in these loops (no tl.dot to pipeline; the same SASS for 2 and 4 with
# Triton 3.6 and 3.9 on sm_90), so timing both measured noise.
GPU_GEMV_SPACE = dict(BLOCK_N=(8, 16, 32, 64), BLOCK_K=(128, 256, 512), GROUP_M=(1,), num_warps=(2, 4, 8),
                      num_stages=(2,), PLANES=(False, True))
INTERPRETER_GEMV_SPACE = dict(BLOCK_N=(16,), BLOCK_K=(32,), GROUP_M=(1,), num_warps=(4,), num_stages=(2,),
                              PLANES=(False, True))
# The swapped-operand grouped GEMMs of MXFP4 weights, by token-count regime as GPU_SPACES: weight rows are the dot's
# M (64 and up: a wgmma per warp group, the decoded tile its A operand from registers), the block's slots its N;
# K split where few tokens leave the grid short of the SMs. BLOCK_M, GROUP_M as the regime's tile space.
SWAP_SPACES = (
    (64, dict(BLOCK_N=(64, 128), BLOCK_K=(64, 128), num_warps=(4,), num_stages=(3,), SPLIT_K=(1, 2, 4))),
    (1024, dict(BLOCK_N=(64, 128), BLOCK_K=(64, 128), num_warps=(4, 8), num_stages=(3,), SPLIT_K=(1, 2))),
    (1 << 62, dict(BLOCK_N=(128,), BLOCK_K=(64, 128), num_warps=(4, 8), num_stages=(3, 4), SPLIT_K=(1,))),
)
INTERPRETER_SWAP_SPACES = ((1 << 62, dict(BLOCK_N=(16,), BLOCK_K=(32,), num_warps=(4,), num_stages=(2,),
                                          SPLIT_K=(1, 2))),)
MAX_DECODED_PER_THREAD = 128  # float32 decoded weight values per thread and step (w13: gate and up tiles)
UNSORTED_MAX_TOKENS = 4  # the no-alignment path reads an expert once per slot: a handful of tokens
# The matrix-vector kernels too, but pad nothing: at 8 tokens of gpt-oss-20b (32 slots on about 20 experts) they
# read about 1.6x the grouped GEMMs' bytes, which a decode-bound 4-bit layer may not feel. Timed, not assumed.
GEMV_MAX_TOKENS = 8
GEMV_MAX_PARTIALS = 64  # float32 partial sums per thread in a matrix-vector program (two tiles for w13)
# Registers per int32 word (eight 4-bit values) with PLANES: the word, its accumulator and its step's sum.
PLANES_REGS_PER_WORD = 3
MAX_ACC_PER_THREAD = 128  # fp32 accumulator values per thread; past this the tile spills registers


def _shared_memory_bytes(block_m: int, cfg: GemmConfig, weight_tiles: int, elem_bytes: int,
                         quantization: str | None = None) -> int:
    # Pipelined operand tiles: one activation tile plus 1 (w2) or 2 (w13: gate and up) weight tiles per stage.
    # MXFP4 weight tiles as their packed bytes and scales: above what Triton compiles for sm_90 (w13, BLOCK_M 16,
    # BLOCK_N 128, BLOCK_K 256, 3 stages: 82944 bytes, estimated 129024), so no config that fits is left out.
    tile = weight_tiles * cfg.BLOCK_N * cfg.BLOCK_K
    if quantization == "mxfp4":
        return int(cfg.num_stages * (block_m * cfg.BLOCK_K * elem_bytes + tile * MXFP4_BYTES_PER_VALUE))
    return cfg.num_stages * (block_m * cfg.BLOCK_K + tile) * elem_bytes


def _fits_weights(cfg: GemmConfig, quantization: str | None) -> bool:
    # MXFP4 tiles hold whole scale groups (triton_backend refuses any other BLOCK_K).
    return quantization != "mxfp4" or cfg.BLOCK_K % VALUES_PER_SCALE == 0


def gemm_candidates(space: dict, block_m: int, weight_tiles: int, elem_bytes: int, smem_limit: int,
                    quantization: str | None = None) -> list[GemmConfig]:
    """Every GEMM config of ``space`` the weights allow whose operand tiles fit in shared memory and accumulators
    in registers."""
    out = []
    for bn, bk, group_m, warps, stages in itertools.product(
        space["BLOCK_N"], space["BLOCK_K"], space["GROUP_M"], space["num_warps"], space["num_stages"]
    ):
        cfg = GemmConfig(bn, bk, group_m, warps, stages)
        acc_per_thread = block_m * bn * weight_tiles // (warps * 32)
        smem = _shared_memory_bytes(block_m, cfg, weight_tiles, elem_bytes, quantization)
        if smem <= smem_limit and acc_per_thread <= MAX_ACC_PER_THREAD and _fits_weights(cfg, quantization):
            out.append(cfg)
    return out


def swapped_candidates(space: dict, tile_space: dict, block_m: int, weight_tiles: int, elem_bytes: int,
                       smem_limit: int) -> list[GemmConfig]:
    """The swapped-operand configs (SWAP, each SPLIT_K of ``space``) of ``space``'s tiles the weights allow, whose
    decoded weight tiles fit in registers, with a warp group (4 warps) at most per 64 weight rows (more hold copies of
    the same decoded rows); GROUP_M from ``tile_space``, the regime's tile space."""
    tiles = gemm_candidates({**space, "GROUP_M": tile_space["GROUP_M"]}, block_m, weight_tiles, elem_bytes,
                            smem_limit, "mxfp4")
    return [dataclasses.replace(c, SWAP=True, SPLIT_K=split) for c in tiles for split in space["SPLIT_K"]
            if c.BLOCK_N * c.BLOCK_K * weight_tiles <= MAX_DECODED_PER_THREAD * 32 * c.num_warps
            and c.num_warps <= max(4, c.BLOCK_N // 16)]


def space_for(spaces: tuple, num_tokens: int) -> dict:
    return next(space for max_tokens, space in spaces if num_tokens <= max_tokens)


@dataclass(frozen=True, slots=True)
class Problem:
    """One tuning problem: a layer shape, a dtype, the experts' quantization (None: weights in ``dtype``) and a
    token count."""

    num_tokens: int
    E: int
    k: int
    H: int
    I: int  # noqa: E741 (the legend's letter)
    dtype: str
    quantization: str | None = None


def row_tilings(problem: Problem, space: dict) -> list[tuple[str, int]]:
    """(mode, BLOCK_M) pairs worth timing for this token count; mode is "sorted", "unsorted" or "gemv"."""
    few = problem.num_tokens <= UNSORTED_MAX_TOKENS
    out = [("gemv", 16)] if problem.num_tokens <= GEMV_MAX_TOKENS else []
    for mode, block_m in itertools.product(("sorted", "unsorted") if few else ("sorted",), space["BLOCK_M"]):
        if block_m > 16 and (mode == "unsorted" or block_m > 2 * problem.num_tokens * problem.k):
            continue  # unsorted blocks use one row; huge tiles for few slots are pure padding
        out.append((mode, block_m))
    return out


def launch_config(mode: str, block_m: int, w13: GemmConfig, w2: GemmConfig) -> LaunchConfig:
    return LaunchConfig(mode == "sorted", block_m, w13, w2, gemv=mode == "gemv")


def _gemv_candidates(space: dict, weight_tiles: int, quantization: str | None = None) -> list[GemmConfig]:
    # MXFP4 tiles both ways: in K order (a float32 partial sum per value) and as nibble planes (PLANES: per word of
    # eight values, about three registers), so planes fit tiles nearly three times as large in the same registers.
    out = []
    planes = space["PLANES"] if quantization == "mxfp4" else (False,)
    for bn, bk, warps, stages, plane in itertools.product(space["BLOCK_N"], space["BLOCK_K"], space["num_warps"],
                                                          space["num_stages"], planes):
        cfg = GemmConfig(bn, bk, 1, warps, stages, PLANES=plane)
        values = bn * bk * weight_tiles // (warps * 32)  # per thread and step
        partials = values * PLANES_REGS_PER_WORD // 8 if plane else values
        if partials <= GEMV_MAX_PARTIALS and _fits_weights(cfg, quantization):
            out.append(cfg)
    return out


def candidates(problem: Problem, spaces: tuple, smem_limit: int) -> list[tuple[str, int, str, GemmConfig]]:
    """Every (mode, BLOCK_M, "w13" | "w2", GemmConfig) the search times for ``problem``."""
    space = space_for(spaces, problem.num_tokens)
    interpreted = spaces is INTERPRETER_SPACES
    gemv_space = INTERPRETER_GEMV_SPACE if interpreted else GPU_GEMV_SPACE
    swap_space = space_for(INTERPRETER_SWAP_SPACES if interpreted else SWAP_SPACES, problem.num_tokens)
    elem = torch.empty(0, dtype=DTYPES[problem.dtype]).element_size()
    quant = problem.quantization
    out = []
    for mode, block_m in row_tilings(problem, space):
        if mode == "gemv":
            out += [(mode, block_m, "w13", c) for c in _gemv_candidates(gemv_space, 2, quant)]
            out += [(mode, block_m, "w2", c) for c in _gemv_candidates(gemv_space, 1, quant)]
            continue
        out += [(mode, block_m, "w13", c) for c in gemm_candidates(space, block_m, 2, elem, smem_limit, quant)]
        out += [(mode, block_m, "w2", c) for c in gemm_candidates(space, block_m, 1, elem, smem_limit, quant)]
        if quant == "mxfp4":
            out += [(mode, block_m, which, c) for which, tiles in (("w13", 2), ("w2", 1))
                    for c in swapped_candidates(swap_space, space, block_m, tiles, elem, smem_limit)]
    return out


def _mxfp4_weight(n: int, k: int, problem: Problem, device: torch.device,
                  gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed uint8 [E, n, k/2] and scales uint8 [E, n, k/32]: random bytes (every e2m1 code), random scales
    2**-9 .. 2**-1 (finite outputs, as trained experts have); ``gen`` None leaves both uninitialized."""
    packed, scales = (problem.E, n, k // 2), (problem.E, n, k // VALUES_PER_SCALE)
    if gen is None:
        return (torch.empty(packed, device=device, dtype=torch.uint8),
                torch.empty(scales, device=device, dtype=torch.uint8))
    return (torch.randint(0, 256, packed, device=device, dtype=torch.uint8, generator=gen),
            torch.randint(118, 127, scales, device=device, dtype=torch.uint8, generator=gen))


def _tensors(problem: Problem, device: torch.device, random_weights: bool = True) -> dict:
    """Inputs and output buffers of ``problem``; routing is the same in every process (seeded by T).

    ``random_weights`` False leaves the weights uninitialized: the compile-only
    workers need their shapes, not their values.
    """
    T, E, k, H, I = problem.num_tokens, problem.E, problem.k, problem.H, problem.I  # noqa: E741
    dtype = DTYPES[problem.dtype]
    gen = torch.Generator(device=device).manual_seed(T)
    x = torch.randn(T, H, device=device, dtype=dtype, generator=gen)  # [T, H]
    w13_scale = w2_scale = None
    if problem.quantization == "mxfp4":  # packed [E, 2I, H/2] and [E, H, I/2], scales [E, 2I, H/32] and [E, H, I/32]
        w13, w13_scale = _mxfp4_weight(2 * I, H, problem, device, gen if random_weights else None)
        w2, w2_scale = _mxfp4_weight(H, I, problem, device, gen if random_weights else None)
    elif random_weights:
        w13 = torch.randn(E, 2 * I, H, device=device, dtype=dtype, generator=gen) / H**0.5  # [E, 2I, H]
        w2 = torch.randn(E, H, I, device=device, dtype=dtype, generator=gen) / I**0.5  # [E, H, I]
    else:
        w13 = torch.empty(E, 2 * I, H, device=device, dtype=dtype)
        w2 = torch.empty(E, H, I, device=device, dtype=dtype)
    topk_weights, topk_ids = route(torch.randn(T, E, device=device, generator=gen), k, renormalize=True)
    return dict(x=x, w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale, topk_ids=topk_ids,
                slot_weights=topk_weights.reshape(-1).contiguous(),  # [S]
                inter=torch.empty(T * k, I, device=device, dtype=dtype),  # [S, I]
                slot_out=torch.empty(T * k, H, device=device, dtype=dtype),  # [S, H]
                out=torch.empty(T, H, device=device, dtype=dtype))  # [T, H]


def _launcher(problem: Problem, t: dict, mode: str, block_m: int, which: str):
    """A function cfg -> one launch of kernel ``which`` with that GemmConfig (alignment done once, here)."""
    from moe_kernels.triton_backend import invoke_w2, invoke_w2_gemv, invoke_w13, invoke_w13_gemv, slot_blocks

    if mode == "gemv":
        ids = flat_ids(t["topk_ids"])
        if which == "w13":
            return lambda cfg: invoke_w13_gemv(t["x"], t["w13"], ids, t["inter"], problem.k, cfg,
                                               scale=t["w13_scale"])
        return lambda cfg: invoke_w2_gemv(t["inter"], t["w2"], ids, t["slot_weights"], t["out"], problem.k, cfg,
                                          scale=t["w2_scale"])
    placeholder = launch_config(mode, block_m, GemmConfig(16, 16), GemmConfig(16, 16))
    blocks = slot_blocks(t["topk_ids"], problem.E, placeholder)
    if which == "w13":
        return lambda cfg: invoke_w13(t["x"], t["w13"], t["inter"], blocks, problem.k, cfg, scale=t["w13_scale"])
    return lambda cfg: invoke_w2(t["inter"], t["w2"], t["slot_weights"], t["slot_out"], blocks, cfg,
                                 scale=t["w2_scale"])


def _compile_chunk(job: tuple[Problem, list[tuple[bool, int, str, dict]]]) -> int:
    """Worker process: launch each candidate once, so Triton compiles it into its on-disk cache.

    The parent then finds every kernel compiled (same source, constants and
    argument specializations) and spends its time only on timing.
    """
    problem, tasks = job
    device = torch.device("cuda")
    with torch.inference_mode():
        t = _tensors(problem, device, random_weights=False)
        compiled = 0
        for mode, block_m, which, cfg in tasks:
            try:
                _launcher(problem, t, mode, block_m, which)(GemmConfig(**cfg))
                compiled += 1
            except Exception:  # noqa: BLE001 out of resources on this GPU: the parent skips it too
                pass
        torch.cuda.synchronize(device)
        del t
        torch.cuda.empty_cache()  # every worker holds a problem's buffers only while it compiles for it
    return compiled


def precompile(problems: list[Problem], spaces: tuple, smem_limit: int, jobs: int) -> None:
    """Compile every candidate of every problem in ``jobs`` processes (Triton compiles on the host, one core each)."""
    import multiprocessing

    work = []
    for problem in problems:
        tasks = [(mode, m, w, asdict(c)) for mode, m, w, c in candidates(problem, spaces, smem_limit)]
        work += [(problem, tasks[i:i + 8]) for i in range(0, len(tasks), 8)]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        compiled = sum(pool.imap_unordered(_compile_chunk, work))
    print(f"precompiled {compiled} kernels in {jobs} processes", file=sys.stderr)


@functools.cache
def _flush_buffer(device: torch.device) -> torch.Tensor | None:
    # Read before each timed call so weights come from memory, as in a model where every layer has its own.
    return torch.ones(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None


def _time(fn, device: torch.device, reps: int, warmup: int) -> float:
    graph = capture_graph(fn, device)  # graph replays: no launch gaps, as in the engine's decode graphs
    return median_ms(graph.replay if graph is not None else fn, device, reps, warmup, _flush_buffer(device))


def _fastest(run, candidates: list[GemmConfig], device, reps: int, warmup: int) -> tuple[float, GemmConfig | None]:
    best = (float("inf"), None)
    for cfg in candidates:
        try:
            ms = _time(lambda: run(cfg), device, reps, warmup)
        except Exception:  # noqa: BLE001 out of registers/shared memory on this GPU: not a candidate
            continue
        best = min(best, (ms, cfg), key=lambda pair: pair[0])
    return best


def kernel_variant(cfg: GemmConfig) -> str:
    """Which kernel a GemmConfig takes for 4-bit weights: "planes" (matrix-vector, nibble planes), "swapped"
    (grouped GEMM, swapped operands) or "tiles" (tiles in K order)."""
    return "planes" if cfg.PLANES else "swapped" if cfg.SWAP else "tiles"


def _fastest_by_decode(problem: Problem, run, candidates: list[GemmConfig], mode: str, which: str, device,
                       reps: int, warmup: int) -> tuple[float, GemmConfig | None]:
    """``_fastest``, and where the candidates take 4-bit weights more than one way (``kernel_variant``), the best of
    each on stderr: the A/B of the kernels, from one process."""
    variants = sorted({kernel_variant(c) for c in candidates})
    best = {v: _fastest(run, [c for c in candidates if kernel_variant(c) == v], device, reps, warmup)
            for v in variants}
    if len(variants) > 1:
        for variant, (ms, cfg) in best.items():
            print(f"T={problem.num_tokens:>6} {mode} {which:>3} {variant:>7}: {ms:9.4f} ms  {cfg}", file=sys.stderr)
    return min(best.values(), key=lambda pair: pair[0])


def tune_one(problem: Problem, device: torch.device, spaces: tuple, smem_limit: int, reps: int,
             warmup: int) -> tuple[LaunchConfig, float]:
    """Best LaunchConfig for ``problem`` and its total time in ms (alignment + kernel 1 + kernel 2)."""
    from moe_kernels.triton_backend import slot_blocks

    t = _tensors(problem, device)
    by_tiling: dict[tuple[str, int], dict[str, list[GemmConfig]]] = {}
    for mode, block_m, which, cfg in candidates(problem, spaces, smem_limit):
        by_tiling.setdefault((mode, block_m), {"w13": [], "w2": []})[which].append(cfg)
    best = (float("inf"), None)
    for (mode, block_m), cfgs in by_tiling.items():
        placeholder = launch_config(mode, block_m, GemmConfig(16, 16), GemmConfig(16, 16))
        # The GEMM paths pay for alignment and for torch's sum over k; the gemv path does neither.
        align_ms = 0.0
        if mode != "gemv":
            per_token = t["slot_out"].view(problem.num_tokens, problem.k, problem.H)  # [T, k, H]
            align_ms = _time(lambda: (slot_blocks(t["topk_ids"], problem.E, placeholder), per_token.sum(dim=1)),
                             device, reps, warmup)
        ms1, cfg1 = _fastest_by_decode(problem, _launcher(problem, t, mode, block_m, "w13"), cfgs["w13"], mode,
                                       "w13", device, reps, warmup)
        ms2, cfg2 = _fastest_by_decode(problem, _launcher(problem, t, mode, block_m, "w2"), cfgs["w2"], mode, "w2",
                                       device, reps, warmup)
        if cfg1 is None or cfg2 is None:
            continue
        total = align_ms + ms1 + ms2
        if total < best[0]:
            best = (total, launch_config(mode, block_m, cfg1, cfg2))
    if best[1] is None:
        raise RuntimeError(f"no candidate config ran for T={problem.num_tokens}")
    return best[1], best[0]


def _refusal(args, interpreting: bool) -> str | None:
    if not interpreting:
        return None if torch.cuda.is_available() else (
            "benchmarks.tune_moe needs a CUDA GPU (or TRITON_INTERPRET=1 with tiny shapes for a dry run)"
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
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune_moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--E", type=int, required=True, help="experts")
    parser.add_argument("--H", type=int, required=True, help="hidden size")
    parser.add_argument("--I", type=int, required=True, help="expert intermediate size")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="activation dtype (and the "
                        "weights', without --quantization)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, help="expert weight format (as the engine's "
                        "--quantization); default: weights in --dtype")
    parser.add_argument("--topk", type=int, default=2, help="experts per token in the random routing (default 2)")
    parser.add_argument("--tokens", help="comma-separated token counts (default: a dense ladder 1..16384)")
    parser.add_argument("--reps", type=int, default=10)
    # Each job holds one problem's weights and buffers on the GPU (about 4 GiB for Mixtral at 16k tokens).
    parser.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 2)),
                        help="processes that compile the candidates before timing (GPU only; 1: compile while timing)")
    parser.add_argument("--out", help=f"output folder (default: ${ENV_CONFIG_DIR} or the package configs/)")
    args = parser.parse_args(argv)
    if min(args.E, args.H, args.I, args.topk, args.reps, args.jobs) < 1 or args.topk > args.E:
        parser.error("E, H, I, topk, reps, jobs must be positive and topk <= E")
    if args.quantization == "mxfp4" and (args.H % VALUES_PER_SCALE or args.I % VALUES_PER_SCALE):
        parser.error(f"MXFP4 needs H and I multiples of {VALUES_PER_SCALE}, got H={args.H} I={args.I}")
    try:
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else None
    except ValueError:
        parser.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")

    interpreting = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")
    refusal = _refusal(args, interpreting)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2

    if not interpreting:
        device = torch.device("cuda")
        spaces = GPU_SPACES
        props = torch.cuda.get_device_properties(device)
        smem_limit = getattr(props, "shared_memory_per_block_optin", 99 * 1024)
        tokens, warmup = tokens or GPU_TOKENS, 2
    else:
        device, spaces, smem_limit = torch.device("cpu"), INTERPRETER_SPACES, 1 << 30
        tokens, warmup = tokens or INTERPRETER_TOKENS, 0
        args.reps = 1

    name = device_name(device)
    out_dir = Path(args.out or os.environ.get(ENV_CONFIG_DIR) or CONFIG_DIR)
    problems = [Problem(t, args.E, args.topk, args.H, args.I, args.dtype, args.quantization) for t in tokens]
    if not interpreting and args.jobs > 1:
        precompile(problems, spaces, smem_limit, args.jobs)
    configs = {}
    with torch.inference_mode():
        for problem in problems:
            cfg, ms = tune_one(problem, device, spaces, smem_limit, args.reps, warmup)
            configs[str(problem.num_tokens)] = {**cfg.to_dict(), "ms": round(ms, 4)}
            print(f"T={problem.num_tokens:>6}: {ms:9.3f} ms  {cfg}", file=sys.stderr)

    import triton

    data = {
        "comment": f"written by benchmarks.tune_moe with topk={args.topk}, reps={args.reps}",
        "E": args.E, "N": 2 * args.I, "K": args.H, "dtype": args.dtype,
        **({"quantization": args.quantization} if args.quantization else {}), "device": name,
        "triton": triton.__version__, "torch": torch.__version__,
        "configs": configs,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / config_file_name(args.E, 2 * args.I, args.H, args.dtype, name, args.quantization)
    if path.is_file():  # re-tuning some token counts keeps the others
        kept = json.loads(path.read_text()).get("configs", {})
        data["configs"] = {t: c for t, c in sorted({**kept, **configs}.items(), key=lambda item: int(item[0]))}
    path.write_text(_format(data))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
