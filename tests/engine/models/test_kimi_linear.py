"""Kimi-Linear (Kimi Delta Attention : latent attention without positions 3:1, a dense first MLP, then grouped
bias-corrected sigmoid routing beside a shared expert): greedy tokens equal transformers' on a tiny random
checkpoint, with prompts chunked 16 tokens a step and a preemption forced; the KDA rule's chunked and recurrent
forms equal a float64 loop; what hybrid models are not served with yet is refused in one line; ``moegate serve``
answers a chat on a checkpoint whose config.json is laid out as published, with transformers' tokens."""

import asyncio
import json
import os
import random

import openai
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from engine.layers.kda_rule import chunked_kda_rule, recurrent_kda_rule
from engine.loading.demo_model import write_demo_tokenizer
from tests.gateway.serve_process import free_port, start_server, stop_server, wait_ready
from tests.engine.models.test_vs_transformers import hf_greedy
from tests.hf_models import randomize_constants_

VOCAB = 211

# The published plan cut to four layers: three KDA layers (3 heads of 8) then one latent-attention layer (no q
# LoRA, as published), a dense first MLP, 8 experts in 4 groups (2 kept), top-2 renormalised and scaled.
KIMI_CONFIG = dict(
    hidden_size=64, intermediate_size=48, moe_intermediate_size=20, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24,
    num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, norm_topk_prob=True, linear_head_dim=8, linear_num_heads=3, linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3,
)


def make_kimi_model(path: str, seed: int, vocab_size: int = VOCAB, eos_token_id: int | None = None, **overrides):
    """A random Kimi-Linear saved to ``path`` in the published layout (``q_conv1d``, ``block_sparse_moe``, experts
    ``w1``/``w2``/``w3``: transformers writes it back so); every parameter and buffer random, the decay rates
    (``A_log``, ``dt_bias``) as initialised, the norms and the correction bias drawn around theirs."""
    settings = {**KIMI_CONFIG, **overrides}  # as many layers as its ``layer_types`` lists
    config = AutoConfig.for_model("kimi_linear", vocab_size=vocab_size, num_hidden_layers=len(settings["layer_types"]),
                                  max_position_embeddings=1024, bos_token_id=None,
                                  eos_token_id=vocab_size - 1 if eos_token_id is None else eos_token_id,
                                  pad_token_id=0, initializer_range=0.08, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_constants_(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(checkpoint, requests, transformers' tokens, seed)."""
    seed = random.randrange(2**31)
    path = str(tmp_path_factory.mktemp("kimi_linear"))
    hf = make_kimi_model(path, seed)
    rng = random.Random(seed)
    # Past one 32-token chunk of the parallel form, and across many 16-token steps; a one-token prompt.
    lengths = [1, 17, 70, 130, rng.randint(3, 40)]
    # The 70- and 130-token requests decode 16 tokens each, so one is still running (5-6 blocks) while the other's
    # prompt needs 9 of the 12 blocks: a preemption is forced whatever the random lengths.
    reqs = [([rng.randrange(1, VOCAB - 1) for _ in range(n)], 16 if n >= 70 else rng.randint(4, 12)) for n in lengths]
    return path, reqs, [hf_greedy(hf, p, m) for p, m in reqs], seed


def test_greedy_matches_transformers_chunked_and_preempted(reference):
    path, reqs, expected, seed = reference
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=12, block_size=16, max_num_batched_tokens=16)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    assert [o.token_ids for o in llm.generate([p for p, _ in reqs], params)] == expected, f"seed={seed}"
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0, "the small KV pool should have forced preemption"
    model = llm.engine.model
    assert len(model.linear_layers()) == 3 and len(model.attention_layers()) == 1
    scheduler.states.check_all_free()
    scheduler.kv.pool.check_all_free()


def test_second_pass_hits_state_checkpoints_and_matches_transformers(reference):
    """The prefix cache on Kimi-Linear: the 70-token prompt again (alone, so nothing evicts its checkpoint) hits
    its 4 full blocks through the KDA layers' state checkpoint and still gives transformers' tokens."""
    path, reqs, expected, seed = reference
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=24, block_size=16, max_num_batched_tokens=16)
    (prompt, max_tokens), want = reqs[2], expected[2]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first, again = (llm.generate([prompt], [params])[0] for _ in range(2))
    assert first.token_ids == again.token_ids == want, f"seed={seed}"
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 64), f"seed={seed}"


@pytest.mark.parametrize("flags, named", [(dict(speculative="ngram"), "--speculative"),
                                          (dict(enable_lora=True), "--enable-lora"),
                                          (dict(pipeline_parallel_size=2), "--pipeline-parallel-size")])
def test_unsupported_features_are_refused_at_start(reference, flags, named):
    with pytest.raises(ValueError) as caught:
        LLM(model=reference[0], dtype="float32", device="cpu", num_kv_blocks=8, **flags)
    text = str(caught.value)
    assert "\n" not in text and text.startswith(f"{named} is not supported with hybrid linear-attention models "
                                                "(KimiLinearForCausalLM)"), text


def _kda_loop(q, k, v, g, beta, state):
    """The rule token by token in float64, as written: S = diag(exp g) S + k beta (v - (diag(exp g) S)^T k)^T."""
    q, k, v, g, beta, state = (t.double() for t in (q, k, v, g, beta, state))
    out = []
    for t in range(q.shape[0]):
        state = g[t].exp()[..., None] * state  # [h, dk, dv]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state = state + torch.einsum("hk,hv->hkv", k[t], u)
        out.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(out), state


def test_kda_rule_chunked_and_recurrent_equal_a_float64_loop():
    """One sequence of 45 tokens from a random state: chunked in two calls (20 then 25 tokens, chunks of 8: several
    whole chunks and a partial one each, the state carried between the calls), and one recurrent step a token,
    both equal the float64 loop; decays reach exp(-8) per step, so an unmasked chunk-wide exp would overflow."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    n, h, dk, dv = 45, 2, 8, 6
    q, k = (torch.nn.functional.normalize(torch.randn(n, h, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(n, h, dv, generator=gen)
    g = -8.0 * torch.rand(n, h, dk, generator=gen) ** 3  # per channel, mostly mild, some near-total forgetting
    beta = torch.rand(n, h, generator=gen)
    state = torch.randn(h, dk, dv, generator=gen)
    want, want_state = _kda_loop(q, k, v, g, beta, state)

    o1, s1 = chunked_kda_rule(q[:20], k[:20], v[:20], g[:20], beta[:20], state, chunk=8)
    o2, s2 = chunked_kda_rule(q[20:], k[20:], v[20:], g[20:], beta[20:], s1, chunk=8)
    torch.testing.assert_close(torch.cat([o1, o2]).double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s2.double(), want_state, rtol=1e-4, atol=1e-4)

    s, outs = state[None], []
    for t in range(n):
        o, s = recurrent_kda_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
        outs.append(o[0])
    torch.testing.assert_close(torch.stack(outs).double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s[0].double(), want_state, rtol=1e-4, atol=1e-4)


def write_published_config(path: str) -> None:
    """Rewrite ``path``'s config.json as the published checkpoints lay it out: the layer plan in
    ``linear_attn_config`` (1-based layer numbers, beside the KDA heads and kernel), ``first_k_dense_replace``
    instead of ``mlp_layer_types``, ``mla_use_nope``, and an ``auto_map`` to remote code that is not there."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    kinds = config.pop("layer_types")
    assert config.pop("mlp_layer_types") == ["dense"] + ["sparse"] * (len(kinds) - 1)
    config.update(
        linear_attn_config=dict(
            kda_layers=[i + 1 for i, kind in enumerate(kinds) if kind == "linear_attention"],
            full_attn_layers=[i + 1 for i, kind in enumerate(kinds) if kind == "full_attention"],
            num_heads=config.pop("linear_num_heads"), head_dim=config.pop("linear_head_dim"),
            short_conv_kernel_size=config.pop("linear_conv_kernel_dim")),
        first_k_dense_replace=1, mla_use_nope=True,
        auto_map={"AutoConfig": "configuration_kimi.KimiLinearConfig",
                  "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
    )
    with open(file, "w") as f:
        json.dump(config, f)


# Plain ChatML turns: no reasoning or tool markup, so the reply is the generated text as it is.
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_moegate_serve_answers_a_chat(tmp_path):
    """``moegate serve --model DIR`` on a tiny Kimi-Linear (its config.json as published; queries through a q
    LoRA, unlike the other test's) with the demo tokenizer and a ChatML template: a chat's greedy reply (its tokens
    shown as ids) is transformers' greedy continuation of the templated prompt."""
    path = str(tmp_path / "kimi")
    vocab, eos = write_demo_tokenizer(path, CHATML)
    seed = random.randrange(2**31)
    hf = make_kimi_model(path, seed, vocab_size=vocab, eos_token_id=eos, q_lora_rank=24)  # q through a LoRA here
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    prompt = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True,
                                                                     tokenize=True, return_dict=True)["input_ids"]
    expected = hf_greedy(hf, prompt, 8)
    write_published_config(path)
    port = free_port()
    proc, key = start_server(path, f"sqlite:///{tmp_path / 'policy.db'}", port, "--data-dir", str(tmp_path / "data"),
                             "--served-model-name", "kimi")
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(url))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(
            model="kimi", messages=messages, temperature=0, max_tokens=8, logprobs=True,
            extra_body=dict(ignore_eos=True, return_tokens_as_token_ids=True),
        )
    finally:
        stop_server(proc)
    choice = reply.choices[0]
    assert [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content] == expected, f"seed={seed}"
    assert choice.finish_reason == "length" and reply.usage.prompt_tokens == len(prompt), reply
