"""The expert-load statistics on CUDA: read without the host ever waiting for the device, and exact once read.

(On the CPU the counters are read at once; ``test_prefix_cache`` checks their totals.)
"""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.hf_models import make_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_stats_never_wait_for_the_device_and_the_load_is_exact(tmp_path):
    """Overlapped steps on CUDA: ``stats()`` runs under sync debug mode "error" after every step (a read
    that waited for the step in flight would raise), reports the load about every
    ``EXPERT_LOAD_EVERY_CUDA`` steps, and the counts never decrease; at the end, each layer has routed
    top_k experts per token computed (prefill and decode), as the scheduler counted them."""
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    make_hf_model("qwen3_moe", str(tmp_path), seed=seed, vocab_size=97, num_layers=2)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", device="cuda", overlap_scheduling=True, num_kv_blocks=128)
    engine = llm.engine
    for i in range(4):
        engine.add_request([rng.randrange(1, 97) for _ in range(rng.randint(5, 40))],
                           SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), request_id=str(i))
    reads = []
    while engine.has_unfinished():
        engine.step()
        torch.cuda.set_sync_debug_mode("error")
        try:
            load = engine.stats().expert_load
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if load is not None:
            reads.append([sum(layer) for layer in load])
    assert len(reads) >= 2, f"seed={seed}: {len(reads)} reads over about 100 steps"
    assert all(a <= b for r0, r1 in zip(reads, reads[1:]) for a, b in zip(r0, r1)), f"seed={seed}: {reads}"
    torch.cuda.synchronize()
    final = None
    for _ in range(3 * 32):  # the next poll that queues a copy, then the one that hands it out
        engine.runner.num_steps += 1
        final = engine.runner.expert_load.poll(engine.runner.num_steps) or final
        if final is not None:
            break
        torch.cuda.synchronize()
    stats = engine.scheduler.stats()
    top_k = engine.model_config.cfg("num_experts_per_tok")
    tokens = stats.total_prefill_tokens + stats.total_decode_tokens
    assert final is not None and [sum(layer) for layer in final] == [top_k * tokens] * len(final), f"seed={seed}"
