"""Grammar-constrained decoding in the engine: every constrained output parses and validates against its
schema (checked by the independent `jsonschema` package), on a random-weight model that otherwise writes
noise; requests without a grammar in the same batch are untouched; preemption and chunked prefill keep
constrained requests valid."""

import json
import random

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.structured_output_spec import StructuredOutput
from engine.loading.demo_model import write_demo_model
from tests.devices import DEVICES

pytestmark = pytest.mark.timeout(300)
# 256 blocks of 16 hold every request of a test at once (at most 12 of 60 + 160 tokens): nothing preempts unless a
# test asks for it with its own small pool, as with the pool sized from memory (2 GB, ~1.5 s to build per engine).
ROOMY_POOL = 256

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                      "ok": {"type": "boolean"}},
     "required": ["name", "age", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                               "maxItems": 3}},
     "required": ["colour", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"result": {"anyOf": [
        {"type": "object", "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 999}},
         "required": ["value"], "additionalProperties": False},
        {"type": "object", "properties": {"error": {"type": "string", "maxLength": 6}},
         "required": ["error"], "additionalProperties": False}]}},
     "required": ["result"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("demo"))
    write_demo_model(path, seed=random.randrange(1000))
    return path


def _schema_params(i: int, seed: int) -> tuple[dict, SamplingParams]:
    schema = SCHEMAS[i % len(SCHEMAS)]
    return schema, SamplingParams(temperature=1.0, seed=seed, max_tokens=160,
                                  structured_output=StructuredOutput(json_schema=json.dumps(schema)))


def _check_valid(out, schema) -> None:
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("mode", [dict(num_kv_blocks=ROOMY_POOL, max_num_batched_tokens=32),  # chunked prefill
                                  dict(num_kv_blocks=14, block_size=16, max_num_batched_tokens=64)])  # preemption
@pytest.mark.parametrize("device", DEVICES)
def test_constrained_outputs_validate_and_unconstrained_requests_are_untouched(model_dir, mode, device):
    rng = random.Random()
    llm = LLM(model=model_dir, dtype="float32", device=device, **mode)
    prompts = [[rng.randrange(10, 1300) for _ in range(rng.randint(5, 60))] for _ in range(12)]
    free = [SamplingParams(temperature=0.0, max_tokens=rng.randint(20, 60), ignore_eos=True) for _ in range(4)]
    alone = [llm.generate([p], s)[0].token_ids for p, s in zip(prompts[:4], free)]

    seeds = [rng.randrange(2**31) for _ in prompts[4:]]
    constrained = [_schema_params(i, seed) for i, seed in enumerate(seeds)]
    outs = llm.generate(prompts, free + [params for _, params in constrained])

    assert [o.token_ids for o in outs[:4]] == alone  # the grammar masks touched only their own rows
    for out, (schema, _) in zip(outs[4:], constrained):
        _check_valid(out, schema)
    scheduler = llm.engine.scheduler
    if mode["num_kv_blocks"] < ROOMY_POOL:
        assert scheduler.num_preemptions > 0, "the small KV pool should have forced preemption"
    else:
        assert scheduler.num_preemptions == 0, "the roomy pool should hold every request"
    scheduler.kv.pool.check_all_free()
    llm.engine.step()  # the runner forgets requests on the step after they finish
    assert len(llm.engine.runner.sampler.grammars) == 0  # finished requests leave no matcher behind


def test_json_object_and_greedy_constrained(model_dir):
    llm = LLM(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=ROOMY_POOL)
    rng = random.Random()
    prompt = [rng.randrange(10, 1300) for _ in range(10)]
    params = [SamplingParams(temperature=t, seed=rng.randrange(2**31), max_tokens=200,
                             structured_output=StructuredOutput(json_object=True)) for t in (0.0, 1.0, 1.0)]
    for out in llm.generate([prompt] * 3, params):
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict), out.text
        else:  # a free-form object may run long: whatever it wrote is a valid prefix, never noise
            assert out.finish_reason == "length" and out.text.startswith("{"), out.text


@pytest.mark.parametrize("params, message", [
    (SamplingParams(structured_output=StructuredOutput(json_schema='{"type": "object"}'), ignore_eos=True),
     "ignore_eos"),
    (SamplingParams(structured_output=StructuredOutput(json_schema='{"type": "nonsense"}')), "nonsense"),
])
def test_a_grammar_that_cannot_be_enforced_is_refused_before_queueing(model_dir, params, message):
    llm = LLM(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=ROOMY_POOL)
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request([5, 6, 7], params)
    assert not llm.engine.has_unfinished()


def test_a_token_the_grammar_refuses_becomes_eos_with_eos_logprob(model_dir):
    """When other settings ban every token a grammar allows (here: each allowed token is a stop token not
    allowed before ``min_tokens``), the sampler's pick is refused and replaced by EOS, which ends the request;
    its reported logprob is EOS's under the raw logits (float64 reference), its top tokens the raw ones'."""
    import math

    from engine.core.request import Request
    from engine.structured_output.matchers import GrammarMatchers
    from engine.text.tokenizer import load_tokenizer
    from engine.sampling.sampler import Sampler

    seed = random.randrange(2**31)
    rng = random.Random(seed)
    tokenizer = load_tokenizer(model_dir)
    vocab = len(tokenizer)
    # Any id that cannot begin `true` or `false` stands in for EOS here (the grammar allows only those first).
    eos = rng.choice([t for t in range(vocab) if tokenizer.decode([t])[:1] not in ("t", "f")])
    sampler = Sampler(torch.device("cpu"), seed, GrammarMatchers(tokenizer, vocab, eos, torch.device("cpu")))
    spec = StructuredOutput(json_schema=json.dumps({"type": "boolean"}))
    probe = Request("probe", [1], SamplingParams(structured_output=spec), max_tokens=8, eos_token_id=eos)
    words = sampler.grammars.mask([probe]).words[0]  # [W]: what the grammar allows first
    allowed = [t for t in range(vocab) if (int(words[t // 32]) >> (t % 32)) & 1]
    assert allowed and eos not in allowed, f"seed={seed}"
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=1, stop_token_ids=allowed, logprobs=3,
                            structured_output=spec)
    request = Request("r", [1, 2, 3], params, max_tokens=8, eos_token_id=eos)
    raw = torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed))
    out = sampler(raw.clone(), [request])
    assert out.token_ids == [eos], f"seed={seed}"
    lp = out.logprobs[0]
    expected = torch.log_softmax(raw.double(), dim=-1)[0]
    assert lp.token_ids == [eos] and math.isclose(lp.logprobs[0], float(expected[eos]), abs_tol=1e-5), f"seed={seed}"
    assert lp.top_ids[0] == expected.topk(3).indices.tolist(), f"seed={seed}"


def test_outputs_that_spell_added_tokens_match_their_constraint(model_dir):
    """A grammar whose text spells a tokenizer's added tokens (`<tool_call>`, non-special in the Qwen family;
    `<|im_end|>`, special) is met: the non-special token may write its text, the special one never is its text,
    and each output matches its constraint (Python's `re` and `jsonschema`, independent of the grammar library)
    with finish reason "stop". Greedy and sampled outputs, on a random model."""
    import re

    rng = random.Random()
    llm = LLM(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=ROOMY_POOL)
    regexes = ["<tool_call>", "<\\|im_end\\|>x", "(<think>|</tool_call>)[a-c]{2}"]
    schemas = [{"type": "object", "properties": {"a": {"const": value}}, "required": ["a"],
                "additionalProperties": False} for value in ("<tool_call>", "<|im_end|>", "x<tool_response>")]
    specs = [StructuredOutput(regex=r) for r in regexes]
    specs += [StructuredOutput(json_schema=json.dumps(s)) for s in schemas]
    prompt = [rng.randrange(10, 1300) for _ in range(8)]
    params = [SamplingParams(temperature=t, seed=rng.randrange(2**31), max_tokens=40, structured_output=spec)
              for spec in specs for t in (0.0, 1.0)]
    outs = llm.generate([prompt] * len(params), params)
    for out, p in zip(outs, params):
        spec = p.structured_output
        assert out.finish_reason == "stop", (spec, out.text)
        if spec.regex is not None:
            assert re.fullmatch(spec.regex, out.text), (spec.regex, out.text)
        else:
            jsonschema.validate(json.loads(out.text), json.loads(spec.json_schema))
    special = set(llm.engine.tokenizer.all_special_ids)
    for out in outs:  # no special token stood for text (EOS ends each output, its last token)
        assert not special & set(out.token_ids[:-1]), out.token_ids


def test_a_grammar_broken_before_its_output_is_complete_ends_with_finish_reason_error(model_dir):
    """A token the grammar refuses mid-output (every allowed token banned by other settings: here min_tokens
    with each allowed token a stop token) ends the request with finish reason "error", never "stop" with text
    that breaks the format; refused once the output is complete (min_tokens past a finished value), it is a
    normal stop with a valid output."""
    from engine.core.request import Request
    from engine.structured_output.matchers import GrammarMatchers

    rng = random.Random()
    llm = LLM(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=ROOMY_POOL)
    tokenizer = llm.engine.tokenizer
    spec = StructuredOutput(json_schema=json.dumps({"type": "boolean"}))
    grammars = GrammarMatchers(tokenizer, len(tokenizer), tokenizer.eos_token_id, torch.device("cpu"))
    probe = Request("probe", [1], SamplingParams(structured_output=spec), max_tokens=8)
    words = grammars.mask([probe]).words[0]  # [W]: what the grammar allows first
    first = [t for t in range(len(tokenizer)) if (int(words[t // 32]) >> (t % 32)) & 1]
    prompt = [rng.randrange(10, 1300) for _ in range(6)]
    broken = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2, stop_token_ids=first, structured_output=spec)
    out = llm.generate([prompt], broken)[0]
    assert out.finish_reason == "error" and out.text == "", (out.finish_reason, out.text)
    # "a" is complete after one token: min_tokens then bans the EOS the grammar allows, the pick is refused and
    # becomes EOS, which ends a valid output normally.
    complete = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2,
                              structured_output=StructuredOutput(regex="a"))
    out = llm.generate([prompt], complete)[0]
    assert (out.finish_reason, out.text) == ("stop", "a")
    assert not llm.engine.has_unfinished()
