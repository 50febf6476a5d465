"""``response_format`` through the official `openai` client against a real server on the random-weight demo
model (which otherwise writes noise): json_schema outputs validate with the independent `jsonschema`
package for 50 sampled seeds in one burst (and the 4 choices of an n=4 request, and a streamed reply's
joined deltas), json_object outputs parse to objects, schemas the grammar library
refuses are a 400 naming ``response_format``, and greedy requests without a grammar give the same text in a
burst of constrained ones as alone."""

import asyncio
import json
import random

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.gateway.in_process import in_process_server
from tests.gateway.tenant_keys import new_tenant_key

pytestmark = pytest.mark.timeout(300)

# Bounded strings and integers: a random model would otherwise write one string (or a number's decimals)
# until max_tokens.
PERSON = {  # OpenAI strict-mode style: every property required, no others, nested object and array of objects
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                                                     "city": {"type": ["string", "null"], "maxLength": 5}},
                    "required": ["zip", "city"], "additionalProperties": False},
        "pets": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer",
                                                                                        "minimum": 0, "maximum": 30}},
            "required": ["kind", "age"], "additionalProperties": False}},
    },
    "required": ["name", "role", "address", "pets"], "additionalProperties": False,
}
CHOICE = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {
    "type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "minItems": 1, "maxItems": 3}},
    "required": ["ok", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(event loop, base url, api key, checkpoint dir) of one server on a fresh demo checkpoint, for the module."""
    with in_process_server(tmp_path_factory.mktemp("response_format"), dict(
            num_kv_blocks=512, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512)) as srv:
        yield srv.loop, srv.base_url, srv.run(new_tenant_key(srv.database_url)), srv.demo


def _run(served, scenario):
    loop, base_url, key, _ = served

    async def with_client():
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
        try:
            return await scenario(client)
        finally:
            await client.close()

    return loop.run_until_complete(with_client())


def _schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict,
                                                   "description": "what to return"}}


def test_json_schema_outputs_validate_for_50_seeds(served):
    seeds = random.sample(range(2**31), 50)

    async def scenario(client):
        async def one(i, seed):
            schema = (PERSON, CHOICE)[i % 2]
            if i % 5 == 4:  # completions take response_format too (outside the client's typed arguments)
                out = await client.completions.create(
                    model="demo", prompt=f"record {i}:", temperature=1.0, seed=seed, max_tokens=200,
                    extra_body={"response_format": _schema_format(schema, strict=bool(i % 3))})
                return schema, out.choices[0].text, out.choices[0].finish_reason
            out = await client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": f"describe person {i}"}], temperature=1.0,
                seed=seed, max_tokens=200, response_format=_schema_format(schema, strict=bool(i % 3)))
            return schema, out.choices[0].message.content, out.choices[0].finish_reason

        async def copies():  # n > 1: every copy of the prompt has its own matcher
            out = await client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "four people"}], temperature=1.0, n=4,
                seed=seeds[0], max_tokens=200, response_format=_schema_format(PERSON))
            return [(PERSON, c.message.content, c.finish_reason) for c in out.choices]

        singles, several = await asyncio.gather(asyncio.gather(*(one(i, s) for i, s in enumerate(seeds))), copies())
        assert len(several) == 4
        return singles + several

    results = _run(served, scenario)
    for schema, text, finish in results:
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), schema)
    # Sampled at temperature 1 with different seeds: the outputs differ (the grammar did not force one value).
    assert len({text for _, text, _ in results}) > 25


def test_json_object_text_and_streaming(served):
    # Free-form objects have unbounded strings, which a random model rarely closes: a moderate bias towards
    # the quote makes most strings short, while the grammar still decides what may come (outside strings it
    # allows only a few tokens, so objects and arrays end on their own).
    tokenizer = AutoTokenizer.from_pretrained(served[3])
    bias = {str(tokenizer.convert_tokens_to_ids('"')): 4.0}

    async def scenario(client):
        objects = await asyncio.gather(*(client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "json please"}], temperature=1.0, seed=seed,
            max_tokens=400, logit_bias=bias, response_format={"type": "json_object"})
            for seed in random.sample(range(2**31), 12)))
        text = await client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=5, response_format={"type": "text"})
        stream = await client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "stream it"}], temperature=1.0, max_tokens=200,
            seed=random.randrange(2**31), stream=True, response_format=_schema_format(CHOICE))
        streamed = [c async for c in stream]
        return objects, text, streamed

    objects, text, streamed = _run(served, scenario)
    # Streamed, the deltas join into one valid value.
    assert streamed[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in streamed if c.choices)), CHOICE)
    parsed = [json.loads(o.choices[0].message.content) for o in objects if o.choices[0].finish_reason == "stop"]
    # How many close their strings within max_tokens depends on the random model (3 to 8 of 8 seen): a few
    # finished objects show the grammar ends them; the rest must be cut by length, never end otherwise.
    assert len(parsed) >= 3 and all(isinstance(p, dict) for p in parsed), objects
    assert all(o.choices[0].finish_reason in ("stop", "length") for o in objects)
    assert all(o.choices[0].message.content.startswith("{") for o in objects)
    assert len({json.dumps(p) for p in parsed}) > 1  # sampled, not one forced value
    assert text.choices[0].message.content is not None


def test_bad_response_formats_are_400s_naming_the_field(served):
    cases = [
        (_schema_format({"type": "strnig"}), "response_format"),
        (_schema_format({"$ref": "#/$defs/missing"}), "response_format"),
        (_schema_format({"type": "string", "pattern": "(("}), "response_format"),
        (_schema_format({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
                         "required": ["a"]}), "response_format"),
        ({"type": "json_schema"}, "response_format.json_schema"),  # the missing field itself
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}, "response_format.json_schema.name"),
    ]

    async def scenario(client):
        found = []
        for fmt, _ in cases:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=4, response_format=fmt)
            found.append(refused.value.body)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model="demo", prompt="x", max_tokens=4, extra_body={
                "ignore_eos": True, "response_format": {"type": "json_object"}})
        found.append(refused.value.body)
        return found

    bodies = _run(served, scenario)
    for (fmt, param), body in zip(cases, bodies):
        assert body["param"] == param, (fmt, body)
    assert "cannot be enforced" in bodies[0]["message"] and "strnig" in bodies[0]["message"]
    assert bodies[-1]["param"] == "ignore_eos"


def test_unconstrained_requests_unchanged_beside_constrained_ones(served):
    prompts = [f"free text {i} {random.random()}" for i in range(4)]

    async def greedy(client, prompt):
        out = await client.completions.create(model="demo", prompt=prompt, temperature=0, max_tokens=12,
                                              extra_body={"ignore_eos": True})
        return out.choices[0].text

    async def scenario(client):
        alone = [await greedy(client, p) for p in prompts]
        constrained = [client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "x"}], temperature=1.0, seed=seed, max_tokens=200,
            response_format=_schema_format(PERSON)) for seed in random.sample(range(2**31), 12)]
        mixed = await asyncio.gather(*constrained[:6], *(greedy(client, p) for p in prompts), *constrained[6:])
        return alone, mixed

    alone, mixed = _run(served, scenario)
    assert mixed[6:10] == alone
    for out in mixed[:6] + mixed[10:]:
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
