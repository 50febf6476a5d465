"""Images through the engine process: encoded bytes cross the pipe with the request, the engine decodes and
preprocesses them, and the tokens equal transformers' on the same picture; bytes that are not an image refuse that
request (naming the image) and the engine serves the next one."""

import asyncio
import io
import random

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.serving.async_engine import AsyncEngine, RequestRejectedError
from engine.vision.qwen_image_processing import process_image
from tests.engine.vision.qwen3_vl_checkpoint import IMAGE_CONFIG, hf_greedy, random_image, with_images
from tests.engine.vision.test_qwen3_vl_moe_vs_transformers import MAX_NEW


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.timeout(120)
def test_encoded_images_through_the_engine_process(qwen3_vl_checkpoint):
    path, model, seed = qwen3_vl_checkpoint
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pictures = [random_image(gen, rng.randint(12, 40), rng.randint(12, 40)) for _ in range(2)]
    processed = [process_image(p, IMAGE_CONFIG) for p in pictures]  # what the engine makes of the PNGs (lossless)
    prompt = with_images(rng, processed)
    expected = hf_greedy(model, prompt, processed, MAX_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

    async def main():
        engine = AsyncEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=32,
                                          block_size=4, cpu_threads=1))
        await engine.start()
        try:
            with pytest.raises(RequestRejectedError, match="image 1: not an image"):
                async for _ in engine.generate(prompt, params, images=[_png(pictures[0]), b"GIF89a garbage"]):
                    pass
            tokens = []
            async for out in engine.generate(prompt, params, images=[_png(p) for p in pictures]):
                tokens += out.token_ids
            return tokens
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == expected, f"seed={seed}"
