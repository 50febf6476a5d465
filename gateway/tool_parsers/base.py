"""What the parsers produce, and the pieces they share."""

import abc
import json
import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One complete call: ``arguments`` is JSON text (an object), as OpenAI's ``function.arguments``."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass
class ParsedDelta:
    """What a piece of model text turned out to hold: user-visible content, reasoning, completed calls."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: "ParsedDelta") -> "ParsedDelta":
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)
        return self


def call_from_json(value) -> ToolCall | None:
    """``{"name": str, "arguments": object | JSON text}`` (``parameters`` accepted for arguments) -> a call;
    None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))


def argument_types(tools: list[dict] | None) -> dict[str, dict[str, object]]:
    """{function name: {argument: its JSON Schema "type"}} from a request's tools (as templates read them)."""
    types: dict[str, dict[str, object]] = {}
    for tool in tools or []:
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[function.get("name", "")] = {k: v.get("type") for k, v in properties.items() if isinstance(v, dict)}
    return types


def typed_argument(raw: str, schema_type: object) -> object:
    """An argument written as text (the GLM-4.5 and MiniMax-M2 formats write strings as they are and other values
    as JSON): a string where the tool's schema says so, else its JSON value if it reads as one, else the text."""
    if schema_type == "string" or (isinstance(schema_type, list) and "string" in schema_type):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could begin ``marker`` (kept back while streaming)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser(abc.ABC):
    """Streaming parser of one family's tool-call format: ``feed`` model text as it arrives, ``finish`` at
    the end. The pieces returned, joined, are the same however the text was split.

    Text outside calls is content; a call whose JSON does not parse, or that names a function the request did
    not offer in ``tools``, is left in the content as written (a model's call to a function the client does not
    have is not one the client can run; OpenAI-compatible servers leave it as text too). Whitespace between or
    after calls is dropped (OpenAI sends no content around calls).
    """

    name = ""
    # Whether the format's markers are special tokens that detokenizing must keep.
    needs_special_tokens = False
    # Whether it reads token ids (``feed_output``) rather than text (gpt-oss's harmony, through openai-harmony).
    reads_tokens = False

    def __init__(self, tools: list[dict] | None = None) -> None:
        """``tools``: the request's tools as templates read them (OpenAI's ``{"type": "function", "function":
        {...}}``); calls to other names are text. None: any name is a call (reading a format on its own)."""
        self.offered = None if tools is None else {(t.get("function") or {}).get("name") for t in tools}

    def offers(self, name: str) -> bool:
        """Whether a call to ``name`` is one of the request's functions."""
        return self.offered is None or name in self.offered

    @abc.abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """The pieces ``text`` completes (text that may still start a call is held back)."""

    @abc.abstractmethod
    def finish(self) -> ParsedDelta:
        """Whatever was held back, at the end of the output."""

    def parse(self, text: str) -> ParsedDelta:
        """A whole output at once."""
        out = self.feed(text)
        out += self.finish()
        return out
