"""DeepSeek Sparse Attention families (DeepSeek-V3.2, GLM-5): greedy tokens equal transformers' on tiny random
checkpoints whose indexer keeps fewer tokens than the prompts hold (asserted: tokens are dropped), with prompts
chunked (16 tokens a step), a small KV pool that forces preemption, prefix-cache hits and n-gram drafts; settings
not yet served with them are refused in one line naming the flag."""

import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.layers.lightning_indexer import LightningIndexer
from tests.engine.models.test_vs_transformers import hf_greedy
from tests.hf_models import randomize_constants_

VOCAB = 211
INDEX_TOPK = 8  # far below the prompts (up to 130 tokens): most of each context is dropped
# MLA with q LoRA and a dense first layer, routed plus shared experts, as DeepSeek-V3's test shape; the indexer's
# eight heads of 32 (16 of them rotated).
SHAPE = dict(hidden_size=64, intermediate_size=48, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=20, n_shared_experts=1, first_k_dense_replace=1, index_topk=INDEX_TOPK,
             index_head_dim=32, index_n_heads=8)
FAMILIES = {
    # Grouped bias-corrected sigmoid routing (2 groups, 1 kept), half-split rope in the indexer.
    "deepseek_v32": dict(num_layers=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True),
    # Three layers: the middle one reuses the first one's selection, the last selects again; interleaved indexer rope.
    "glm_moe_dsa": dict(num_layers=3, indexer_types=["full", "shared", "full"], v_head_dim=16,
                        routed_scaling_factor=1.7),
}
# Chunked prefill at 16 tokens, a pool of 12 blocks of 16 (about a quarter of what the requests need together:
# preemption), prefix-cache hits (three prompts share 40 tokens) and n-gram drafts (two prompts loop).
SETTINGS = dict(num_kv_blocks=12, block_size=16, max_num_batched_tokens=16, speculative="ngram",
                num_speculative_tokens=3, speculative_max_batch=64, overlap_scheduling=False)


def earlier_first_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """``Tensor.topk`` with equal values taken in index order, as the engine's indexer takes them
    (``lightning_indexer.best_first``). The indexer's scores tie often (keys scored exactly 0), and ``torch.topk``
    breaks ties by where they fall in its row: without this the reference's choice among tied keys would depend on
    its row lengths, not on the model."""
    order = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))


def make_dsa_model(model_type: str, path: str, seed: int, num_layers: int, vocab_size: int = VOCAB,
                   eos_token_id: int | None = None, **overrides):
    """A random ``model_type`` model (every parameter drawn, norms and the indexer's included), saved to ``path``;
    EOS the last id unless ``eos_token_id`` says."""
    eos = vocab_size - 1 if eos_token_id is None else eos_token_id
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, num_hidden_layers=num_layers,
                                  max_position_embeddings=1024, eos_token_id=eos, bos_token_id=None,
                                  pad_token_id=0, initializer_range=0.08, **{**SHAPE, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_constants_(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    return model


def cycling_request(rng: random.Random, hf) -> tuple[list[int], list[int]]:
    """A prompt whose greedy output has settled into a short cycle, and its continuation, which keeps to it: the
    n-gram proposer's drafts (the tokens that followed the last n-gram before) are then accepted."""
    for _ in range(80):
        start = [rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(3, 8))]
        out = hf_greedy(hf, start, 32)
        for period in range(1, 5):
            cycle = out[-period:]
            if out[-3 * period:] == cycle * 3:
                continuation = hf_greedy(hf, start + out, 16)
                if continuation[:2 * period] == cycle * 2:
                    return start + out, continuation
    raise AssertionError("no greedy output settled into a cycle in 80 tries")


def make_requests(rng: random.Random, hf) -> tuple[list[tuple[list[int], int]], list[list[int]]]:
    """Three prompts sharing a 40-token prefix (prefix-cache hits once the first has computed its blocks), one in a
    cycle (accepted n-gram drafts), two of 130 tokens (each alone needs 9 of the 12 blocks: preemption), and
    transformers' greedy tokens for each."""
    prefix = [rng.randrange(1, VOCAB - 1) for _ in range(40)]
    prompts = [prefix + [rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    prompts += [[rng.randrange(1, VOCAB - 1) for _ in range(130)] for _ in range(2)]
    reqs = [(p, rng.randint(16, 32)) for p in prompts]
    expected = [hf_greedy(hf, p, m) for p, m in reqs]
    cycling, continuation = cycling_request(rng, hf)
    return reqs + [(cycling, len(continuation))], expected + [continuation]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(tmp_path, monkeypatch, family):
    seed = random.randrange(2**31)
    hf = make_dsa_model(family, str(tmp_path), seed, **FAMILIES[family])
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "topk", earlier_first_topk)
        reqs, expected = make_requests(random.Random(seed), hf)

    kept = []  # (visible keys, selected keys) per query row, over every indexed layer and step
    select = LightningIndexer.select

    def recording(self, q, weights, keys, visible):
        chosen = select(self, q, weights, keys, visible)
        kept.append((visible.sum(-1).flatten(), chosen.sum(-1).flatten()))
        return chosen

    monkeypatch.setattr(LightningIndexer, "select", recording)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", **SETTINGS)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    outs = llm.generate([p for p, _ in reqs], params)
    assert [o.token_ids for o in outs] == expected, f"seed={seed}"

    visible, chosen = (torch.cat(parts) for parts in zip(*kept))
    assert torch.equal(chosen, visible.clamp(max=INDEX_TOPK)), f"seed={seed}: each query keeps min(topk, visible)"
    assert int((visible - chosen).sum()) > 1000, f"seed={seed}: the indexer should drop most of the long contexts"
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0, f"seed={seed}: the small KV pool should have forced preemption"
    assert scheduler.kv.prefix_hit_tokens > 0, f"seed={seed}: no prefix-cache hit"
    assert scheduler.spec_accepted_tokens > 0, f"seed={seed}: no n-gram draft was accepted"
    scheduler.kv.pool.check_all_free()


@pytest.mark.parametrize("setting,flag", [(dict(pipeline_parallel_size=2), "--pipeline-parallel-size"),
                                          (dict(host_cache_gb=1.0), "--host-cache-gb"),
                                          (dict(role="prefill"), "--role")])
def test_unsupported_settings_are_refused(tmp_path, setting, flag):
    make_dsa_model("glm_moe_dsa", str(tmp_path), random.randrange(2**31), **FAMILIES["glm_moe_dsa"])
    with pytest.raises(ValueError) as caught:
        LLM(model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=16, **setting)
    text = str(caught.value)
    assert "\n" not in text and text.startswith(flag) and "GlmMoeDsaForCausalLM" in text, text


def test_serve_refuses_a_setting_not_yet_served_with_sparse_attention(tmp_path, capsys):
    """`moegate serve` with such a setting: exit 2, one line naming the flag, before the database is written."""
    from gateway.cli import main

    make_dsa_model("deepseek_v32", str(tmp_path / "dsa"), random.randrange(2**31), **FAMILIES["deepseek_v32"])
    capsys.readouterr()  # the checkpoint writer's progress bar
    db = f"sqlite:///{tmp_path / 'policy.db'}"
    assert main(["serve", "--model", str(tmp_path / "dsa"), "--database-url", db, "--pipeline-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--pipeline-parallel-size" in err and "DeepseekV32ForCausalLM" in err, err
    assert not (tmp_path / "policy.db").exists()
