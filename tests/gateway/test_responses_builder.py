"""The Responses API's output items and events for a thinking model that calls a tool (which the random demo
model never writes): a known output, cut into random steps, must give a reasoning item, a message and a
function call; every event parses as the `openai` package's event types, and the `openai` stream helper's
own accumulation of the deltas gives the final response's output."""

import json
import random

import pydantic
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from gateway.chat_plan import plan
from gateway.openai_schema import ChatCompletionRequest, ChatMessage, FunctionDefinition, Tool
from gateway.responses.builder import ResponseBuilder, skeleton, usage
from gateway.responses.request import ResponsesRequest

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def _steps(text: str) -> list[str]:
    cuts = sorted(random.sample(range(1, len(text)), random.randint(5, 25)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_reasoning_message_and_call_from_random_steps():
    thought = " ".join(random.choices(["plan", "check", "the", "city", "first"], k=random.randint(3, 8)))
    answer = random.choice(["Sure.", "Let me look that up.", "One moment:"])
    arguments = {"city": random.choice(["Oslo", "Lima"]), "days": random.randint(1, 7)}
    text = (f"<think>{thought}</think>\n\n{answer}\n<tool_call>\n"
            f'{{"name": "get_weather", "arguments": {json.dumps(arguments)}}}\n</tool_call>')
    chat = ChatCompletionRequest(messages=[ChatMessage(role="user", content="weather?")], tools=[
        Tool(type="function", function=FunctionDefinition(name="get_weather", parameters={"type": "object"}))])
    builder = ResponseBuilder(skeleton(ResponsesRequest(input="weather?"), "resp_x", 1, "demo", []),
                              plan(chat, ("hermes", "qwen3")).output_parser())
    steps = _steps(text)
    events = builder.start()
    for i, step in enumerate(steps):
        events += builder.feed(step, [0], i == len(steps) - 1)  # one token each
    events += builder.finish("stop", usage(10, 0, len(steps)))

    parsed = [EVENTS.validate_python(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in parsed:  # the helper checks that every item added was done before the response completed
        state.handle_event(event)
    snapshot = state._ResponseStreamState__current_snapshot  # the message and call, from the deltas alone
    final = Response.model_validate(builder.response)
    assert parsed[-1].type == "response.completed" and parsed[-1].response == final and final.status == "completed"
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = final.output
    assert reasoning.content[0].text == thought and message.content[0].text.strip() == answer
    assert call.name == "get_weather" and json.loads(call.arguments) == arguments
    assert snapshot.output[1].content[0].text == message.content[0].text
    assert snapshot.output[2].arguments == call.arguments
    done = [state._completed_output[i].model_dump() for i in sorted(state._completed_output)]  # output_item.done
    assert done == [item.model_dump() for item in final.output]
    assert state._completed_response.output_text == final.output_text
    # Reasoning tokens: those of the steps that wrote reasoning and no content, so never past the step that
    # closed the think block.
    closed = next(i for i in range(len(steps)) if "</think>" in "".join(steps[:i + 1]))
    assert 0 <= final.usage.output_tokens_details.reasoning_tokens <= closed + 1

    # Steps cut at the block's edges (one token each): every step inside the block counts.
    words = thought.split(" ")
    inside = [w + " " for w in words[:-1]] + [words[-1]]
    steps = ["<think>", *inside, "</think>", "\n\n", answer]
    builder = ResponseBuilder(skeleton(ResponsesRequest(input="weather?"), "resp_y", 1, "demo", []),
                              plan(chat, ("hermes", "qwen3")).output_parser())
    for i, step in enumerate(steps):
        builder.feed(step, [0], i == len(steps) - 1)  # one token each
    builder.finish("length", usage(10, 0, len(steps)))
    cut = Response.model_validate(builder.response)
    assert cut.usage.output_tokens_details.reasoning_tokens == len(inside)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in cut.output] == ["completed", "incomplete"] and cut.output_text == answer
