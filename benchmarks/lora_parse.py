"""Host time to read one LoRA adapter file: the safetensors library's ``load_file`` against
``engine.lora.safetensors_file.load_tensors``, and the whole adapter read (``load_adapter``) with each.

    python -m benchmarks.lora_parse [--rank 16] [--shape small] [--dtype float32] [--repeats 200] [--rounds 5]

The adapter is ``benchmarks.lora_throughput``'s (attention and routed experts), saved in ``--dtype``; the file sits
in the page cache (as an adapter read again after its host copy was dropped). Each round times every way
``--repeats`` times, in alternating order; reported: the median over rounds of each way's median, and [min, max].
One thread; ``--keep-freed-memory``: glibc's thresholds as a CPU engine sets them.

Read the parse rows with care: ``load_file``'s tensors are views of a private mapping of the file, whose pages are
read when first touched (by ``load_adapter``'s conversions and copies), while ``load_tensors`` reads the whole data
up front. The ``load_adapter`` rows compare the whole read.
"""

import argparse
import os
import statistics
import tempfile
import time
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

from benchmarks.lora_throughput import SHAPES, write_adapter
from engine.lora import peft_format
from engine.lora.safetensors_file import load_tensors
from engine.worker.cpu_allocator import keep_freed_memory


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--shape", default="small", choices=list(SHAPES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--keep-freed-memory", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.keep_freed_memory:
        keep_freed_memory()
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        write_adapter(tmp, args.rank, seed=1, shape=shape)
        file = os.path.join(tmp, peft_format.WEIGHTS_FILE)
        save_file({k: v.to(getattr(torch, args.dtype)) for k, v in load_file(file).items()}, file)
        experts = shape["num_experts"]
        sizes = (experts, shape["hidden_size"], shape["moe_intermediate_size"])

        def adapter():
            peft_format.load_adapter("a", tmp, *sizes)

        # name -> (what is timed, the reader load_adapter uses meanwhile)
        ways = {"load_file": (lambda: load_file(file), load_tensors),
                "load_tensors": (lambda: load_tensors(file), load_tensors),
                "load_adapter (load_file)": (adapter, load_file),
                "load_adapter (load_tensors)": (adapter, load_tensors)}
        results = {name: [] for name in ways}
        for r in range(args.rounds):
            for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
                fn, reader = ways[name]
                with mock.patch.object(peft_format, "load_tensors", reader):
                    results[name].append(_median_ms(fn, args.repeats))
        tensors = load_file(file)
        size_mb = os.path.getsize(file) / 1e6
    print(f"adapter: {len(tensors)} tensors, {size_mb:.2f} MB, rank {args.rank}, {args.shape} shape, {args.dtype}; "
          f"{args.rounds} rounds of {args.repeats}; load average {os.getloadavg()[0]:.2f}")
    for name, values in results.items():
        print(f"  {name:28s} {statistics.median(values):7.3f} ms [{min(values):.3f}, {max(values):.3f}]")


if __name__ == "__main__":
    main()
