"""DeepSeek-V4: greedy tokens equal transformers' on a tiny random checkpoint with all three attention kinds
(compressed sparse with an indexer keeping fewer entries than the prompts hold: asserted, entries are dropped;
heavily compressed; sliding only), hyper-connections over three streams and a hash-routed first MoE layer, with
prompts longer than the window and several compression windows, chunked (16 tokens a step), a KV pool small
enough to force preemption, and prefix-cache hits (a second pass over prompts sharing a prefix, resumed from
state checkpoints); settings not yet served with it are refused in one line naming the flag; the gateway answers
a chat with transformers' tokens."""

import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.layers.compressed_attention import Indexer
from tests.engine.models.test_sparse_attention import earlier_first_topk
from tests.engine.models.test_vs_transformers import hf_greedy
from tests.hf_models import randomize_constants_

VOCAB = 211
WINDOW = 8  # sliding window: the prompts (20 to 70 tokens) are far longer
INDEX_TOPK = 3  # compressed sparse attention keeps 3 of up to 17 entries (windows of 4)
SHAPE = dict(
    hidden_size=32, moe_intermediate_size=16, num_attention_heads=4, head_dim=32, q_lora_rank=24,
    partial_rotary_factor=0.5, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=WINDOW, o_groups=2, o_lora_rank=12, index_n_heads=4, index_head_dim=24, index_topk=INDEX_TOPK,
    hc_mult=3, swiglu_limit=0.5, routed_scaling_factor=1.7,
)
# The prefix cache resumes a hit from a state checkpoint (each layer's window and open compression windows): in
# this tiny model one takes more than the 8 blocks' KV, so their share of the memory is set high enough for a few,
# taken at every block boundary (the third prompt evicts most of the others' blocks from so small a pool).
SETTINGS = dict(num_kv_blocks=8, block_size=16, max_num_batched_tokens=16, overlap_scheduling=False,
                state_checkpoint_share=0.9, state_checkpoint_interval=1)


def make_v4_model(path: str, seed: int, vocab_size: int = VOCAB, eos_token_id: int = VOCAB - 1, **shape):
    """A random DeepSeek-V4 (every parameter drawn, the hash table too), saved to ``path`` (transformers writes
    the published layout: DeepSeek's tensor names, experts one by one); ``shape`` overrides entries of ``SHAPE``."""
    config = AutoConfig.for_model("deepseek_v4", vocab_size=vocab_size, num_hidden_layers=3,
                                  max_position_embeddings=1024, eos_token_id=eos_token_id, bos_token_id=None,
                                  pad_token_id=0, initializer_range=0.08, **{**SHAPE, **shape})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    randomize_constants_(model, generator)
    with torch.no_grad():  # each token's two experts, distinct
        table = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(vocab_size)])
        model.model.layers[0].mlp.gate.tid2eid.copy_(table)
    model.save_pretrained(path)
    return model


def test_greedy_matches_transformers(tmp_path, monkeypatch):
    seed = random.randrange(2**31)
    hf = make_v4_model(str(tmp_path), seed)
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB - 1) for _ in range(36)]
    shared = [prefix + [rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(1, 20))] for _ in range(2)]
    prompts = shared + [[rng.randrange(1, VOCAB - 1) for _ in range(70)]]
    reqs = [(p, rng.randint(8, 14)) for p in prompts]
    with monkeypatch.context() as patch:  # the indexer's ties taken in entry order, as the engine takes them
        patch.setattr(torch.Tensor, "topk", earlier_first_topk)
        expected = [hf_greedy(hf, p, m) for p, m in reqs]

    kept = []  # (visible entries, selected entries) per query row
    select = Indexer.select

    def recording(self, *args):
        chosen = select(self, *args)
        kept.append((args[5].sum(-1), chosen.sum(-1)))
        return chosen

    monkeypatch.setattr(Indexer, "select", recording)
    # the pool holds the largest request and nothing beside it, so running the three together must preempt
    # (8 blocks left seed 1218415440 without a preemption)
    blocks = max(-(-(len(p) + m) // SETTINGS["block_size"]) for p, m in reqs)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", **{**SETTINGS, "num_kv_blocks": blocks})
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    outs = llm.generate([p for p, _ in reqs], params)
    assert [o.token_ids for o in outs] == expected, f"seed={seed}"
    again = llm.generate(shared, params[:2])  # their prefix blocks are cached now
    assert [o.token_ids for o in again] == expected[:2], f"seed={seed}"

    visible, chosen = (torch.cat(parts) for parts in zip(*kept))
    assert torch.equal(chosen, visible.clamp(max=INDEX_TOPK)), f"seed={seed}"
    assert int((visible - chosen).sum()) > 50, f"seed={seed}: the indexer should drop entries"
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0, f"seed={seed}: the small KV pool should have forced preemption"
    assert scheduler.kv.prefix_hit_tokens > 0, f"seed={seed}: no prefix-cache hit"
    scheduler.kv.pool.check_all_free()


@pytest.mark.parametrize("setting,flag", [(dict(pipeline_parallel_size=2), "--pipeline-parallel-size"),
                                          (dict(host_cache_gb=1.0), "--host-cache-gb"),
                                          (dict(role="prefill"), "--role")])
def test_unsupported_settings_are_refused(tmp_path, setting, flag):
    from engine.core.config import EngineConfig
    from engine.core.family_support import check_family_support
    from engine.core.model_config import load_model_config

    make_v4_model(str(tmp_path), random.randrange(2**31))
    with pytest.raises(ValueError) as caught:
        check_family_support(EngineConfig(model=str(tmp_path), **setting), load_model_config(str(tmp_path)))
    text = str(caught.value)
    assert "\n" not in text and text.startswith(flag) and "DeepseekV4ForCausalLM" in text, text


def test_bfloat16_keeps_the_reference_float32_parameters(tmp_path, caplog):
    """Served in bfloat16, the parameters transformers keeps in float32 (norms, sinks, position biases,
    hyper-connections, the correction bias) stay float32 and the rest is bfloat16; a request is served. A
    next-token-prediction layer in the checkpoint (``mtp.*``, as published) is skipped with a log line."""
    from safetensors.torch import save_file

    make_v4_model(str(tmp_path), random.randrange(2**31))
    save_file({"mtp.0.attn.wq_a.weight": torch.randn(24, 32)}, str(tmp_path / "mtp.safetensors"))
    with caplog.at_level("INFO"):
        llm = LLM(model=str(tmp_path), dtype="bfloat16", device="cpu", num_kv_blocks=16)
    assert "next-token-prediction (MTP) layer(s) in the checkpoint are not loaded" in caplog.text
    assert "skipped 1 tensors" in caplog.text and "ignoring tensor" not in caplog.text
    kept = ("norm.weight", "sinks", "position_bias", "_hc.fn", "_hc.base", "_hc.scale", "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale",
            "e_score_correction_bias")
    for name, param in llm.engine.model.named_parameters():
        wanted = torch.int64 if name.endswith("tid2eid") else \
            torch.float32 if name.endswith(kept) else torch.bfloat16
        assert param.dtype == wanted, (name, param.dtype)
    out = llm.generate([[5, 6, 7] * 7], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)])
    assert len(out[0].token_ids) == 4
