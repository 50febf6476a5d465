"""Agent and evaluation frameworks against an in-process server on the demo checkpoint, used as their users use
them: pydantic-ai's agents (text, streamed text, structured output through a forced output tool and through
response_format, a function tool called and its result sent back), llama-index's LiteLLM model (chat, streamed
chat, a required tool call answered, a function-calling program) and lm-eval's local-completions and
local-chat-completions models (loglikelihood, rolling loglikelihood, generate_until).

The demo model's text is random, so what is checked is what each client checks itself (its parse; types
validated on the first try, with no retry; tool arguments as JSON) and values against transformers: prompt
tokens against the checkpoint's chat template over the messages the client sent, lm-eval's scores against a
float64 log-softmax, its generations against greedy decoding. Blocking clients run on a worker thread while the
server's loop runs."""

import asyncio
import functools
import json
import random
from dataclasses import dataclass
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, Field

from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key
from tests.greedy_ties import NEAR_TIE

pytestmark = pytest.mark.timeout(240)


class Person(BaseModel):
    """A person"""

    name: str = Field(max_length=8)  # bounded: a random model cannot run on inside it
    age: int = Field(ge=0, le=120)


CITIES = ("Oslo", "Lima")


def weather_in(city: str) -> str:
    return f"8 degrees in {city}"


@dataclass
class Served:
    run: object  # run(awaitable) on the server's loop
    base_url: str
    key: str
    demo: str

    @functools.cached_property
    def tok(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.demo)

    @functools.cached_property
    def hf(self):
        """transformers' float32 model of the checkpoint."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.demo, dtype=torch.float32).eval()

    def prompt_tokens(self, body: dict) -> int:
        """The prompt length of a chat request's body, by transformers' rendering of its messages and tools."""
        kwargs = {"tools": body["tools"]} if body.get("tools") else {}
        return len(self.tok.apply_chat_template(body["messages"], tokenize=True, add_generation_prompt=True,
                                                return_dict=True, **kwargs)["input_ids"])

    def log_softmax(self, ids: list[int]) -> torch.Tensor:
        """transformers' float64 log-softmax [len(ids), V] over ``ids``."""
        with torch.no_grad():
            return torch.log_softmax(self.hf(torch.tensor([ids])).logits[0].double(), dim=-1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with in_process_server(tmp_path_factory.mktemp("frameworks"), dict(
            dtype="float32", num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048)) as srv:
        yield Served(srv.run, srv.base_url, srv.run(new_tenant_key(srv.database_url)), srv.demo)


def _words(n: int) -> str:
    return " ".join(random.choice(["river", "bread", "lamp", "mill", "stone", "the", "is", "high"]) for _ in range(n))


# --- pydantic-ai --------------------------------------------------------------------------------------------------

def _pydantic_ai_model(served: Served, provider_class, bodies: list[dict]):
    """pydantic-ai's chat-completions model on ``provider_class`` (OpenAIProvider or VLLMProvider), its openai
    client recording each request's body in ``bodies``."""
    import httpx2
    import openai
    from pydantic_ai.models.openai import OpenAIChatModel

    async def record(request):
        bodies.append(json.loads(request.content))

    client = openai.AsyncOpenAI(base_url=served.base_url, api_key=served.key, max_retries=0,
                                http_client=httpx2.AsyncClient(event_hooks={"request": [record]}))
    return OpenAIChatModel("demo", provider=provider_class(openai_client=client))


def _person_runs(served: Served, agent, prompt: str, streamed_prompt: str):
    """The agent's run on ``prompt`` and streamed run on ``streamed_prompt``, each ending in a Person (the
    streamed one's last partial output too): (the run's result, the streamed run's usage)."""
    async def go():
        whole = await agent.run(prompt)
        async with agent.run_stream(streamed_prompt) as stream:
            partial = [p async for p in stream.stream_output()]
            return whole, partial, await stream.get_output(), stream.usage

    whole, partial, streamed, streamed_usage = served.run(go())
    assert isinstance(whole.output, Person) and isinstance(streamed, Person) and partial[-1] == streamed
    return whole, streamed_usage


def test_pydantic_ai_text(served):
    """An agent's text run and streamed run: the usage it reads (the streamed one from the closing usage chunk it
    asks for) is the server's, against the chat template over the messages it sent."""
    from pydantic_ai import Agent, ModelSettings
    from pydantic_ai.providers.openai import OpenAIProvider

    bodies = []
    n = random.randint(3, 9)
    agent = Agent(_pydantic_ai_model(served, OpenAIProvider, bodies), model_settings=ModelSettings(
        max_tokens=n, seed=random.randrange(2**31), extra_body={"ignore_eos": True}))
    prompt = _words(6)

    async def go():
        whole = await agent.run(prompt)
        async with agent.run_stream(prompt) as stream:
            deltas = [d async for d in stream.stream_text(delta=True)]
            return whole, deltas, await stream.get_output(), stream.usage

    whole, deltas, streamed, streamed_usage = served.run(go())
    assert isinstance(whole.output, str) and "".join(deltas) == streamed
    assert [b.get("stream", False) for b in bodies] == [False, True]
    assert bodies[1]["stream_options"] == {"include_usage": True}
    prompt_tokens = served.prompt_tokens(bodies[0])
    for usage in (whole.usage, streamed_usage):
        assert (usage.input_tokens, usage.output_tokens, usage.requests) == (prompt_tokens, n, 1), usage


def test_pydantic_ai_tools_and_tool_output(served):
    """An agent with a function tool and a structured output type (pydantic-ai's default: an output tool), the
    function tool forced on the first step and the output tool on the second, as a capability that varies
    tool_choice per step does: the forced calls come back, their arguments validate at once (the agent may not
    retry), the tool's result is sent back and accepted; streamed the same."""
    from pydantic_ai import Agent, ModelSettings
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.providers.openai import OpenAIProvider

    @dataclass
    class WeatherFirst(AbstractCapability):
        def get_model_settings(self):
            return lambda ctx: ModelSettings(tool_choice=["get_weather"] if ctx.run_step <= 1 else ["final_result"])

    bodies, asked = [], []
    agent = Agent(_pydantic_ai_model(served, OpenAIProvider, bodies), output_type=Person, retries=0,
                  capabilities=[WeatherFirst()], model_settings=ModelSettings(
                      max_tokens=80, parallel_tool_calls=False, seed=random.randrange(2**31)))

    @agent.tool_plain
    def get_weather(city: Literal["Oslo", "Lima"]) -> str:
        """Weather in a city"""
        asked.append(city)
        return weather_in(city)

    whole, streamed_usage = _person_runs(served, agent, "Weather in Oslo, then describe a person.",
                                         "Weather in Lima, then describe a person.")
    assert len(asked) == 2 and set(asked) <= set(CITIES)
    for usage in (whole.usage, streamed_usage):
        assert (usage.requests, usage.tool_calls) == (2, 1), usage
    assert len(bodies) == 4
    for first, second in (bodies[0:2], bodies[2:4]):
        assert first["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
        assert second["tool_choice"] == {"type": "function", "function": {"name": "final_result"}}
        call, answer = second["messages"][-2:]
        assert call["tool_calls"][0]["function"]["name"] == "get_weather"
        assert answer == {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"],
                          "content": weather_in(json.loads(call["tool_calls"][0]["function"]["arguments"])["city"])}
    first_response = next(m for m in whole.all_messages() if m.kind == "response")
    assert first_response.usage.input_tokens == served.prompt_tokens(bodies[0])


def test_pydantic_ai_native_output(served):
    """NativeOutput on pydantic-ai's vLLM provider: response_format json_schema, the text parsed and validated
    into the type at once, streamed and not."""
    from pydantic_ai import Agent, ModelSettings, NativeOutput
    from pydantic_ai.providers.vllm import VLLMProvider

    bodies = []
    agent = Agent(_pydantic_ai_model(served, VLLMProvider, bodies), output_type=NativeOutput(Person), retries=0,
                  model_settings=ModelSettings(max_tokens=80, seed=random.randrange(2**31)))

    whole, streamed_usage = _person_runs(served, agent, "Describe a person.", "Describe a person.")
    assert whole.usage.requests == streamed_usage.requests == 1
    assert [b["response_format"]["type"] for b in bodies] == ["json_schema", "json_schema"]
    assert whole.usage.input_tokens == served.prompt_tokens(bodies[0])


# --- llama-index ----------------------------------------------------------------------------------------------

def test_llama_index_litellm(served, monkeypatch):
    """llama-index's LiteLLM model on moegate as a vLLM server (``hosted_vllm/``): chat (its usage against the
    chat template), streamed chat, a required tool call read by get_tool_calls_from_response (streamed too) and
    its result sent back, and a FunctionCallingProgram's structured output, whole and streamed."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else litellm's import fetches it from the web
    import litellm
    from llama_index.core.llms import ChatMessage
    from llama_index.core.program import FunctionCallingProgram
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.litellm import LiteLLM

    # What a litellm user declares for a served model, so that llama-index builds function-calling programs on it.
    litellm.register_model({"hosted_vllm/demo": {"litellm_provider": "hosted_vllm", "mode": "chat",
                                                 "supports_function_calling": True}})
    n = random.randint(3, 9)

    def llm(max_tokens: int, **extra) -> LiteLLM:
        return LiteLLM(model="hosted_vllm/demo", api_base=served.base_url, api_key=served.key, max_tokens=max_tokens,
                       max_retries=0, additional_kwargs={"extra_body": {"seed": random.randrange(2**31), **extra}})

    def get_weather(city: Literal["Oslo", "Lima"]) -> str:
        """Weather in a city"""
        return weather_in(city)

    tool = FunctionTool.from_defaults(fn=get_weather)
    prompt = _words(6)

    async def go():
        text = llm(n, ignore_eos=True)
        chat = await text.achat([ChatMessage(role="user", content=prompt)])
        chunks = [c async for c in await text.astream_chat([ChatMessage(role="user", content=prompt)])]
        tools = llm(60)
        called = await tools.achat_with_tools([tool], user_msg="Weather in Oslo?", tool_required=True)
        streamed = [c async for c in await tools.astream_chat_with_tools([tool], user_msg="Weather in Lima?",
                                                                         tool_required=True)]
        (selection,) = tools.get_tool_calls_from_response(called)
        output = await tool.acall(**selection.tool_kwargs)
        history = [ChatMessage(role="user", content="Weather in Oslo?"), called.message,
                   ChatMessage(role="tool", content=str(output), additional_kwargs={"tool_call_id": selection.tool_id})]
        answer = await tools.achat_with_tools([tool], chat_history=history)
        program = FunctionCallingProgram.from_defaults(output_cls=Person, prompt_template_str="Describe {who}.",
                                                       llm=llm(80), tool_choice="required")
        person = await program.acall(who="a person")
        partial = [p async for p in await program.astream_call(who="a person")]
        return chat, chunks, called, streamed, selection, answer, person, partial

    chat, chunks, called, streamed, selection, answer, person, partial = served.run(go())
    usage = chat.raw.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        served.prompt_tokens({"messages": [{"role": "user", "content": prompt}]}), n)
    assert isinstance(chat.message.content, str)
    assert chunks[-1].message.content == "".join(c.delta for c in chunks) != ""
    assert selection.tool_name == "get_weather" and selection.tool_kwargs["city"] in CITIES
    (streamed_selection,) = llm(1).get_tool_calls_from_response(streamed[-1])
    assert streamed_selection.tool_name == "get_weather" and streamed_selection.tool_kwargs["city"] in CITIES
    assert answer.raw.usage.prompt_tokens > called.raw.usage.prompt_tokens  # the call and its result were read
    assert isinstance(person, Person) and isinstance(partial[-1], Person)


# --- lm-eval ------------------------------------------------------------------------------------------------------

def _greedy(served: Served, ids: list[int], n: int) -> tuple[list[int], int]:
    """transformers' greedy continuation of ``ids`` (up to ``n`` tokens, ending at EOS) and how many of its
    tokens are sure: those before the first near tie, where another order of float sums may choose otherwise."""
    out, sure = [], None
    while len(out) < n and (not out or out[-1] != served.tok.eos_token_id):
        top = served.log_softmax(ids + out)[-1].topk(2)  # [2]
        if sure is None and (top.values[0] - top.values[1]).item() < NEAR_TIE:
            sure = len(out)
        out.append(top.indices[0].item())
    return out, len(out) if sure is None else sure


def _assert_generation(served: Served, got: str, ids: list[int], stop: str | None, n: int, where: str):
    """``got`` is transformers' greedy text after ``ids`` cut at ``stop`` (up to its sure tokens)."""
    greedy, sure = _greedy(served, ids, n)
    want = served.tok.decode(greedy, skip_special_tokens=True)
    if stop is not None and stop in want:
        want = want[:want.index(stop)]
    certain = served.tok.decode(greedy[:sure], skip_special_tokens=True)
    if sure == len(greedy) or len(want) <= len(certain):
        assert got == want, (where, got, want)
    else:
        assert got.startswith(certain), (where, got, certain)


def test_lm_eval_local_models(served, monkeypatch):
    """lm-eval's local-completions model (token-id prompts, a Hugging Face tokenizer) scores loglikelihood and
    rolling loglikelihood as transformers' float64 log-softmax does, greedy flags included (one continuation is
    the greedy one); its generate_until and local-chat-completions' return transformers' greedy text cut at the
    stop string."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    monkeypatch.setenv("OPENAI_API_KEY", served.key)  # where lm-eval's local models read the key
    common = dict(model="demo", max_retries=1, num_concurrent=1, seed=random.randrange(2**31), max_length=2048)
    lm = LocalCompletionsAPI(base_url=f"{served.base_url}/completions", tokenizer_backend="huggingface",
                             tokenizer=served.demo, **common)
    chat = LocalChatCompletion(base_url=f"{served.base_url}/chat/completions", tokenizer_backend=None, **common)

    pairs = [(_words(random.randint(3, 8)), " " + _words(random.randint(1, 4))) for _ in range(2)]
    for _ in range(20):  # one continuation greedy by construction: its text tokenizes back to the same ids
        context = _words(random.randint(3, 8))
        greedy, sure = _greedy(served, lm._encode_pair(context, " x")[0], 3)
        if sure == len(greedy) == 3 and lm._encode_pair(context, served.tok.decode(greedy))[1] == greedy:
            pairs.append((context, served.tok.decode(greedy)))
            break
    assert len(pairs) == 3, "no context with a greedy continuation that tokenizes back"
    rolling = _words(random.randint(5, 12))
    prompt, n = _words(5), 10
    greedy_text = served.tok.decode(_greedy(served, lm.tok_encode(prompt), n)[0], skip_special_tokens=True)
    stop = greedy_text[len(greedy_text) // 2:][:2] or None
    messages = [{"role": "user", "content": _words(5)}]

    def evaluate():
        scores = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
        rolled = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (rolling,), 0)])
        until = {"until": [stop] if stop else [], "max_gen_toks": n}
        text = lm.generate_until([Instance("generate_until", {}, (prompt, dict(until)), 0)])
        chatted = chat.generate_until([Instance("generate_until", {}, (JsonChatStr(json.dumps(messages)), dict(until)),
                                                0)])
        return scores, rolled, text, chatted

    scores, rolled, (text,), (chatted,) = served.run(asyncio.to_thread(evaluate))
    for (context, continuation), (logprob, is_greedy) in zip(pairs, scores):
        ctx, cont = lm._encode_pair(context, continuation)
        logp = served.log_softmax(ctx + cont)
        steps = [logp[len(ctx) + i - 1] for i in range(len(cont))]  # each [V]: the row predicting cont[i]
        assert logprob == pytest.approx(sum(row[t].item() for row, t in zip(steps, cont)), abs=2e-4 * len(cont))
        if all((row.topk(2).values[0] - row.topk(2).values[1]).item() >= NEAR_TIE for row in steps):
            assert is_greedy == all(row.argmax().item() == t for row, t in zip(steps, cont)), (context, continuation)
    assert scores[-1][1], "the greedy continuation is not scored greedy"
    ids = [lm.prefix_token_id] + lm.tok_encode(rolling)
    logp = served.log_softmax(ids)
    assert rolled[0] == pytest.approx(sum(logp[i - 1, ids[i]].item() for i in range(1, len(ids))), abs=2e-4 * len(ids))
    _assert_generation(served, text, lm.tok_encode(prompt), stop, n, "local-completions")
    chat_ids = served.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"]
    _assert_generation(served, chatted, chat_ids, stop, n, "local-chat-completions")
