"""The Triton MLA decode kernel on DeepSeek-V3 shapes: ``python -m benchmarks.mla_decode``.

Legend: D decode requests, L context length, h local heads, R = 512 latent rank, P = 64 rotary width.

For h = 16 (V3's 128 heads at TP8) and h = 128 (one rank), D = 1, 32, 128 and
L = 1k, 4k, 16k, bfloat16 latent rows in 16-token blocks drawn at random from
the pool, it times ``mla_decode_triton`` as a CUDA-graph replay (median of
``--reps``, L2 flushed by a read before each call) with the split count the
engine would use (batch shape only) and with the context length known
(``max_seq_len``). It prints the bytes the step must read (every latent row
once, plus q and out) over the time, next to the device's peak: a large
device-to-device copy measured in the same run, and the datasheet figure where
the device is known. At h = 128 the kernel does about 240 FLOPs per byte, so the
TFLOP/s column matters there too. Each shape's output is checked against a
float64 reference on its first requests.

``--sweep`` also times the launch alternatives (heads per program, rows per
iteration, warps, split counts) and prints the best per shape. ``--smoke`` runs
the same code on tiny shapes on the CPU under the Triton interpreter (numbers
meaningless). Without CUDA and without ``--smoke`` it exits 2.

``--resources`` needs no GPU: it compiles the kernel for an H100 (sm_90) with
every launch above at both head counts and prints what each program holds
(registers a thread, bytes spilled to local memory, shared memory), read from
the cubin with the ``cuobjdump`` that ships with Triton.
"""

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

from engine.kernels.attention import _num_sms
from engine.kernels.mla_attention import (DEFAULT_MLA_LAUNCH, MlaDecodeLaunch, decode_constants, mla_decode_splits,
                                          mla_decode_triton)
from moe_kernels.timing import capture_graph, median_ms

# Datasheet HBM bandwidth (GB/s) by device-name fragment, most specific first.
DATASHEET_GBPS = (("H200", 4800), ("H100 PCIe", 2000), ("H100", 3350), ("H800", 3350), ("A100-SXM4-80GB", 2039),
                  ("A100", 1555), ("L40S", 864))


@dataclass(frozen=True, slots=True)
class Profile:
    heads: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    rank: int
    rope: int
    block_size: int
    dtype: torch.dtype
    reps: int
    warmup: int
    copy_bytes: int  # buffer copied to measure the bandwidth peak
    flush_bytes: int  # L2 flush buffer read before each timed call (0: none)
    check_requests: int  # requests per shape checked against float64


GPU = Profile(heads=(16, 128), batches=(1, 32, 128), contexts=(1024, 4096, 16384), rank=512, rope=64, block_size=16,
              dtype=torch.bfloat16, reps=20, warmup=3, copy_bytes=1 << 30, flush_bytes=256 << 20, check_requests=2)
SMOKE = Profile(heads=(3,), batches=(1, 2), contexts=(40,), rank=32, rope=16, block_size=4,
                dtype=torch.float32, reps=1, warmup=0, copy_bytes=1 << 20, flush_bytes=0, check_requests=2)


# The alternatives ``--sweep`` times beside the default; each compiles for sm_90 without spilling registers.
SWEEP = (MlaDecodeLaunch(max_block_h=16), MlaDecodeLaunch(max_block_h=16, warps_per_16_heads=8),
         MlaDecodeLaunch(max_block_h=16, block_n=64, warps_per_16_heads=8), MlaDecodeLaunch(block_n=16),
         MlaDecodeLaunch(num_stages=1))


def datasheet_gbps(name: str) -> float | None:
    return next((gbps for fragment, gbps in DATASHEET_GBPS if fragment in name), None)


def copy_gbps(profile: Profile, device: torch.device) -> float:
    src = torch.empty(profile.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, max(profile.reps, 3), profile.warmup)
    return 2 * profile.copy_bytes / (ms * 1e-3) / 1e9  # a copy reads and writes every byte


def make_inputs(profile: Profile, heads: int, batch: int, context: int, device: torch.device, gen: torch.Generator):
    """q [D, h, R + P], a pool of exactly the blocks the batch needs (+1 reserved) shuffled over the tables."""
    blocks_per_req = -(-context // profile.block_size)
    num_blocks = batch * blocks_per_req
    width = profile.rank + profile.rope
    cache = torch.randn(num_blocks + 1, profile.block_size, width, device=device, generator=gen).to(profile.dtype)
    order = torch.randperm(num_blocks, device=device, generator=gen)
    table = order.view(batch, blocks_per_req).to(torch.int64)
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device=device)
    q = torch.randn(batch, heads, width, device=device, generator=gen).to(profile.dtype)
    return q, cache, table, seq_lens


def reference(q, cache, table, seq_lens, scale: float, rank: int, requests: int) -> torch.Tensor:
    """float64 absorbed attention of the first ``requests`` requests: [n, h, R]."""
    outs = []
    bs = cache.shape[1]
    for i in range(requests):
        n = int(seq_lens[i])
        pos = torch.arange(n, device=cache.device)
        rows = cache[table[i, pos // bs], pos % bs].double()  # [n, R + P]
        outs.append(torch.softmax(scale * q[i].double() @ rows.T, dim=-1) @ rows[:, :rank])
    return torch.stack(outs)


def time_call(fn, profile: Profile, device: torch.device, flush: torch.Tensor | None) -> float:
    graph = capture_graph(fn, device)
    return median_ms(graph.replay if graph is not None else fn, device, profile.reps, profile.warmup, flush)


def bench_shape(profile: Profile, heads: int, batch: int, context: int, device: torch.device, sweep: bool,
                flush: torch.Tensor | None) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(heads * 1_000_003 + batch * 1009 + context)
    q, cache, table, seq_lens = make_inputs(profile, heads, batch, context, device, gen)
    width = profile.rank + profile.rope
    scale = (128 + profile.rope) ** -0.5  # V3's qk_head_dim: nope 128 + rope 64
    element = q.element_size()
    step_bytes = batch * context * width * element + q.numel() * element + batch * heads * profile.rank * element
    flops = 2 * batch * heads * context * (width + profile.rank)
    ref = reference(q, cache, table, seq_lens, scale, profile.rank, min(batch, profile.check_requests))
    sms = _num_sms(device)

    variants = [("default", DEFAULT_MLA_LAUNCH, None), ("default, context known", DEFAULT_MLA_LAUNCH, context)]
    if sweep:
        variants += [(_describe(launch), launch, context) for launch in SWEEP]
    records = []
    for name, launch, max_seq_len in variants:
        splits = mla_decode_splits(batch, heads, profile.rank, width * element, sms, launch, max_seq_len)
        candidates = [splits] + ([s for s in (splits // 2, splits * 2) if s >= 1 and s != splits] if sweep else [])
        for num_splits in candidates:
            out = torch.empty(batch, heads, profile.rank, dtype=q.dtype, device=device)

            def call(launch=launch, num_splits=num_splits, out=out):
                mla_decode_triton(q, cache, table, seq_lens, scale, profile.rank, launch, num_splits=num_splits, out=out)

            record = dict(heads=heads, batch=batch, context=context, launch=name, splits=num_splits)
            try:
                ms = time_call(call, profile, device, flush)
            except Exception as e:  # a launch this GPU cannot run (shared memory, registers) is reported, not fatal
                records.append({**record, "error": f"{type(e).__name__}: {e}".splitlines()[0][:160]})
                continue
            err = (out[:ref.shape[0]].double() - ref).abs().max().item()
            records.append({**record, "ms": ms, "gbps": step_bytes / (ms * 1e-3) / 1e9,
                            "tflops": flops / (ms * 1e-3) / 1e12, "max_abs_err": err})
    return records


def _describe(launch: MlaDecodeLaunch) -> str:
    return (f"heads<={launch.max_block_h} rows={launch.block_n} warps/16h={launch.warps_per_16_heads} "
            f"stages={launch.num_stages}")


def run(profile: Profile, device: torch.device, sweep: bool) -> dict:
    peak = copy_gbps(profile, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run, Triton interpreter)"
    flush = torch.empty(profile.flush_bytes, dtype=torch.uint8, device=device) if profile.flush_bytes else None
    records = []
    for heads in profile.heads:
        for batch in profile.batches:
            for context in profile.contexts:
                records += bench_shape(profile, heads, batch, context, device, sweep, flush)
    return dict(device=name, copy_gbps=peak, datasheet_gbps=datasheet_gbps(name), dtype=str(profile.dtype).removeprefix("torch."),
                rank=profile.rank, rope=profile.rope, block_size=profile.block_size, records=records)


def format_table(report: dict) -> str:
    sheet = report["datasheet_gbps"]
    lines = [f"{report['device']}: copy {report['copy_gbps']:.0f} GB/s measured"
             + (f", {sheet} GB/s datasheet" if sheet else "")
             + f"; {report['dtype']} rows of {report['rank']} + {report['rope']}, {report['block_size']}-token blocks",
             f"{'h':>4} {'D':>4} {'L':>6} {'launch':<44} {'S':>3} {'ms':>8} {'GB/s':>7} {'%copy':>6} "
             f"{'%sheet':>6} {'TFLOP/s':>8} {'max err':>8}"]
    for r in report["records"]:
        head = f"{r['heads']:>4} {r['batch']:>4} {r['context']:>6} {r['launch']:<44} {r['splits']:>3}"
        if "error" in r:
            lines.append(f"{head} {r['error']}")
            continue
        pct_sheet = f"{100 * r['gbps'] / sheet:6.1f}" if sheet else f"{'-':>6}"
        lines.append(f"{head} {r['ms']:8.3f} {r['gbps']:7.0f} {100 * r['gbps'] / report['copy_gbps']:6.1f} "
                     f"{pct_sheet} {r['tflops']:8.1f} {r['max_abs_err']:8.1e}")
    best = {}
    for r in report["records"]:
        key = (r["heads"], r["batch"], r["context"])
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    if any(r["launch"] not in ("default", "default, context known") for r in report["records"]):
        lines.append("best per shape:")
        lines += [f"  h={h} D={d} L={n}: {r['launch']}, S={r['splits']}, {r['ms']:.3f} ms"
                  for (h, d, n), r in best.items()]
    return "\n".join(lines)


# Triton signature types of the decode kernel's runtime arguments (its constexprs come from decode_constants).
_POINTER_TYPES = {"q_ptr": "model", "cache_ptr": "model", "out_ptr": "model", "part_out_ptr": "*fp32",
                  "part_ml_ptr": "*fp32", "block_table_ptr": "*i64", "seq_lens_ptr": "*i64"}
_TRITON_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def sm90_resources(heads: int, launch: MlaDecodeLaunch, split: bool = True, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Compile the decode kernel for sm_90 on this machine (no GPU needed): registers, local bytes, shared bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels import mla_attention_kernels as kernels

    fn = kernels.mla_decode_kernel
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError("--resources compiles the kernels: run it without TRITON_INTERPRET=1")
    consts = decode_constants(heads, GPU.rank, GPU.rope, GPU.block_size, dtype, split, launch)
    signature = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in _POINTER_TYPES:
            kind = _POINTER_TYPES[name]
            signature[name] = _TRITON_TYPES[dtype] if kind == "model" else kind
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=launch.num_warps(heads), num_stages=launch.num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage))
    return dict(heads=heads, launch=_describe(launch), warps=launch.num_warps(heads), registers=int(found["REG"]),
                spill_bytes=int(found["LOCAL"]) + int(found["STACK"]), shared_bytes=compiled.metadata.shared)


def resources_report() -> list[dict]:
    return [sm90_resources(heads, launch) for heads in GPU.heads for launch in (DEFAULT_MLA_LAUNCH, *SWEEP)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mla_decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--sweep", action="store_true", help="also time the launch alternatives and split counts")
    parser.add_argument("--resources", action="store_true",
                        help="no GPU needed: compile every launch for sm_90 and print registers, spills, shared memory")
    parser.add_argument("--reps", type=int, help="timed calls per measurement (median is reported)")
    parser.add_argument("--json", metavar="PATH", help="also write every measurement as JSON to PATH")
    args = parser.parse_args(argv)
    if args.resources:
        rows = resources_report()
        for r in rows:
            print(f"h={r['heads']:<4} {r['launch']:<44} warps={r['warps']:<3} registers={r['registers']:<4} "
                  f"spilled={r['spill_bytes']:<5} shared={r['shared_bytes']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    if args.smoke:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported
        profile, device = SMOKE, torch.device("cpu")
    elif not torch.cuda.is_available():
        print("benchmarks.mla_decode: no CUDA device (use --smoke for a CPU run of the same code)", file=sys.stderr)
        return 2
    else:
        profile, device = GPU, torch.device("cuda")
    if args.reps:
        profile = dataclasses.replace(profile, reps=args.reps)
    with torch.inference_mode():
        report = run(profile, device, args.sweep)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
