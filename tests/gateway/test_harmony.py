"""gpt-oss's chat through the ``openai-harmony`` package, offline.

The real o200k_base vocabulary comes from the ``litellm`` wheel (its copy of tiktoken's file); transformers'
TikTokenConverter turns it into a ``tokenizer.json`` (the independent reference), from which the server must
rebuild the file byte for byte. A tiny random gpt-oss checkpoint with that o200k_harmony tokenizer is served:
its chat prompts must be the tokens the package renders for the same conversation, harmony-formatted outputs
(rendered by the package from messages) must come back as ``reasoning_content``, ``tool_calls`` and ``content``,
whole and streamed, and the official ``openai`` client must get answers from it.
"""

import datetime
import hashlib
import importlib.util
import json
import random
from pathlib import Path

import aiohttp
import msgspec
import openai
import pytest
from openai_harmony import (
    Author, Conversation, DeveloperContent, Message, ReasoningEffort, Role, SystemContent, ToolDescription,
)
from tokenizers import AddedToken, Tokenizer, models
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.text import harmony_vocab
from gateway.chat_plan import ParserChoice, plan as plan_chat
from gateway.completion import prepare_prompts
from gateway.openai_schema import ChatCompletionRequest
from gateway.response_bodies import parsed_choice
from gateway.responses.request import decode_request
from gateway.responses.translate import chat_request
from gateway.sse import _ChunkChoices
from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key
from tests.hf_models import make_hf_model

pytestmark = pytest.mark.timeout(300)

# tiktoken's cache name for o200k_base (the SHA-1 of its URL), as the litellm wheel ships it (found without
# importing litellm, which takes seconds).
O200K_FILE = (Path(importlib.util.find_spec("litellm").origin).parent / "litellm_core_utils" / "tokenizers"
              / "fb374d419588a4632f3f557e76b4b70aebbca790")
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
])
# o200k_harmony's named special tokens (the rest of 199,998..201,087 are <|reserved_N|>).
SPECIALS = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
            200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"}
VOCAB_SIZE = 201_088

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
             "q": {"type": "string"}}}}}]


def harmony_tokenizer() -> PreTrainedTokenizerFast:
    """gpt-oss's tokenizer: o200k_base converted by transformers, then harmony's special tokens."""
    tok = TikTokenConverter(vocab_file=str(O200K_FILE), pattern=O200K_PATTERN).converted()
    tok.add_special_tokens([AddedToken(SPECIALS.get(i, f"<|reserved_{i}|>"), special=True)
                            for i in range(harmony_vocab.NUM_RANKS, VOCAB_SIZE)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def tokenizer():
    return harmony_tokenizer()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer):
    """(server, its engine, a key, the harmony encoding): a tiny random gpt-oss with the o200k_harmony tokenizer;
    nothing downloaded, the vocabulary file written from the tokenizer into a fresh cache directory."""
    root = tmp_path_factory.mktemp("harmony")
    checkpoint = str(root / "gpt-oss-tiny")
    make_hf_model("gpt_oss", checkpoint, seed=random.randrange(1000), vocab_size=VOCAB_SIZE, hidden_size=32,
                  num_layers=2)
    tokenizer.save_pretrained(checkpoint)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(harmony_vocab.ENV_VAR, raising=False)
        mp.setenv(harmony_vocab.CACHE_ENV_VAR, str(root / "cache"))
        mp.setattr(harmony_vocab, "_encoding", None)  # loaded afresh, by the server's first chat
        with in_process_server(root, dict(num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=512,
                                          max_model_len=1024, cpu_threads=1), checkpoint=checkpoint) as srv:
            key = srv.run(new_tenant_key(srv.database_url, "harmony"))
            yield srv, key, root


def _body(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"model": "demo", **fields}, ChatCompletionRequest)


def _plan(srv, body: ChatCompletionRequest):
    engine = srv.engine
    return plan_chat(body, ParserChoice().resolve(engine.chat_template(), engine.info.architecture))


def test_vocabulary_file_rebuilt_from_the_tokenizer(tokenizer, tmp_path):
    """The server's o200k_base.tiktoken from transformers' conversion of the real file: the same bytes; written
    once; a tokenizer that is not o200k is refused in one line."""
    expected = O200K_FILE.read_bytes()
    assert hashlib.sha256(expected).hexdigest() == harmony_vocab.SHA256  # the hash openai-harmony checks
    assert harmony_vocab.tiktoken_file_bytes(tokenizer) == expected
    path = harmony_vocab.write_vocab_file(tokenizer, tmp_path / "cache")
    assert path.read_bytes() == expected and not list(path.parent.glob("*.tmp"))
    written = path.stat().st_mtime_ns
    assert harmony_vocab.write_vocab_file(tokenizer, tmp_path / "cache").stat().st_mtime_ns == written

    byte_level = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))  # not o200k: ranks missing
    with pytest.raises(harmony_vocab.HarmonyVocabError, match="not the o200k vocabulary") as err:
        harmony_vocab.write_vocab_file(byte_level, tmp_path / "other")
    assert "\n" not in str(err.value) and not (tmp_path / "other" / harmony_vocab.FILE_NAME).exists()


def _reference_prompt(encoding) -> list[int]:
    """The conversation of ``_history_body`` built with the package directly."""
    system = SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat()) \
        .with_reasoning_effort(ReasoningEffort.HIGH)
    developer = DeveloperContent.new().with_instructions("Answer briefly.\n\nUse metric units.").with_function_tools(
        [ToolDescription.new("get_weather", "Weather in a city", parameters=WEATHER),
         ToolDescription.new("search", "", parameters=TOOLS[1]["function"]["parameters"])])
    messages = [
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER, developer),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        Message.from_role_and_content(Role.ASSISTANT, "I need the forecast.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, "Checking.").with_channel("commentary"),
        Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris", "days": 2}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"temp": 21}')
        .with_channel("commentary").with_recipient("assistant"),
    ]
    return encoding.render_conversation_for_completion(Conversation.from_messages(messages), Role.ASSISTANT)


def _history_body(**extra) -> ChatCompletionRequest:
    return _body(messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "developer", "content": "Use metric units."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "I need the forecast.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ], tools=TOOLS, reasoning_effort="high", **extra)


def test_prompt_rendered_by_harmony(served):
    srv, key, root = served
    plan = _plan(srv, _history_body())
    assert plan.harmony and plan.tool_parser == plan.reasoning_parser == "harmony"
    ids = srv.run(srv.engine.prepare(None, plan.chat))
    assert (root / "cache" / "tiktoken" / harmony_vocab.FILE_NAME).read_bytes() == O200K_FILE.read_bytes()
    assert ids == _reference_prompt(harmony_vocab.harmony_encoding())
    for token, name in SPECIALS.items():  # the checkpoint's specials are harmony's
        assert harmony_vocab.harmony_encoding().encode(name, allowed_special="all") == [token]
    # The request's own stop tokens, then the package's for the assistant's actions (<|return|>, <|call|>).
    sampling = SamplingParams(stop_token_ids=[7])
    assert srv.run(prepare_prompts(srv.engine, _history_body(), True, plan, sampling)) == [ids]
    assert sampling.stop_token_ids == [7, *sorted(harmony_vocab.harmony_encoding().stop_tokens_for_assistant_actions())]

    async def post(body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
        async with aiohttp.ClientSession() as http, http.post(
                srv.server.make_url(path), json=body,
                headers={"Authorization": f"Bearer {key}"}) as r:
            return r.status, await r.json()

    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "nope", "content": "x"}]
    status, err = srv.run(post({"model": "demo", "messages": messages, "max_tokens": 2}))
    assert status == 400 and err["error"]["param"] == "messages[1].tool_call_id", err
    status, err = srv.run(post({"model": "demo", "messages": messages[:1], "reasoning_effort": "extreme"}))
    assert status == 400 and err["error"]["param"] == "reasoning_effort", err
    # /tokenize renders messages as the chat route does.
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    status, tokenized = srv.run(post({"model": "demo", "messages": chat}, "/tokenize"))
    rendered = srv.run(srv.engine.prepare(None, _plan(srv, _body(messages=chat)).chat))
    assert status == 200 and tokenized["tokens"] == rendered
    # The Responses API's reasoning effort is the system message's.
    responses = {"model": "demo", "input": "hi", "reasoning": {"effort": "low"}}
    req, items, tools = decode_request(json.dumps(responses).encode())
    ids = srv.run(srv.engine.prepare(None, _plan(srv, chat_request(req, items, tools)).chat))
    system = SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat()) \
        .with_reasoning_effort(ReasoningEffort.LOW)
    assert ids == harmony_vocab.harmony_encoding().render_conversation_for_completion(Conversation.from_messages(
        [Message.from_role_and_content(Role.SYSTEM, system), Message.from_role_and_content(Role.USER, "hi")]),
        Role.ASSISTANT)


def _completion(rng: random.Random, encoding) -> tuple[list[int], dict]:
    """A gpt-oss output rendered by the package (after the prompt's ``<|start|>assistant``) and what the reply
    must hold: reasoning, maybe a preamble, then calls or a final answer."""
    thought = rng.choice(["The user wants the weather. 2 < 3.", "Need tools.\nCall get_weather.", "Zürich? Ça va 🦜𝔘."])
    messages = [Message.from_role_and_content(Role.ASSISTANT, thought).with_channel("analysis")]
    content, calls = "", []
    if rng.random() < 0.6:
        if rng.random() < 0.5:
            content = rng.choice(["Checking now.", "One moment: <looking>"])
            messages.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("commentary"))
        for _ in range(rng.randint(1, 2)):
            name = rng.choice(["get_weather", "search"])
            args = {"city": rng.choice(["Paris", "São Paulo", 'a "quoted" name']), "days": rng.randint(1, 9)} \
                if name == "get_weather" else {"q": rng.choice(["x", "ünïcode", "a\nb"])}
            arguments = json.dumps(args, ensure_ascii=rng.random() < 0.5)
            messages.append(Message.from_role_and_content(Role.ASSISTANT, arguments).with_channel("commentary")
                            .with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))
            calls.append((name, args))
    else:
        content = rng.choice(["Paris.", "Line one.\nLine <two>.", "It is 20 °C in São Paulo."])
        messages.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("final"))
    tokens = []
    for m in messages:
        tokens += encoding.render(m)
    assert encoding.decode(tokens[:2]) == "<|start|>assistant"
    if tokens[-1] == 200007:  # a final answer: the package renders a lone message's end as <|end|>, the model
        tokens[-1] = 200002  # ends its reply with <|return|>
    return tokens[2:], {"reasoning": thought, "content": content, "calls": calls}


def _output(tokens: list[int], encoding, finished: bool) -> RequestOutput:
    return RequestOutput("r", list(tokens), encoding.decode(tokens), finished, "stop" if finished else None,
                         10, 0, len(tokens))


@pytest.mark.parametrize("seed", range(6))
def test_output_read_whole_and_streamed(served, seed):
    srv, *_ = served
    rng = random.Random(seed)
    encoding = harmony_vocab.harmony_encoding()
    body = _body(messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS)
    plan = _plan(srv, body)
    tokens, want = _completion(rng, encoding)

    message = parsed_choice(_output(tokens, encoding, True), 0, plan)["message"]
    assert message["reasoning_content"] == want["reasoning"]
    assert message["content"] == (want["content"] or None)
    calls = message.get("tool_calls") or []
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == want["calls"]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)

    chunks = _ChunkChoices(body, True, plan, 1)
    reasoning, content, streamed, finish = "", "", {}, None
    cuts = sorted(rng.sample(range(1, len(tokens)), k=rng.randint(1, len(tokens) // 2)))
    for a, b in zip([0, *cuts], [*cuts, len(tokens)]):
        for choice in chunks.of(_output(tokens[a:b], encoding, b == len(tokens)), 0):
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = streamed.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
                entry["id"] = call.get("id") or entry["id"]
                entry["name"] = (call.get("function") or {}).get("name") or entry["name"]
                entry["arguments"] += (call.get("function") or {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    assert (reasoning, content) == (want["reasoning"], want["content"])
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(streamed.items())] == want["calls"]
    assert all(c["id"].startswith("call_") for c in streamed.values())
    assert finish == ("tool_calls" if want["calls"] else "stop")

    # No tools offered (tool_choice none): reasoning still split off, a call's body stays text.
    no_tools = _plan(srv, _body(messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice="none"))
    message = parsed_choice(_output(tokens, encoding, True), 0, no_tools)["message"]
    assert message["reasoning_content"] == want["reasoning"] and "tool_calls" not in message
    assert message["content"].startswith(want["content"])
    assert [json.loads(x) for x in _json_values(message["content"][len(want["content"]):])] == \
        [a for _, a in want["calls"]]


def _json_values(text: str) -> list[str]:
    """The JSON objects written one after another in ``text``."""
    out, decoder, at = [], json.JSONDecoder(), 0
    while at < len(text):
        _, end = decoder.raw_decode(text, at)
        out.append(text[at:end])
        at = end
    return out


def test_off_format_output_is_content(served):
    """A model that answers without harmony's header (or cut off inside one): its text, as content."""
    srv, *_ = served
    encoding = harmony_vocab.harmony_encoding()
    plan = _plan(srv, _body(messages=[{"role": "user", "content": "hi"}], tools=TOOLS))
    tokens = encoding.encode("Just an answer, no channels.")
    message = parsed_choice(_output(tokens, encoding, True), 0, plan)["message"]
    assert message["content"] == "Just an answer, no channels." and message["reasoning_content"] is None
    cut = encoding.encode("<|channel|>analysis<|message|>still thinking", allowed_special="all")
    message = parsed_choice(_output(cut, encoding, True), 0, plan)["message"]
    assert message["reasoning_content"] == "still thinking" and message["content"] == ""
    # Off-format text streams as it comes (JSON that response_format forces from the first token, say).
    chunks = _ChunkChoices(_body(messages=[{"role": "user", "content": "hi"}]), True, plan, 1)
    tokens = encoding.encode('{"answer": "Paris", "sure": true}')
    first = chunks.of(_output(tokens[:2], encoding, False), 0)
    assert first and first[0]["delta"]["content"] == encoding.decode(tokens[:2])
    # A header that names its recipient first (the prompt already wrote <|start|>assistant).
    called = encoding.encode(' to=functions.search<|channel|>commentary json<|message|>{"q": "x"}<|call|>',
                             allowed_special="all")
    message = parsed_choice(_output(called, encoding, True), 0, plan)["message"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("search", {"q": "x"})] and message["content"] is None


def test_openai_client_against_the_server(served):
    """The official client, streamed and not, on the random model: whatever it writes, a well-formed reply whose
    prompt is harmony's rendering."""
    srv, key, _ = served

    async def run():
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=120)
        try:
            body = _history_body()
            reply = await client.chat.completions.create(
                model="demo", messages=[msgspec.to_builtins(m) for m in body.messages], tools=TOOLS,
                reasoning_effort="high", max_tokens=12, seed=random.randrange(1000))
            stream = await client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "Hello"}], max_tokens=12, stream=True,
                stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            response = await client.responses.create(model="demo", input="hi", max_output_tokens=8,
                                                     reasoning={"effort": "low"})
            events = [e async for e in await client.responses.create(
                model="demo", input="hi", max_output_tokens=8, tools=[{"type": "function", "name": "search",
                                                                       "parameters": {"type": "object"}}], stream=True)]
            return reply, chunks, response, events
        finally:
            await client.close()

    reply, chunks, response, events = srv.run(run())
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls") and choice.message.role == "assistant"
    assert reply.usage.prompt_tokens == len(_reference_prompt(harmony_vocab.harmony_encoding()))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens >= 1
    assert events[-1].type in ("response.completed", "response.incomplete")
