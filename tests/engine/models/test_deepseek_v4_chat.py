"""DeepSeek-V4 behind the gateway: a chat over the HTTP API (the gateway in this process, the engine in its own
process, as ``moegate serve`` runs them) answers with transformers' greedy tokens (marked slow: the engine
process's start dominates its time); ``moegate serve`` refuses a setting not served with it yet in one line."""

import random

import openai
import pytest
import torch
from transformers import AutoTokenizer

from engine.loading.demo_model import write_demo_tokenizer
from tests.engine.models.test_deepseek_v4 import make_v4_model
from tests.engine.models.test_kimi_linear import CHATML
from tests.engine.models.test_sparse_attention import earlier_first_topk
from tests.engine.models.test_vs_transformers import hf_greedy
from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key


@pytest.mark.slow
def test_gateway_answers_a_chat(tmp_path):
    """A chat through the gateway (its HTTP API, in this process) on a tiny DeepSeek-V4 with the demo tokenizer and
    a ChatML template: the greedy reply (its tokens shown as ids) is transformers' greedy continuation of the
    templated prompt."""
    path = str(tmp_path / "v4")
    vocab, eos = write_demo_tokenizer(path, CHATML)
    seed = random.randrange(2**31)
    hf = make_v4_model(path, seed, vocab_size=vocab, eos_token_id=eos)
    messages = [{"role": "user", "content": "Why is the sky blue? Say it in a few words, please."}]
    prompt = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True,
                                                                     tokenize=True, return_dict=True)["input_ids"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "topk", earlier_first_topk)
        expected = hf_greedy(hf, prompt, 8)
    with in_process_server(tmp_path, dict(device="cpu", dtype="float32", num_kv_blocks=16, cpu_threads=1),
                           checkpoint=path) as srv:
        key = srv.run(new_tenant_key(srv.database_url))
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
        reply = srv.run(client.chat.completions.create(
            model="demo", messages=messages, temperature=0, max_tokens=8, logprobs=True,
            extra_body=dict(ignore_eos=True, return_tokens_as_token_ids=True),
        ))
    choice = reply.choices[0]
    assert [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content] == expected, f"seed={seed}"
    assert choice.finish_reason == "length" and reply.usage.prompt_tokens == len(prompt), reply


def test_serve_refuses_a_setting_not_yet_served_with_deepseek_v4(tmp_path, capsys):
    """`moegate serve` with such a setting: exit 2, one line naming the flag, before the database is written."""
    from gateway.cli import main

    make_v4_model(str(tmp_path / "v4"), random.randrange(2**31))
    capsys.readouterr()  # the checkpoint writer's progress bar
    db = f"sqlite:///{tmp_path / 'policy.db'}"
    assert main(["serve", "--model", str(tmp_path / "v4"), "--database-url", db, "--quantization", "fp8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--quantization" in err and "DeepseekV4ForCausalLM" in err, err
    assert not (tmp_path / "policy.db").exists()
