"""Text-only streams' inter-token latency while requests with images arrive: the per-step encoder budget at work.

    python -m benchmarks.image_itl [--streams 8] [--seconds 20] [--every 0.5] [--images 4] [--side 448]
                                   [--max-batched-tokens 256] [--vision-depth 4] [--text-layers 8] [--threads 1]
                                   [--token-blocks N] [--no-budget] [--device cpu|cuda] [--dtype float32|bfloat16]

One process, one checkpoint written at start (transformers' ``Qwen3VLMoeForConditionalGeneration`` of small
shapes, its own random init; ``benchmarks.encoder_cache.write_checkpoint``), three runs one after another on the
same arrivals: text streams alone; with image requests under the default encoder budget (a step encodes at most
``max_num_batched_tokens`` image tokens, each image whole); with image requests under layer-chunked encoding
(``max_num_encoder_token_blocks``: ``--token-blocks``, default one tower block of one image, its patches: a step
runs that much of the tower); with ``--no-budget`` also with no encoder budget at all (every image a prompt chunk
reaches encoded in that step).

Workload: ``streams`` text-only requests decoding for the whole run (32-token prompts, ``ignore_eos``); every
``every`` seconds one request with ``images`` distinct random images of ``side`` x ``side`` pixels (never seen
before, so every one reaches the vision tower) and a little text, 4 generated tokens. Steps are chunked at
``max_batched_tokens`` tokens, so an image request's text is prefilled over several steps either way; what the
encoder budget bounds is the vision tower's work in one step.

The shape keeps a served model's proportions where they decide the result: the vision tower a fraction of the
text model's per-step work (``--vision-depth`` blocks of width 256 against ``--text-layers`` MoE layers over the
batch). Printed per run: the streams' inter-token gaps (after a 2 s warm-up) p50, p99 and max, the steps and
the image requests served; then each image run's p99 over the text-only run's. Nothing is asserted.
"""

import argparse
import random
import statistics
import tempfile
import time

import torch

from benchmarks.encoder_cache import IMAGE_TOKEN, VISION_END, VISION_START, random_png, write_checkpoint
from engine.core.config import EngineConfig
from engine.core.request_policy import RequestPolicy
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

WARMUP_S = 2.0


def image_requests(rng: random.Random, args) -> list[tuple[list[int], list[bytes]]]:
    """(prompt ids, images) for every arrival of the run: distinct images, text around each."""
    tokens = (args.side // 32) ** 2
    out = []
    for _ in range(int(args.seconds / args.every) + 1):
        prompt, images = [], []
        for _ in range(args.images):
            prompt += [rng.randrange(1, VISION_START) for _ in range(8)]
            prompt += [VISION_START] + [IMAGE_TOKEN] * tokens + [VISION_END]
            images.append(random_png(rng, args.side))
        out.append((prompt + [rng.randrange(1, VISION_START) for _ in range(8)], images))
    return out


def run(path: str, args, arrivals: list | None, encoder_tokens: int | None, token_blocks: int | None = None) -> dict:
    engine = LLMEngine(EngineConfig(model=path, device=args.device, dtype=args.dtype, block_size=16, num_kv_blocks=2048,
                                    max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.streams + 16,
                                    max_num_encoder_tokens=encoder_tokens, max_num_encoder_token_blocks=token_blocks,
                                    encoder_cache_gb=0.0,
                                    cpu_threads=args.threads))
    rng = random.Random(args.seed)
    stream = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    policy = RequestPolicy(tenant="t", cache_salt="t")
    for i in range(args.streams):
        engine.add_request([rng.randrange(1, VISION_START) for _ in range(32)], stream, request_id=f"s{i}",
                           policy=policy)
    last: dict[str, float] = {}
    gaps: list[float] = []
    steps, served, sent = 0, 0, 0
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < args.seconds:
        if arrivals is not None and sent < len(arrivals) and now - start >= WARMUP_S + sent * args.every:
            prompt, images = arrivals[sent]
            engine.add_request(prompt, short, request_id=f"i{sent}", policy=policy, images=images)
            sent += 1
        outputs = engine.step()
        steps += 1
        at = time.perf_counter()
        for out in outputs:
            if out.request_id.startswith("s") and out.token_ids:
                if out.request_id in last and last[out.request_id] - start >= WARMUP_S:
                    gaps.append(at - last[out.request_id])
                last[out.request_id] = at
            elif out.finished:
                served += 1
    engine.close()
    gaps.sort()
    return dict(p50=statistics.median(gaps) * 1e3, p99=gaps[int(0.99 * (len(gaps) - 1))] * 1e3,
                max=gaps[-1] * 1e3, steps=steps, sent=sent, served=served)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--every", type=float, default=0.5, help="seconds between image requests")
    parser.add_argument("--images", type=int, default=4, help="images per image request")
    parser.add_argument("--side", type=int, default=448, help="image side in pixels (a multiple of 32)")
    parser.add_argument("--max-batched-tokens", type=int, default=256)
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--text-layers", type=int, default=8)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--token-blocks", type=int, default=None,
                        help="layer-chunked run's tower work a step, in token-blocks (default: one block of one image)")
    parser.add_argument("--no-budget", action="store_true", help="also run with no encoder budget")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    arrivals = image_requests(random.Random(args.seed + 1), args)
    with tempfile.TemporaryDirectory() as path:
        write_checkpoint(path, args.vision_depth, args.text_layers, args.moe_intermediate)
        print(f"{args.streams} text streams; every {args.every} s a request with {args.images} images of "
              f"{args.side}x{args.side} ({(args.side // 32) ** 2} tokens each); steps of {args.max_batched_tokens} "
              f"tokens; {args.threads} thread(s)")
        token_blocks = args.token_blocks or (args.side // 16) ** 2  # patches of one image: one block of it
        plans = [("text only", None, None, None), ("images, encoder budget", arrivals, None, None),
                 (f"images, {token_blocks} token-blocks", arrivals, None, token_blocks)]
        if args.no_budget:
            plans.append(("images, no budget", arrivals, 10**9, None))
        runs = {}
        for name, arr, budget, blocks in plans:
            r = runs[name] = run(path, args, arr, budget, blocks)
            print(f"{name:>30}: ITL p50 {r['p50']:6.1f} ms  p99 {r['p99']:6.1f} ms  max {r['max']:6.1f} ms  "
                  f"steps {r['steps']}  image requests {r['served']}/{r['sent']}")
        base = runs["text only"]["p99"]
        for name, *_ in plans[1:]:
            print(f"ITL p99 {name} / text only: {runs[name]['p99'] / base:.2f}x")


if __name__ == "__main__":
    main()
