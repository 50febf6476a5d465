"""Prefill and mixed steps with piecewise CUDA graphs off and on: ``python -m benchmarks.piecewise_graphs``.

One command, one process, a table at the end (``--json PATH`` also writes every number). For each setting
(piecewise graphs off: ``cuda_graph_token_sizes=()``; on: the default token counts) the engine is built on
the GPU (the start-up time and the capture time are printed), then:

1. prefill: one prompt of 512 tokens in one step, timed (median over reps), against its floor
   (``benchmarks.roofline``, the same as ``benchmarks.engine_gpu``'s prefill row);
2. mixed steps: C requests decoding while a new prompt of P tokens prefills in the same step
   (C, P in ``--mixed``), each such step timed (median over reps).

The model is a real-size preset with RANDOM weights (default qwen3-30b-a3b, bf16); the two settings are
built one after the other (two copies would not fit), the first freed before the second. Decode CUDA
graphs are on in both: only steps with prefill tokens change.

``--smoke`` runs the same code on the CPU with a tiny model and the Triton interpreter, the pieces run
eagerly (no capture without CUDA): numbers meaningless, it proves the script runs.
"""

import argparse
import gc
import os
import random
import statistics
import sys
import time
from dataclasses import replace

import torch

from benchmarks.engine_gpu import GPU, SMOKE, _log, _params, _random_prompt, _timed_step, bench_prefill, build_engine, \
    emit, measure_peaks


def _mixes(text: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple(tuple(int(v) for v in part.split("x")) for part in text.split(","))
    except ValueError:
        pairs = ((),)
    if not all(len(p) == 2 and min(p) >= 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected DECODESxPROMPT pairs like 8x128,32x256, got {text!r}")
    return pairs


def bench_mixed(engine, mixes: tuple[tuple[int, int], ...], reps: int, rng: random.Random) -> list[dict]:
    """Per (C, P): C requests decode while a P-token prompt prefills in the same step; that step timed."""
    vocab = engine.model_config.vocab_size
    rows = []
    for decodes, prompt_len in mixes:
        for _ in range(decodes):  # short prompts, long enough outputs to stay decoding through every rep
            engine.add_request(_random_prompt(rng, 16, vocab), _params(8 * (reps + 2)))
        while (s := engine.stats()).step_prefill_tokens or s.num_running < decodes:
            engine.step()
        times = []
        for _ in range(reps + 1):  # the first one warms up
            engine.add_request(_random_prompt(rng, prompt_len, vocab), _params(1))
            times.append(_timed_step(engine, alone=True))  # this mixed step's work, not the decode before it
            stats = engine.stats()
            assert stats.step_prefill_tokens == prompt_len and stats.step_decode_tokens == decodes, "not one mixed step"
            while engine.stats().num_running > decodes:  # the prompt's request samples its token and ends
                engine.step()
        while engine.has_unfinished():
            engine.step()
        times = times[1:]
        rows.append(dict(decodes=decodes, prompt_tokens=prompt_len, ms_per_step=statistics.median(times) * 1e3,
                         step_ms=[round(t * 1e3, 3) for t in times]))
        _log(f"mixed {decodes} decodes + {prompt_len} prefill: {rows[-1]['ms_per_step']:.2f} ms/step")
    return rows


def run_setting(pieces: bool, profile, device: torch.device, peaks: dict, mixes, reps: int) -> dict:
    from benchmarks.roofline import model_costs

    sizes = None if pieces else ()
    _log(f"building {profile.spec} (random weights), piecewise graphs {'on' if pieces else 'off'}")
    start = time.perf_counter()
    # Synchronous steps: each timed step returns once its tokens are read, so it times the device work.
    engine = build_engine(profile, device, cuda_graph_token_sizes=sizes, overlap_scheduling=False)
    if pieces and device.type == "cpu":  # no capture without CUDA: the same pieces, run eagerly
        from engine.transforms.piecewise_graphs import default_token_sizes, enable_piecewise_graphs

        enable_piecewise_graphs(engine.runner, default_token_sizes(engine.config.max_num_batched_tokens), capture=False)
    startup_s = time.perf_counter() - start
    graphs = engine.runner.piecewise_graphs
    assert (graphs is not None) == pieces, "the piecewise graphs were not installed as asked"
    rng = random.Random(0)
    prefill = bench_prefill(engine, profile, peaks, model_costs(engine.model), rng)
    mixed = bench_mixed(engine, mixes, profile.prefill_reps, rng)
    row = dict(piecewise=pieces, startup_s=startup_s, capture_s=graphs.capture_s if graphs else 0.0,
               capture_mib=graphs.capture_mib if graphs else 0.0,
               token_sizes=list(graphs.sizes) if graphs else [], replays=graphs.replays if graphs else 0,
               prefill=prefill, mixed=mixed)
    del engine, graphs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def format_table(report: dict) -> str:
    lines = [f"piecewise CUDA graphs: {report['spec']} with RANDOM weights, {report['device']}",
             f"measured peaks: {report['bandwidth_gbps']:.0f} GB/s (device copy), {report['peak_tflops']:.1f} TFLOP/s",
             "", f"{'workload':<30} {'off ms':>9} {'on ms':>9} {'off/on':>7} {'floor ms':>9} {'on/floor':>8}"]
    off, on = report["settings"]
    for a, b in zip(off["prefill"], on["prefill"]):
        lines.append(f"{'prefill ' + str(a['tokens']) + ' tokens':<30} {a['ms_per_step']:>9.2f} {b['ms_per_step']:>9.2f} "
                     f"{a['ms_per_step'] / b['ms_per_step']:>7.2f} {b['floor_ms']:>9.3f} {b['time_over_floor']:>8.2f}")
    for a, b in zip(off["mixed"], on["mixed"]):
        name = f"mixed {a['decodes']} dec + {a['prompt_tokens']} prefill"
        lines.append(f"{name:<30} {a['ms_per_step']:>9.2f} {b['ms_per_step']:>9.2f} {a['ms_per_step'] / b['ms_per_step']:>7.2f}")
    lines += ["", f"start-up: off {off['startup_s']:.1f} s (built first: it also pays one-time imports and compiles); "
                  f"on {on['startup_s']:.1f} s, of which capturing {on['capture_s']:.1f} s for token counts {on['token_sizes']} "
                  f"({on['capture_mib']:.0f} MiB of device memory)"]
    prefill512 = next((r for r in on["prefill"] if r["tokens"] == 512), None)
    if prefill512:
        lines.append(f"goal: prefill 512 within 3x of its floor: {prefill512['time_over_floor']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.piecewise_graphs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the same code on the CPU: tiny model, pieces eager")
    parser.add_argument("--preset", help="random-weights spec (default qwen3-30b-a3b)")
    parser.add_argument("--mixed", type=_mixes, default=None,
                        help="DECODESxPROMPT pairs for the mixed steps (default 1x128,8x128,32x256,64x448)")
    parser.add_argument("--json", metavar="PATH", help="also write the full report as JSON to PATH")
    args = parser.parse_args(argv)
    if args.smoke:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        profile, device, mixes = replace(SMOKE, prefill_lens=(24,)), torch.device("cpu"), ((2, 12),)
    elif not torch.cuda.is_available():
        print("benchmarks.piecewise_graphs: no CUDA device (use --smoke for a CPU run of the same code)", file=sys.stderr)
        return 2
    else:
        profile, device = replace(GPU, prefill_lens=(512,)), torch.device("cuda")
        mixes = ((1, 128), (8, 128), (32, 256), (64, 448))
    if args.preset:
        profile = replace(profile, spec=args.preset)
    mixes = args.mixed or mixes
    peaks = measure_peaks(profile, device)
    report = dict(spec=profile.spec, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
                  torch=torch.__version__, mixes=mixes, **peaks,
                  settings=[run_setting(pieces, profile, device, peaks, mixes, profile.prefill_reps) for pieces in (False, True)])
    return emit(report, args.json, format_table(report))


if __name__ == "__main__":
    sys.exit(main())
