"""LoRA adapters read from PEFT's format give, batched over a mix of base-model and adapter tokens, exactly the
outputs of transformers + PEFT for each token's adapter: attention projections (packed qkv, o_proj) and the
fused routed experts (PEFT ``target_parameters``)."""

import json
import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # the experts' Triton delta kernel runs in Triton's CPU interpreter here
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


def _reference_experts(x, top_w, top_idx, slot_ids, w13, w2, w13_bias, w2_bias, factors):
    """Float64, token by token: each of the token's experts with its adapter's deltas (none on slot 0)."""
    x, top_w, w13, w2 = x.double(), top_w.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        s = int(slot_ids[t])
        for j in range(top_idx.shape[1]):
            e = int(top_idx[t, j])
            gate_up = w13[e] @ x[t] + w13_bias[e].double()
            if s:
                gate_up += factors[s][0].b[e].double() @ (factors[s][0].a[e].double() @ x[t])
            hidden = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            down = w2[e] @ hidden + w2_bias[e].double()
            if s:
                down += factors[s][1].b[e].double() @ (factors[s][1].a[e].double() @ hidden)
            out[t] += top_w[t, j] * down
    return out


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("path", ["padded", "grouped", "loop", "triton", "by_expert", "by_expert_loop"])
def test_expert_and_linear_deltas_equal_a_float64_loop(path, monkeypatch):
    """``lora_experts`` and ``LinearSlots.add_delta`` against float64 loops over tokens, through each way of
    computing the deltas: padded batched matmuls (few rows per group), grouped matmuls, and the per-group loop
    (dtypes ``torch._grouped_mm`` does not run: float64), and for the experts the Triton kernel (CUDA; here in
    Triton's interpreter) and the expert-by-expert path of prefill-sized CPU batches (grouped matmuls over one
    expert's adapters, or their loop); each forced by the thresholds that choose them. Random factors of random ranks, slots (base tokens
    and an adapter slot without tokens included), experts and biases."""
    import engine.lora.experts as experts_module
    import engine.lora.slots as slots_module
    from engine.lora.peft_format import ExpertsLora as ExpertFactors, LinearLora

    seed = random.randrange(2**31)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dtype = torch.float64 if path in ("loop", "by_expert_loop") else torch.float32
    # Whole batch at once (the float64 loop too, which the CPU would otherwise take expert by expert), or not.
    by_expert = path.startswith("by_expert")
    monkeypatch.setattr(experts_module, "_whole_batch", lambda *args: not by_expert)
    padded = path == "padded"
    monkeypatch.setattr(slots_module, "PADDED_MAX_ROWS", 10**6 if padded else 0)
    monkeypatch.setattr(slots_module, "LINEAR_PADDING_MAX", 10**6 if padded else 0)
    if path == "triton":
        monkeypatch.setattr(slots_module, "TRITON_DELTA_DEVICES", ("cpu", "cuda"))
    num_tokens, hidden, inter, num_experts, top_k, max_rank = rng.choice([(29, 32, 16, 6, 2, 4), (41, 48, 24, 8, 3, 6)])
    num_slots = 5  # base + 4 adapter slots; one of them gets no token
    w13 = torch.randn(num_experts, 2 * inter, hidden, dtype=dtype) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, dtype=dtype) / inter**0.5
    w13_bias, w2_bias = torch.randn(num_experts, 2 * inter, dtype=dtype), torch.randn(num_experts, hidden, dtype=dtype)
    w13_slots = ExpertSlots(num_slots, max_rank, num_experts, 2 * inter, hidden, dtype)
    w2_slots = ExpertSlots(num_slots, max_rank, num_experts, hidden, inter, dtype)
    linear = LinearSlots(num_slots, max_rank, hidden, [(0, 8), (8, 24)], dtype)  # two packed parts
    factors, linear_factors = {}, {}
    for slot in range(1, num_slots):
        rank = rng.randint(1, max_rank)
        factors[slot] = (ExpertFactors(torch.randn(num_experts, rank, hidden), torch.randn(num_experts, 2 * inter, rank)),
                         ExpertFactors(torch.randn(num_experts, rank, inter), torch.randn(num_experts, hidden, rank)))
        w13_slots.load(slot, factors[slot][0])
        w2_slots.load(slot, factors[slot][1])
        linear_factors[slot] = {p: LinearLora(torch.randn(rank, hidden), torch.randn(hi - lo, rank))
                                for p, (lo, hi) in enumerate(linear.part_rows)}
        linear.load(slot, linear_factors[slot])
    unused = rng.randrange(1, num_slots)
    used = [s for s in range(num_slots) if s != unused]
    slot_ids = torch.tensor(used + [rng.choice(used) for _ in range(num_tokens - len(used))])[torch.randperm(num_tokens)]
    batch = LoraBatch.build(slot_ids.tolist())
    assert (batch.padded_source is not None) == padded
    x = torch.randn(num_tokens, hidden, dtype=dtype)
    top_idx = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])  # [T, k]
    top_w = torch.rand(num_tokens, top_k, dtype=dtype)

    got = lora_experts(x, top_w, top_idx, batch, w13, w2, w13_slots, w2_slots, SILU, w13_bias, w2_bias)
    want = _reference_experts(x, top_w, top_idx, slot_ids, w13, w2, w13_bias, w2_bias, factors)
    tol = 1e-12 if dtype == torch.float64 else 1e-6  # relative to the output's norm: float32 sums differ in order
    assert _relative_error(got, want) < tol, f"seed {seed}: {_relative_error(got, want)}"
    no_delta = _reference_experts(x, top_w, top_idx, torch.zeros(num_tokens), w13, w2, w13_bias, w2_bias, factors)
    assert not torch.allclose(got.double(), no_delta, rtol=1e-3, atol=1e-3)  # the deltas were applied

    base_out = torch.randn(num_tokens, linear.part_rows[-1][1], dtype=dtype)
    got_linear = linear.add_delta(x, base_out.clone(), batch)
    want_linear = base_out.double().clone()
    for t, s in enumerate(slot_ids.tolist()):
        for p, (lo, hi) in enumerate(linear.part_rows):
            if s:
                pair = linear_factors[s][p]
                want_linear[t, lo:hi] += pair.b.double() @ (pair.a.double() @ x[t].double())
    assert _relative_error(got_linear, want_linear) < tol, f"seed {seed}: {_relative_error(got_linear, want_linear)}"
