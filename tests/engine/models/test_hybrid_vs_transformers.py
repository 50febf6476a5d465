"""Hybrid linear-attention families (Gated DeltaNet + gated full attention): greedy tokens equal transformers'
on tiny random checkpoints, with the prompts chunked (16 tokens a step), preemption forced by a small KV pool,
requests of different lengths batched (a one-token prompt among them), overlapped steps; a repeated prompt
gives the same tokens again (the prefix cache is on), and features they do not support yet are refused."""

import dataclasses
import json
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.model_setup import state_slots_for_memory
from engine.worker.state_cache import state_bytes_per_slot
from tests.engine.models.test_vs_transformers import hf_greedy
from tests.hf_models import make_hf_image_text_model, make_hf_model

FAMILIES = ("qwen3_next", "qwen3_5_moe")
VOCAB = 211


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """family -> (checkpoint, requests, transformers' tokens, seed), built once per module."""
    built = {}

    def get(family: str):
        if family not in built:
            seed = random.randrange(2**31)
            path = str(tmp_path_factory.mktemp(family))
            hf = make_hf_model(family, path, seed=seed, vocab_size=VOCAB)
            rng = random.Random(seed)
            # Past one 64-token chunk of the parallel form, and across many 16-token steps.
            lengths = [1, 2, 17, 70, 130] + [rng.randint(3, 60) for _ in range(2)]
            # The 70- and 130-token requests decode 16 tokens each, so one is still running (5-6 blocks) while the
            # other's prompt needs 9 of the 12 blocks: a preemption is forced whatever the random lengths.
            reqs = [([rng.randrange(1, VOCAB - 1) for _ in range(n)], 16 if n >= 70 else rng.randint(4, 16))
                    for n in lengths]
            built[family] = path, reqs, [hf_greedy(hf, p, m) for p, m in reqs], seed
        return built[family]

    return get


def _generate(llm: LLM, reqs):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    return [o.token_ids for o in llm.generate([p for p, _ in reqs], params)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(references, family, overlap):
    path, reqs, expected, seed = references(family)
    # 12 blocks of 16 tokens hold the longest request (146 tokens) but not the seven together: some are preempted
    # (their states recomputed on resume), and every prompt over 16 tokens is prefilled in chunks.
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=12, block_size=16, max_num_batched_tokens=16,
              overlap_scheduling=overlap)
    assert _generate(llm, reqs) == expected, f"seed={seed}"
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0, "the small KV pool should have forced preemption"
    # The same prompts again give the same tokens (hits or not: tests/engine/core/test_hybrid_prefix_cache.py).
    assert _generate(llm, reqs[:3]) == expected[:3], f"seed={seed}"
    scheduler.states.check_all_free()
    scheduler.kv.pool.check_all_free()


def test_unsupported_features_are_refused_at_start(references):
    path = references("qwen3_next")[0]
    with pytest.raises(ValueError, match=r"^--speculative is not supported with hybrid linear-attention models "
                                         r"\(Qwen3NextForCausalLM\)"):
        LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=8, speculative="ngram")


def test_state_slots_come_from_the_memory_budget(references, caplog):
    """Slots: one per request max_num_seqs lets run, within half the budget, said at start beside the KV blocks;
    a budget that cannot hold one is a ValueError naming the flag."""
    path = references("qwen3_5_moe")[0]
    with caplog.at_level("INFO"):
        llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=8, max_num_seqs=64)
    sizing = [r.message for r in caplog.records if r.message.startswith("state cache: ")]
    assert len(sizing) == 1 and "64 slots" in sizing[0] and "KV cache: 8 blocks of 16 tokens" in sizing[0], sizing
    engine = llm.engine
    per_slot = state_bytes_per_slot(engine.model, torch.float32)
    # conv [C, K - 1] + state [h, dk, dv] (float32) of the one linear layer: C = 2 * 1 * 12 + 3 * 8
    assert per_slot == (48 * 3 + 3 * 12 * 8) * 4
    assert engine.runner.state_slots == 64 == engine.scheduler.states.num_slots
    config = dataclasses.replace(engine.config, kv_cache_memory_gb=21.5 * per_slot / 2**30)
    assert state_slots_for_memory(config, engine.model, torch.device("cpu"), torch.float32) == 10
    with pytest.raises(ValueError, match="--kv-cache-memory-gb"):
        state_slots_for_memory(dataclasses.replace(config, kv_cache_memory_gb=per_slot / 2**30), engine.model,
                               torch.device("cpu"), torch.float32)


def test_published_qwen3_5_image_text_checkpoint_serves_text(tmp_path, caplog):
    """Qwen3.5-MoE is published as an image-text model: its language model's tensors under
    ``model.language_model.``, a vision tower beside them, the text model's config under ``text_config``. Its
    greedy tokens on text prompts equal transformers' image-text model's, served with images (the checkpoint has a
    vision config: ``tests/engine/vision/test_qwen3_5_moe_vl_vs_transformers.py`` sends it images) and, with the
    vision config taken out of config.json, as its text model (the tower's tensors skipped, said in one log line)."""
    seed = random.randrange(2**31)
    hf = make_hf_image_text_model("qwen3_5_moe", str(tmp_path), seed=seed, vocab_size=VOCAB)
    rng = random.Random(seed)
    reqs = [([rng.randrange(1, VOCAB - 1) for _ in range(n)], 6) for n in (5, 40)]
    expected = [hf_greedy(hf, p, m) for p, m in reqs]
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=16, max_num_batched_tokens=16)
    assert llm.engine.model.takes_images
    assert _generate(llm, reqs) == expected, f"seed={seed}"
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["vision_config"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with caplog.at_level("INFO"):
        llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=16, max_num_batched_tokens=16)
    assert not llm.engine.model.takes_images
    assert _generate(llm, reqs) == expected, f"seed={seed}"
    vision = [n for n in hf.state_dict() if n.startswith("model.visual.")]
    assert any(f"skipped {len(vision)} tensors" in r.message for r in caplog.records), caplog.text
