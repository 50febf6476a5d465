"""A chat request's template inputs and how its output is read: tools rendered or not, tool calls parsed
from the text or forced by a JSON schema, reasoning split off.

Built in the gateway before the request reaches the engine; every refusal is a 400 naming its field.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from engine.core.structured_output_spec import StructuredOutput
from engine.text.prompts import RESERVED_TEMPLATE_KWARGS, ChatInput
from gateway.chat_images import ImageRef
from gateway.errors import APIError
from gateway.openai_schema import ChatCompletionRequest, ChatMessage, ImagePart, NamedToolChoice, message_text
from gateway.response_format import closed_objects
from gateway.tool_parsers import (
    REASONING_PARSERS, TOOL_PARSERS, HarmonyParser, ParsedDelta, ToolParser, detect_reasoning_parser,
    detect_tool_parser,
)
from gateway.tool_parsers import forced

ROLES = ("system", "developer", "user", "assistant", "tool")
HARMONY = HarmonyParser.name


@dataclass
class ParserChoice:
    """The server's parser settings: a name from TOOL_PARSERS / REASONING_PARSERS, "auto" (from the
    checkpoint's chat template and architecture) or None (off)."""

    tool_call_parser: str | None = "auto"
    reasoning_parser: str | None = "auto"

    def resolve(self, chat_template: str | None, architecture: str | None) -> tuple[str | None, str | None]:
        tool = detect_tool_parser(chat_template, architecture) if self.tool_call_parser == "auto" else self.tool_call_parser
        reasoning = (detect_reasoning_parser(chat_template, architecture) if self.reasoning_parser == "auto"
                     else self.reasoning_parser)
        return tool, reasoning


@dataclass
class ChatPlan:
    chat: ChatInput
    tool_parser: str | None  # parse calls out of free text (tool_choice auto)
    reasoning_parser: str | None
    structured_output: StructuredOutput | None  # tool_choice required / named
    forced_name: str | None  # the named function (tool_choice named)
    forced: bool
    parallel_tool_calls: bool
    images: list[ImageRef] = field(default_factory=list)  # the image parts, in prompt order

    @property
    def harmony(self) -> bool:
        """gpt-oss's chat: rendered and read by openai-harmony (``chat.harmony``)."""
        return self.chat is not None and self.chat.harmony

    @property
    def keeps_special_tokens(self) -> bool:
        chosen = [TOOL_PARSERS.get(self.tool_parser), REASONING_PARSERS.get(self.reasoning_parser)]
        return any(getattr(parser, "needs_special_tokens", False) for parser in chosen)

    def output_parser(self) -> "ChatOutputParser":
        return ChatOutputParser(self)


def _arguments(text: str) -> dict | str:
    """A call's arguments as the templates take them: the object its JSON text holds, or the text itself where
    it holds none (a call cut by the token limit, sent back as the reply gave it: OpenAI takes any string)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _content(m: ChatMessage, i: int, images: list[ImageRef]) -> str | list[dict] | None:
    """A message's content as the template reads it: text, or (with images) Qwen-VL's list of parts, where
    ``{"type": "image"}`` makes the template write the image's placeholder; each image part added to ``images``."""
    if m.content is None or isinstance(m.content, str) or not any(isinstance(p, ImagePart) for p in m.content):
        return None if m.content is None else message_text(m)
    parts = []
    for j, part in enumerate(m.content):
        if not isinstance(part, ImagePart):
            parts.append({"type": "text", "text": part.text})
            continue
        where = f"messages[{i}].content[{j}]"
        if m.role != "user":
            raise APIError(400, f"{where}: only user messages carry images", param=where)
        images.append(ImageRef(where, part.image_url.url))
        parts.append({"type": "image"})
    return parts


def _message(m: ChatMessage, i: int, images: list[ImageRef] | None = None) -> dict:
    where = f"messages[{i}]"
    if m.role not in ROLES:
        raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}; got {m.role!r}", param=f"{where}.role")
    turn: dict = {"role": m.role, "content": _content(m, i, images if images is not None else [])}
    if turn["content"] is None and m.refusal is not None and m.role == "assistant":
        turn["content"] = m.refusal  # what the assistant said, when it refused (OpenAI's reply shape)
    if m.name is not None:
        turn["name"] = m.name
    if m.function_call is not None:
        raise APIError(400, f"{where}.function_call is the legacy form of tool calls, which this server does not "
                            "take; send the call in tool_calls (or leave function_call null)",
                       param=f"{where}.function_call")
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None and m.role == "assistant":  # for templates that render earlier reasoning (Qwen3's)
        turn["reasoning_content"] = reasoning
    if m.tool_calls:
        if m.role != "assistant":
            raise APIError(400, f"{where}.tool_calls: only assistant messages carry tool calls", param=f"{where}.tool_calls")
        calls = [{"id": call.id, "type": "function",
                  "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                 for call in m.tool_calls]
        turn["tool_calls"] = calls
    if m.role == "tool":
        if m.tool_call_id is None:
            raise APIError(400, f"{where}.tool_call_id is required in a tool message (the id of the call it answers)",
                           param=f"{where}.tool_call_id")
        turn["tool_call_id"] = m.tool_call_id
    elif m.tool_call_id is not None:
        raise APIError(400, f"{where}.tool_call_id belongs to tool messages only", param=f"{where}.tool_call_id")
    if turn["content"] is None and not turn.get("tool_calls"):
        raise APIError(400, f"{where}.content may be null only in an assistant message with tool_calls",
                       param=f"{where}.content")
    return turn


def chat_input(body: ChatCompletionRequest, render_tools: bool = True,
               images: list[ImageRef] | None = None) -> ChatInput:
    """The template inputs of a chat request (400 naming the field for messages or options it cannot take); its
    image parts are added to ``images`` (a 400 if there is no list to take them)."""
    found: list[ImageRef] = []
    messages = [_message(m, i, found) for i, m in enumerate(body.messages)]
    if found and images is None:
        raise APIError(400, f"{found[0].where}: images are taken by /v1/chat/completions only",
                       param=found[0].where)
    if images is not None:
        images += found
    continue_final = bool(body.continue_final_message)
    add_prompt = (not continue_final) if body.add_generation_prompt is None else body.add_generation_prompt
    if continue_final and add_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: continue the last "
                            "message, or open a new assistant turn", param="continue_final_message")
    if continue_final and messages[-1]["role"] != "assistant":
        raise APIError(400, "continue_final_message needs the last message to be the assistant's (the text to continue)",
                       param="continue_final_message")
    if body.chat_template is not None:
        raise APIError(400, "chat_template: this server renders every chat with the served checkpoint's template "
                            "(a template sent with a request would run its own code on the server); leave it out, "
                            "or render the prompt yourself and send it to /v1/completions",
                       param="chat_template", code="unsupported_parameter")
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: use the request's own fields",
                       param="chat_template_kwargs")
    tools = [tool_dict(t) for t in body.tools] if body.tools and render_tools else None
    return ChatInput(messages, tools, add_prompt, continue_final, kwargs)


def tool_dict(tool) -> dict:
    """A tool as templates read it: plain JSON, without the fields the client left out (null)."""
    return _without_nulls(msgspec.to_builtins(tool))


def plan(body: ChatCompletionRequest, parsers: tuple[str | None, str | None]) -> ChatPlan:
    """How this request's chat is rendered and its output read; ``parsers`` from ``ParserChoice.resolve``."""
    tool_parser, reasoning_parser = parsers
    tools = body.tools or []
    choice = body.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise APIError(400, "tool_choice needs tools: list the functions in `tools`", param="tool_choice")
    parallel = body.parallel_tool_calls is not False
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: each function needs a name of its own", param="tools")
    for i, t in enumerate(tools):
        params = t.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema of an object",
                           param=f"tools[{i}].function.parameters")
    structured, forced_name = None, None
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not in tools",
                           param="tool_choice")
        forced_name = tool.function.name
        structured = StructuredOutput(json_schema=forced.named_schema(_forced_tool(tool)))
    elif choice == "required":
        structured = StructuredOutput(json_schema=forced.required_schema([_forced_tool(t) for t in tools], parallel))
    # A forcing schema is compiled after admission (gateway.schema_check), like response_format's.
    if structured is None and choice == "auto" and tool_parser is None:
        raise APIError(400, "this model has no tool-call parser, so tool_choice 'auto' cannot return calls; use "
                            "tool_choice 'required' or a named function, or start the server with --tool-call-parser",
                       param="tool_choice")
    images: list[ImageRef] = []
    chat = chat_input(body, render_tools=choice != "none", images=images)
    chat.harmony = HARMONY in parsers  # gpt-oss: openai-harmony renders the prompt and reads the output
    if body.reasoning_effort is not None:
        if not chat.harmony:
            raise APIError(400, "reasoning_effort is taken by models whose chat format has one (gpt-oss's harmony); "
                                "leave it out for this model", param="reasoning_effort")
        chat.reasoning_effort = body.reasoning_effort
    if images and chat.harmony:
        raise APIError(400, f"{images[0].where}: this model reads text only", param=images[0].where)
    return ChatPlan(chat, tool_parser if choice == "auto" else None, None if structured else reasoning_parser,
                    structured, forced_name, structured is not None, parallel, images)


def _forced_tool(tool) -> dict:
    """A tool as its forcing schema takes it: the parameters' objects closed, as for response_format (the
    template still shows the tool as the client wrote it). A function without parameters (or with ``{}``) takes
    the empty object only, as OpenAI's functions without parameters do: ``{}`` alone would allow any JSON value."""
    out = tool_dict(tool)
    parameters = out["function"].get("parameters") or {}
    out["function"]["parameters"] = closed_objects({"type": "object", **parameters})
    return out


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


class ChatOutputParser:
    """A chat completion's text, streamed or whole -> content, reasoning and tool calls, per the plan."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self._reasoning = None
        self._tools: ToolParser | None = None
        if plan.harmony and not plan.forced:  # openai-harmony reads reasoning and calls at once, from the token ids
            self._reasoning = HarmonyParser(plan.chat.tools or [], reads_calls=plan.tool_parser is not None)
        else:
            self._reasoning = REASONING_PARSERS[plan.reasoning_parser]() if plan.reasoning_parser else None
            if plan.tool_parser:
                self._tools = TOOL_PARSERS[plan.tool_parser](plan.chat.tools or [])
        self._forced_text = ""
        self.num_calls = 0

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        """One step's output: its text, and its token ids (which the harmony parser reads instead)."""
        if self.plan.forced:  # one JSON value: read once it is whole
            self._forced_text += text
            return ParsedDelta()
        if self._reasoning is None:
            piece = ParsedDelta(content=text)
        elif getattr(self._reasoning, "reads_tokens", False):
            piece = self._reasoning.feed_output(text, token_ids)
        else:
            piece = self._reasoning.feed(text)
        return self._limit(self._split(piece))

    def finish(self) -> ParsedDelta:
        if self.plan.forced:
            calls = forced.calls_from_output(self._forced_text, self.plan.forced_name)
            if calls is None:  # cut off (max_tokens) before the JSON was complete: the calls begun, as vLLM
                calls = forced.partial_calls(self._forced_text, self.plan.forced_name)  # returns them
            return self._limit(ParsedDelta(tool_calls=calls))
        out = self._split(self._reasoning.finish()) if self._reasoning else ParsedDelta()
        if self._tools is not None:
            out += self._tools.finish()
        return self._limit(out)

    def parse(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        """A whole output at once."""
        out = self.feed(text, token_ids)
        out += self.finish()
        return out

    def _split(self, piece: ParsedDelta) -> ParsedDelta:
        if self._tools is None or not piece.content:
            return piece
        parsed = self._tools.feed(piece.content)
        parsed.reasoning = piece.reasoning + parsed.reasoning
        return parsed

    def _limit(self, piece: ParsedDelta) -> ParsedDelta:
        if not self.plan.parallel_tool_calls:  # one call at most: later ones are dropped
            piece.tool_calls = piece.tool_calls[:max(0, 1 - self.num_calls)]
        self.num_calls += len(piece.tool_calls)
        return piece
