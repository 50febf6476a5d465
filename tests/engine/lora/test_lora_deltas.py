"""LoRA adapters read from PEFT's format give, batched over a mix of base-model and adapter tokens, exactly the
outputs of transformers + PEFT for each token's adapter: attention projections (packed qkv, o_proj) and the
fused routed experts (PEFT ``target_parameters``)."""

import json
import os
import random

import pytest
import torch

from engine.lora.experts import lora_experts
from engine.lora.peft_format import AdapterFormatError, load_adapter
from engine.lora.slots import ExpertSlots, LinearSlots, LoraBatch
from moe_kernels.activation import SILU
from tests.hf_models import FAMILY_CONFIGS, make_hf_model

peft = pytest.importorskip("peft")

# Three adapters at three ranks: all of attention; q/v only; o_proj only (rsLoRA). Each also on both fused expert
# tensors (PEFT loads several adapters side by side only when they target the same parameters).
EXPERT_TENSORS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {
    "ad1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=EXPERT_TENSORS),
    "ad2": dict(r=2, lora_alpha=5, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_TENSORS),
    "ad3": dict(r=3, lora_alpha=3, use_rslora=True, target_modules=["o_proj"], target_parameters=EXPERT_TENSORS),
}
MAX_RANK = 4


def _num_experts(family: str) -> int:
    cfg = FAMILY_CONFIGS[family]
    return cfg.get("num_experts") or cfg["num_local_experts"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_mixed_batch_deltas_equal_transformers_peft(family, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(random.randrange(2**31))
    model_dir = str(tmp_path / "base")
    make_hf_model(family, model_dir, seed=random.randrange(2**31))
    for name, cfg in ADAPTERS.items():  # random A and B (init_lora_weights=False), saved by PEFT
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        get_peft_model(model, LoraConfig(init_lora_weights=False, **cfg)).save_pretrained(str(tmp_path / name))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                    str(tmp_path / "ad1"), adapter_name="ad1")
    for name in ("ad2", "ad3"):
        ref.load_adapter(str(tmp_path / name), adapter_name=name)
    hidden, num_experts = base.config.hidden_size, _num_experts(family)
    expert_size = base.model.layers[0].mlp.experts.down_proj.shape[2]
    adapters = [load_adapter(n, str(tmp_path / n), num_experts, hidden, expert_size) for n in ADAPTERS]

    layer_index = 1
    prefix = f"model.layers.{layer_index}"
    attn = base.model.layers[layer_index].self_attn
    ref_layer = ref.base_model.model.model.layers[layer_index]
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    qkv_w = torch.cat([q, k, v])  # the engine's packed qkv_proj [q+2kv, H]
    rows = [(0, q.shape[0]), (q.shape[0], q.shape[0] + k.shape[0]), (q.shape[0] + k.shape[0], qkv_w.shape[0])]
    qkv_slots = LinearSlots(len(ADAPTERS) + 1, MAX_RANK, hidden, rows)
    o_slots = LinearSlots(len(ADAPTERS) + 1, MAX_RANK, attn.o_proj.weight.shape[1], [(0, hidden)])
    experts = base.model.layers[layer_index].mlp.experts
    w13, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()  # [E, 2I, H], [E, H, I]
    w13_slots = ExpertSlots(len(ADAPTERS) + 1, MAX_RANK, num_experts, w13.shape[1], hidden)
    w2_slots = ExpertSlots(len(ADAPTERS) + 1, MAX_RANK, num_experts, hidden, w2.shape[2])
    # Adapters go into slots in a shuffled order: slot s serves order[s - 1].
    order = random.sample(range(len(adapters)), len(adapters))
    for slot, i in enumerate(order, start=1):
        qkv_slots.load(slot, adapters[i].linears.get(f"{prefix}.self_attn.qkv_proj"))
        o_slots.load(slot, adapters[i].linears.get(f"{prefix}.self_attn.o_proj"))
        w13_slots.load(slot, adapters[i].experts.get(f"{prefix}.mlp.experts.w13"))
        w2_slots.load(slot, adapters[i].experts.get(f"{prefix}.mlp.experts.w2"))

    num_tokens, top_k = 23, base.config.num_experts_per_tok
    slot_ids = torch.tensor([0, 1, 2, 3] + [random.randrange(4) for _ in range(num_tokens - 4)])[torch.randperm(num_tokens)]
    batch = LoraBatch.build(slot_ids.tolist())
    x = torch.randn(num_tokens, hidden)
    attn_in = torch.randn(num_tokens, attn.o_proj.weight.shape[1])
    top_idx = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])  # [T, k]
    top_w = torch.rand(num_tokens, top_k)

    with torch.no_grad():
        got_qkv = qkv_slots.add_delta(x, x @ qkv_w.T, batch)  # [T, q+2kv]
        got_o = o_slots.add_delta(attn_in, attn_in @ attn.o_proj.weight.T, batch)  # [T, H]
        # The routed experts: every (token, expert) pair under its token's adapter.
        got_moe = lora_experts(x, top_w, top_idx, batch, w13, w2, w13_slots, w2_slots, SILU)  # [T, H]

        for t in range(num_tokens):
            s = int(slot_ids[t])
            if s == 0:
                ctx = ref.disable_adapter()
            else:
                ref.set_adapter(list(ADAPTERS)[order[s - 1]])
                ctx = torch.no_grad()
            with ctx:
                xt, at = x[t:t + 1], attn_in[t:t + 1]
                want_qkv = torch.cat([ref_layer.self_attn.q_proj(xt), ref_layer.self_attn.k_proj(xt),
                                      ref_layer.self_attn.v_proj(xt)], dim=-1)
                want_o = ref_layer.self_attn.o_proj(at)
                want_moe = ref_layer.mlp.experts(xt, top_idx[t:t + 1], top_w[t:t + 1])
            torch.testing.assert_close(got_qkv[t:t + 1], want_qkv, rtol=1e-5, atol=1e-5, msg=f"qkv token {t} slot {s}")
            torch.testing.assert_close(got_o[t:t + 1], want_o, rtol=1e-5, atol=1e-5, msg=f"o_proj token {t} slot {s}")
            torch.testing.assert_close(got_moe[t:t + 1], want_moe, rtol=1e-4, atol=1e-5, msg=f"experts token {t} slot {s}")
    # The adapters changed something (random, non-zero factors): a base-model answer would fail above.
    assert not torch.allclose(got_qkv, x @ qkv_w.T) and not torch.allclose(got_o, attn_in @ attn.o_proj.weight.T)


def test_malformed_adapter_dirs_are_refused_with_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AdapterFormatError, match="no adapter_config.json") as e:
        load_adapter("x", str(empty))
    assert "\n" not in str(e.value)
    (empty / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    (empty / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(AdapterFormatError, match="use_dora"):
        load_adapter("x", str(empty))
    (empty / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    with pytest.raises(AdapterFormatError, match="cannot be read"):
        load_adapter("x", str(empty))
    (empty / "adapter_config.json").write_text("{")
    with pytest.raises(AdapterFormatError, match="not readable JSON"):
        load_adapter("x", str(empty))
    assert os.path.isdir(empty)
