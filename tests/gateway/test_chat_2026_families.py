"""A chat through the gateway on a tiny random checkpoint of each 2026 family that no other test chats with:
Qwen3.5-MoE's text model, DeepSeek-V3.2, GLM-5, MiniMax-M3, MiMo-V2-Flash, Step-3.7-Flash and Hy3. Each checkpoint
(every parameter random, built as the family's own engine test builds it) gets the demo model's tokenizer and chat
template; the official ``openai`` client's greedy chat gets transformers' greedy reply to the same rendered prompt:
its text, its prompt tokens and its completion tokens.

The other 2026 families chat elsewhere: Qwen3-Next in ``tests/gateway/test_serve.py``, Kimi-Linear in
``tests/engine/models/test_kimi_linear.py`` (both a real ``moegate serve``), DeepSeek-V4 in
``tests/engine/models/test_deepseek_v4_chat.py`` and Qwen3.5-MoE with images in
``tests/gateway/test_chat_images_qwen3_5.py``.

The gateway runs in this process (``tests.gateway.in_process``): the same ``create_app`` over the same
``AsyncEngine``, whose engine runs in a process of its own, as ``moegate serve --model DIR`` builds them. What
only the command adds (its flags read into the engine's settings, its start-up check of the checkpoint, the
policy database's bootstrap, ``web.run_app``) runs through a real ``moegate serve`` process in the Qwen3-Next and
Kimi-Linear chats named above."""

import random

import openai
import pytest
import torch
from transformers import AutoTokenizer

from engine.loading.demo_model import write_demo_tokenizer
from tests.engine.models.test_minimax_m3 import make_m3_model
from tests.engine.models.test_sparse_attention import FAMILIES as DSA_FAMILIES, earlier_first_topk, make_dsa_model
from tests.engine.models.test_step3p7 import make_step_model
from tests.engine.models.test_vs_transformers import hf_greedy
from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key
from tests.hf_models import make_hf_model

MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Name three rivers of Europe, briefly."}]
# The demo template knows <think> blocks, so "auto" would read the reply with a reasoning parser: the reply's
# text is compared whole.
PARSERS = dict(reasoning_parser=None, tool_call_parser=None)


def _dsa(family: str):
    return lambda path, seed, vocab, eos: make_dsa_model(family, path, seed, vocab_size=vocab, eos_token_id=eos,
                                                         **DSA_FAMILIES[family])


def _text(family: str):
    return lambda path, seed, vocab, eos: make_hf_model(family, path, seed, vocab_size=vocab, eos_token_id=eos)


# family -> (builder(path, seed, vocab size, EOS id) -> transformers' model, saved to path).
BUILDERS = {
    "qwen3_5_moe": _text("qwen3_5_moe"),  # its text model (Qwen3_5MoeForCausalLM)
    "deepseek_v32": _dsa("deepseek_v32"),
    "glm_moe_dsa": _dsa("glm_moe_dsa"),
    "minimax_m3": lambda path, seed, vocab, eos: make_m3_model(path, seed, vocab, eos_token_id=eos),
    "mimo_v2_flash": _text("mimo_v2_flash"),
    "step3p7": lambda path, seed, vocab, eos: make_step_model(path, seed, vocab, eos_token_id=eos),
    "hy_v3": _text("hy_v3"),
}


def _checkpoint(family: str, path: str, seed: int):
    """The family's random checkpoint with the demo tokenizer and chat template beside it, and transformers' reply
    to ``MESSAGES``: (rendered prompt ids, reply ids up to and with EOS if it comes, the tokenizer)."""
    vocab, eos = write_demo_tokenizer(path)
    hf = BUILDERS[family](path, seed, vocab, eos)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    with pytest.MonkeyPatch.context() as patch:
        # The lightning indexer's tied scores taken in index order, as the engine takes them; other top-k calls
        # (routing) choose the same: their random scores do not tie.
        patch.setattr(torch.Tensor, "topk", earlier_first_topk)
        reply = hf_greedy(hf, prompt, MAX_TOKENS)
    if eos in reply:  # the engine stops at EOS and counts it
        reply = reply[:reply.index(eos) + 1]
    return prompt, reply, tokenizer


def _check(reply, prompt: list[int], expected: list[int], tokenizer, seed: int) -> None:
    assert reply.usage.prompt_tokens == len(prompt), f"seed={seed}"
    assert reply.usage.completion_tokens == len(expected), f"seed={seed}"
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True), f"seed={seed}"


@pytest.mark.parametrize("family", BUILDERS)
def test_gateway_answers_a_chat(tmp_path, family):
    """The official client's greedy chat through the in-process gateway gets transformers' reply."""
    seed = random.randrange(2**31)
    path = str(tmp_path / family)
    prompt, expected, tokenizer = _checkpoint(family, path, seed)
    with in_process_server(tmp_path, dict(device="cpu", dtype="float32", num_kv_blocks=16, cpu_threads=1),
                           gateway=PARSERS, checkpoint=path) as srv:
        key = srv.run(new_tenant_key(srv.database_url))
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
        reply = srv.run(client.chat.completions.create(model="demo", messages=MESSAGES, temperature=0,
                                                       max_tokens=MAX_TOKENS))
    _check(reply, prompt, expected, tokenizer, seed)
