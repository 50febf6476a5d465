"""A batch mixing the base model and three LoRA adapters gives each request exactly transformers + PEFT's greedy
tokens for its adapter (up to a near tie: tests.greedy_ties), through chunked prefill, preemption and prefix-cache
hits (each forced and asserted)."""

import functools
import random

import pytest
import torch

from engine import LLM, RequestPolicy, SamplingParams
from tests.hf_models import make_hf_model
from tests.engine.lora.peft_reference import peft_greedy_tokens, peft_last_logits
from tests.greedy_ties import assert_greedy_equal_up_to_a_near_tie

peft = pytest.importorskip("peft")

# Adapters at three ranks on attention and on the fused routed experts (PEFT target_parameters; PEFT loads several
# adapters side by side only when they target the same parameters), random A and B (init_lora_weights=False).
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {
    "ad1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=EXPERTS),
    "ad2": dict(r=2, lora_alpha=5, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS),
    "ad3": dict(r=3, lora_alpha=3, use_rslora=True, target_modules=["k_proj", "o_proj"], target_parameters=EXPERTS),
}
# Qwen2-MoE: a shared expert in every MoE layer and a dense MLP layer (layer 1): LoRA on those MLPs too.
MLP_ADAPTERS = {
    "ad1": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "v_proj"], target_parameters=EXPERTS),
    "ad2": dict(r=2, lora_alpha=5, target_modules=["up_proj", "q_proj"], target_parameters=EXPERTS),
    "ad3": dict(r=3, lora_alpha=3, use_rslora=True, target_modules=["down_proj"], target_parameters=EXPERTS),
}
FAMILY_ADAPTERS = {"qwen3_moe": ADAPTERS, "mixtral": ADAPTERS, "qwen2_moe": MLP_ADAPTERS}
VOCAB = 211


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", list(FAMILY_ADAPTERS))
def test_mixed_adapters_match_transformers_peft(family, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    seed = random.randrange(2**31)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model_dir = str(tmp_path / "base")
    make_hf_model(family, model_dir, seed=seed, vocab_size=VOCAB)
    adapters = FAMILY_ADAPTERS[family]
    for name, cfg in adapters.items():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        get_peft_model(model, LoraConfig(init_lora_weights=False, **cfg)).save_pretrained(str(tmp_path / name))
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                    str(tmp_path / "ad1"), adapter_name="ad1")
    for name in ("ad2", "ad3"):
        ref.load_adapter(str(tmp_path / name), adapter_name=name)

    shared = [rng.randrange(1, VOCAB) for _ in range(40)]  # 2.5 blocks of 16: prefix hits for its later users
    def prompt(n):
        return [rng.randrange(1, VOCAB) for _ in range(n)]
    same = prompt(36)  # one prompt under two adapters: no shared blocks, different tokens
    reqs = [(None, prompt(30)), ("ad1", shared + prompt(5)), ("ad2", same), ("ad3", prompt(45)),
            ("ad1", shared + prompt(9)), ("ad1", same), (None, shared + prompt(3)), ("ad3", prompt(20)),
            ("ad2", prompt(50))]
    max_new = 8
    expected = [peft_greedy_tokens(ref, a, p, max_new) for a, p in reqs]

    paths = ",".join(f"{n}={tmp_path / n}" for n in adapters)
    llm = LLM(model=model_dir, dtype="float32", device="cpu", lora_adapters=paths, max_loras=3, max_lora_rank=4,
              num_kv_blocks=12, block_size=16, max_num_batched_tokens=24, overlap_scheduling=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    ids = [engine.add_request(p, params, policy=RequestPolicy(lora_adapter=a)) for a, p in reqs[:4]]
    outs: dict[str, object] = {}

    def drain():
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id] = o if o.request_id not in outs else outs[o.request_id].merge(o)

    drain()  # the first four fill the cache; the rest arrive after, so shared prefixes can hit
    ids += [engine.add_request(p, params, policy=RequestPolicy(lora_adapter=a)) for a, p in reqs[4:]]
    drain()
    for rid, (adapter, p), want in zip(ids, reqs, expected):
        assert_greedy_equal_up_to_a_near_tie(functools.partial(peft_last_logits, ref, adapter), p, outs[rid].token_ids,
                                             want, f"seed={seed} adapter={adapter} prompt_len={len(p)}")
    scheduler = engine.scheduler
    assert scheduler.num_preemptions > 0, f"seed={seed}: the small KV pool should have forced preemption"
    assert scheduler.kv.prefix_hit_tokens > 0, f"seed={seed}: no prefix-cache hit"
    assert max(len(p) for _, p in reqs) > 24  # prompts were chunked
    # The adapters matter: a base-model answer would have failed above for some adapter request.
    assert any(want != peft_greedy_tokens(ref, None, p, max_new) for (a, p), want in zip(reqs, expected) if a)
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request(same, params, policy=RequestPolicy(lora_adapter="missing"))
    scheduler.kv.pool.check_all_free()
