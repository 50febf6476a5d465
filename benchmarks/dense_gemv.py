"""The dense gemv against ``F.linear`` on a model's projection shapes: ``python -m benchmarks.dense_gemv``.

For each distinct dense projection shape of the preset (default qwen3-30b-a3b:
qkv 2048->5120, o 4096->2048, router 2048->128, lm_head 2048->151936) it runs
exactly what engine start runs (``engine.transforms.gemv_select.select``): F.linear
and every candidate launch at 1, 4 and 8 rows, CUDA-graph replays timed by
CUDA events with L2 flushed before each call, on random weights of the shape.
It prints the choice per (shape, rows) with both paths' time and weight-read
GB/s; ``--json PATH`` also writes every candidate's time.

``--smoke`` runs the same code on the CPU with a tiny preset and the Triton
interpreter (numbers meaningless). Without CUDA and without ``--smoke`` it exits 2.
"""

import argparse
import json
import os
import sys

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def projection_shapes(spec: str, dtype: torch.dtype):
    """The distinct dense projection shapes of one decoder layer plus the LM head, from the model built on meta."""
    from engine.transforms.gemv_select import group_by_shape
    from engine.loading.random_weights import build_random_model, random_model_config

    one_layer = spec + (",num_hidden_layers=1" if ":" in spec and "=" in spec.rpartition(":")[2] else ":num_hidden_layers=1")
    model = build_random_model(random_model_config(one_layer), dtype, torch.device("meta"), "torch", max_positions=1)
    return group_by_shape(model)


def run(spec: str, dtype: torch.dtype, device: torch.device, reps: int, warmup: int = 2) -> list[dict]:
    from engine.transforms.gemv_select import ReplayTimer, format_choices, select

    shapes = {}
    for shape, mods in projection_shapes(spec, dtype).items():
        linear = torch.nn.Linear(shape.k, shape.n, bias=shape.bias, device=device, dtype=dtype)  # random weights
        shapes[shape] = [(name, linear) for name, _ in mods]
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    timer = ReplayTimer(device, reps=reps, warmup=warmup)
    with torch.inference_mode():
        choices = select(shapes, timer, num_sms)
    print(format_choices(choices))
    return [c.to_dict() for c in choices]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dense_gemv", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=None, help="random-weights spec (default qwen3-30b-a3b)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="the same code on the CPU: tiny preset, Triton interpreter")
    parser.add_argument("--json", metavar="PATH", help="also write every measurement as JSON to PATH")
    args = parser.parse_args(argv)
    if args.smoke:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported
        from benchmarks.engine_gpu import SMOKE_SPEC

        device, spec, dtype, reps = torch.device("cpu"), args.preset or SMOKE_SPEC, torch.float32, 1
    elif not torch.cuda.is_available():
        print("benchmarks.dense_gemv: no CUDA device (use --smoke for a CPU run of the same code)", file=sys.stderr)
        return 2
    else:
        device, spec, dtype, reps = torch.device("cuda"), args.preset or "qwen3-30b-a3b", DTYPES[args.dtype], args.reps
    report = dict(spec=spec, dtype=str(dtype).removeprefix("torch."),
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run, Triton interpreter)",
                  shapes=run(spec, dtype, device, reps, warmup=0 if args.smoke else 2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
