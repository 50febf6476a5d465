"""Sliding-window layers' blocks returned to the pool: long requests that fit in one KV pool with the sliding
layers in a cache group of their own vs one block table for every layer, read from the real-shape model (built
on the meta device) and counted by the engine's own KV cache manager.

    .venv/bin/python -m benchmarks.sliding_window_memory --model gpt-oss-20b --pool-gb 40

Each request is computed in prefill chunks of ``--chunk`` tokens, then holds room for one decode token; requests
are added until the pool is short. Goal: close to 2x for gpt-oss (half the layers keep at most a window's blocks)
for requests much longer than the window.
"""

import argparse

import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.loading.random_weights import build_random_model, random_model_config
from engine.worker.cache_groups import kv_bytes_per_block, sliding_group_window


def requests_that_fit(num_blocks: int, block_size: int, window: int | None, length: int, chunk: int) -> int:
    """How many ``length``-token requests the manager holds at once (each ready to decode its next token)."""
    manager = KVCacheManager(num_blocks, block_size, enable_caching=False, sliding_window=window)
    count = 0
    while True:
        request = Request(f"r{count}", [1] * length, SamplingParams(ignore_eos=True), max_tokens=1)
        while request.num_computed_tokens < length:
            n = min(chunk, length - request.num_computed_tokens)
            if not manager.allocate_slots(request, n):
                return count
            request.num_computed_tokens += n
        if not manager.allocate_slots(request, 1):
            return count
        count += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-oss-20b", help="a random-weight preset whose layers differ in window")
    p.add_argument("--pool-gb", type=float, default=40.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (max_num_batched_tokens)")
    p.add_argument("--lengths", default="1024,4096,8192,32768")
    args = p.parse_args()
    dtype = torch.bfloat16
    model = build_random_model(random_model_config(args.model), dtype, torch.device("meta"), "torch", max_positions=1)
    window = sliding_group_window(model)
    assert window is not None, f"{args.model}: its sliding layers do not form a cache group"
    budget = int(args.pool_gb * 2**30)
    one = budget // kv_bytes_per_block(model, args.block_size, dtype)
    two = budget // kv_bytes_per_block(model, args.block_size, dtype, window)
    print(f"{args.model}: {len(model.attention_layers())} layers, window {window}; pool {args.pool_gb:g} GiB = "
          f"{one:,} blocks of every layer, or {two:,} blocks of half the layers; blocks of {args.block_size}")
    print("tokens/request  requests (one table)  requests (sliding group)  ratio  tokens resident (sliding group)")
    for length in (int(x) for x in args.lengths.split(",")):
        before = requests_that_fit(one, args.block_size, None, length, args.chunk)
        after = requests_that_fit(two, args.block_size, window, length, args.chunk)
        print(f"{length:>15,}  {before:>20,}  {after:>24,}  {after / before:5.2f}x  {after * length:,}")


if __name__ == "__main__":
    main()
