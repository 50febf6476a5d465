"""The vision encoder's cache on requests that re-use a few images: TTFT with the cache and without.

    python -m benchmarks.encoder_cache [--requests 64] [--images 8] [--side 448] [--concurrency 4] [--threads 2]
                                       [--vision-depth 8] [--tenants 1]

One process, one checkpoint written at start (transformers' ``Qwen3VLMoeForConditionalGeneration`` of small
shapes, its own random init: text hidden 256, 4 layers, 16 experts; a vision tower of ``--vision-depth`` blocks,
width 256, 16-pixel patches, so a ``side`` x ``side`` image is (side/32)^2 tokens), and the same workload for
each mode, run one after another: ``--encoder-cache-gb 1`` (cache) and ``0`` (no cache).

Workload: ``requests`` requests, each some random text, one of ``images`` random images (drawn at random, so
most are repeats), more random text, 8 generated tokens; the text before the image is each request's own, so
the prefix cache never holds an image's blocks and every repeat reaches the encoder. ``concurrency`` requests
in flight (the next added when one finishes); requests alternate between ``tenants`` tenants, each its own
cache salt (an image is encoded once per tenant that sends it).

Printed, per mode: TTFT (from adding a request to its first token) p50 and p90, the whole run's time and the
engine's encoder-cache hits and misses (each miss one image through the tower). The engine's default encoder
budget applies (layer-chunked: ``engine.models.encoder_budget``). Nothing is asserted: the numbers depend on
the machine.
"""

import argparse
import io
import json
import os
import random
import statistics
import tempfile
import time

import torch
from PIL import Image

from engine.core.config import EngineConfig
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 8000, 8001, 7998, 7999
VOCAB = 8192


def write_checkpoint(path: str, vision_depth: int, text_layers: int = 4, moe_intermediate: int = 128) -> None:
    """A small random Qwen3-VL-MoE checkpoint (transformers' own init) and its processor settings."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(
        "qwen3_vl_moe",
        text_config=dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=text_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
                         num_experts_per_tok=4, moe_intermediate_size=moe_intermediate, decoder_sparse_step=1,
                         max_position_embeddings=4096, eos_token_id=VOCAB - 1, bos_token_id=None, pad_token_id=0,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[8, 12, 12],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=vision_depth, hidden_size=256, intermediate_size=1024, num_heads=4,
                           out_hidden_size=256, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                           num_position_embeddings=576,
                           deepstack_visual_indexes=[i for i in (1, 3, 5) if i < vision_depth]),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
                   "image_std": [0.5] * 3, "size": {"shortest_edge": 32 * 32, "longest_edge": 1024 * 1024}}, f)


def random_png(rng: random.Random, side: int) -> bytes:
    data = rng.randbytes(side * side * 3)  # random noise: incompressible, as large a PNG as the side allows
    out = io.BytesIO()
    Image.frombytes("RGB", (side, side), data).save(out, format="PNG")
    return out.getvalue()


def workload(rng: random.Random, args) -> list[tuple[list[int], bytes, int]]:
    """(prompt ids, the encoded image, tenant) per request."""
    pictures = [random_png(rng, args.side) for _ in range(args.images)]
    tokens = (args.side // 32) ** 2
    out = []
    for i in range(args.requests):
        before = [rng.randrange(1, VISION_START) for _ in range(rng.randint(8, 40))]
        after = [rng.randrange(1, VISION_START) for _ in range(rng.randint(8, 40))]
        prompt = before + [VISION_START] + [IMAGE_TOKEN] * tokens + [VISION_END] + after
        out.append((prompt, rng.choice(pictures), i % args.tenants))
    return out


def run(path: str, cache_gb: float, requests: list, args) -> dict:
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", block_size=16, num_kv_blocks=1024,
                                    max_num_batched_tokens=2048, encoder_cache_gb=cache_gb, cpu_threads=args.threads))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    pending, added, ttft = list(enumerate(requests)), {}, {}
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(added) - len(ttft) < args.concurrency:
            i, (prompt, image, tenant) = pending.pop(0)
            policy = RequestPolicy(tenant=f"t{tenant}", cache_salt=f"salt-{tenant}")
            engine.add_request(prompt, params, request_id=str(i), policy=policy, images=[image])
            added[str(i)] = time.perf_counter()
        for out in engine.step():
            if out.token_ids and out.request_id not in ttft:
                ttft[out.request_id] = time.perf_counter() - added[out.request_id]
    wall = time.perf_counter() - start
    stats = engine.stats()
    engine.close()
    times = sorted(ttft.values())
    return dict(p50=statistics.median(times) * 1e3, p90=times[int(0.9 * (len(times) - 1))] * 1e3, wall=wall,
                hits=stats.encoder_cache_hits, misses=stats.encoder_cache_misses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--side", type=int, default=448, help="image side in pixels (a multiple of 32)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vision-depth", type=int, default=8)
    parser.add_argument("--tenants", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    requests = workload(rng, args)
    with tempfile.TemporaryDirectory() as path:
        write_checkpoint(path, args.vision_depth)
        print(f"{args.requests} requests, {args.images} images of {args.side}x{args.side} "
              f"({(args.side // 32) ** 2} tokens each), {args.tenants} tenant(s), {args.concurrency} in flight, "
              f"{args.threads} threads")
        for name, gb in (("cache", 1.0), ("no cache", 0.0)):
            r = run(path, gb, requests, args)
            print(f"{name:>9}: TTFT p50 {r['p50']:7.1f} ms  p90 {r['p90']:7.1f} ms  run {r['wall']:6.2f} s  "
                  f"encoder cache hits {r['hits']} misses {r['misses']} (images through the tower)")


if __name__ == "__main__":
    main()
