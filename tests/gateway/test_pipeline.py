"""The gateway's one request pipeline (``gateway/pipeline.py``): its stages run in one order on every path.

A prompt that cannot be served is refused before admission (nothing reserved, nothing to settle); a schema that cannot be
enforced is refused after admission and settled with its 400 before any engine request or adapter load; an
admitted request runs under its admitted policy with the body's ``priority`` as its ``order_in_class`` and the
adapter it named. A Batch API line takes the same path: its prompt is checked before its adapter is loaded.
"""

import asyncio
import json
import random

import pytest

from benchmarks.instant_engine import InstantEngine
from engine.core.request_policy import RequestPolicy
from gateway import pipeline
from gateway.batch.runner import execute_line
from gateway.chat_plan import ParserChoice
from gateway.errors import APIError
from gateway.openai_schema import CompletionRequest, decode_body

MAX_MODEL_LEN = 64


class RecordingEngine(InstantEngine):
    """Answers at once and keeps the policy each engine request was started with."""

    def __init__(self) -> None:
        super().__init__(num_tokens=2, max_model_len=MAX_MODEL_LEN)
        self.policies: list[RequestPolicy] = []

    def generate(self, prompt, sampling_params, request_id=None, policy=None, stream=True):
        self.policies.append(policy)
        return super().generate(prompt, sampling_params, request_id, policy, stream)


class RecordingAdmission:
    """``pipeline.Admission`` that writes down each call, in order."""

    def __init__(self, events: list, policy: RequestPolicy) -> None:
        self.events, self.policy = events, policy

    def check_open(self) -> None:
        self.events.append("check_open")

    async def admit(self, planned: pipeline.Planned) -> RequestPolicy:
        self.events.append(("admit", planned.sequences))
        return self.policy

    async def settle(self, outputs, status: int) -> None:
        self.events.append(("settle", outputs is not None, status))
        if outputs is not None:
            await outputs.aclose()


class RecordingCatalog:
    """An adapter catalog where every tenant may use ``name``; loads are written down in ``events``."""

    def __init__(self, name: str, events: list) -> None:
        self.name, self.events = name, events

    async def resolve(self, tenant_id, model, base):
        return (self.name, f"/adapters/{self.name}") if model == self.name else (None, None)

    async def serve_on(self, engine, name: str, path: str) -> None:
        self.events.append(("serve_on", name))


def _body(**fields) -> CompletionRequest:
    return decode_body(json.dumps({"model": "m", "max_tokens": 2, **fields}).encode(), CompletionRequest)


def _no_room_prompt() -> list[int]:
    """Token ids that leave less than ``max_tokens: 2`` of the model's context."""
    return [random.randrange(5, 1000) for _ in range(MAX_MODEL_LEN - random.randrange(0, 2))]


def _endless_schema() -> dict:
    node = random.choice(["a", "node", "tree"]) + str(random.randrange(10**6))
    schema = {"$defs": {node: {"type": "object", "properties": {"next": {"$ref": f"#/$defs/{node}"}},
                               "required": ["next"]}}, "$ref": f"#/$defs/{node}"}
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _run(engine, body, events, policy, adapter=None):
    async def respond(planned, outputs):
        events.append("respond")
        return [out async for _, out in outputs]

    async def main():
        await engine.start()
        return await pipeline.run(engine, body, False, ParserChoice(), RecordingAdmission(events, policy),
                                  "cmpl-test", respond, adapter=adapter)

    return asyncio.run(main())


def test_a_prompt_with_no_room_is_refused_before_admission():
    engine, events = RecordingEngine(), []
    too_long = _no_room_prompt()
    with pytest.raises(APIError) as refused:
        _run(engine, _body(prompt=too_long), events, RequestPolicy())
    assert refused.value.status == 400 and refused.value.param == "max_tokens", refused.value
    assert events == ["check_open"]  # never admitted: nothing reserved, nothing to settle
    assert engine.policies == []


def test_a_schema_that_cannot_be_enforced_is_settled_after_admission_before_the_engine():
    engine, events = RecordingEngine(), []
    catalog = RecordingCatalog("ad", events)
    with pytest.raises(APIError) as refused:
        _run(engine, _body(prompt=[7, 8, 9], response_format=_endless_schema()), events, RequestPolicy(),
             adapter=pipeline.Adapter(catalog, "ad", "/adapters/ad"))
    assert refused.value.status == 400 and refused.value.param == "response_format", refused.value
    # Admitted (counted), refused, settled with its status; no adapter loaded, no engine request started.
    assert events == ["check_open", ("admit", 1), ("settle", False, 400)]
    assert engine.policies == []


def test_an_admitted_request_runs_under_its_policy_its_priority_and_its_adapter():
    engine, events = RecordingEngine(), []
    catalog = RecordingCatalog("ad", events)
    admitted = RequestPolicy(priority=random.randrange(0, 4), tenant=str(random.randrange(100)), weight=2.0)
    priority, prompts = random.randrange(1, 50), random.randrange(1, 4)
    outputs = _run(engine, _body(prompt=[[5 + i, 6, 7] for i in range(prompts)], priority=priority, n=2), events,
                   admitted, adapter=pipeline.Adapter(catalog, "ad", "/adapters/ad"))
    assert events == ["check_open", ("admit", 2 * prompts), ("serve_on", "ad"), "respond", ("settle", True, 200)]
    assert outputs and all(out.finished for out in outputs if out.finish_reason)
    assert len(engine.policies) == prompts
    for policy in engine.policies:
        assert (policy.priority, policy.tenant, policy.weight) == (admitted.priority, admitted.tenant, 2.0)
        assert policy.order_in_class == priority and policy.lora_adapter == "ad"


def test_a_batch_line_checks_its_prompt_before_loading_its_adapter():
    engine, events = RecordingEngine(), []
    catalog = RecordingCatalog("ad", events)
    too_long = _no_room_prompt()
    line = json.dumps({"model": "ad", "prompt": too_long, "max_tokens": 2})

    async def main():
        await engine.start()
        return await execute_line(engine, "m", "/v1/completions", "c1", line, RequestPolicy(), catalog, 1)

    ok, result, usage = asyncio.run(main())
    assert not ok and usage is None
    assert result["response"]["status_code"] == 400
    assert result["response"]["body"]["error"]["param"] == "max_tokens"
    assert events == [] and engine.policies == []  # refused as the live API refuses it: nothing loaded
