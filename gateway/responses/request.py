"""The body of ``POST /v1/responses``, decoded and checked with msgspec; every refusal is a 400 naming its field.

Input items are decoded one by one (``input_items``): OpenAI's short message form ``{"role", "content"}`` has
no ``type``, so the item's type is read first and the item then decoded as that type, its errors named under
``input[i]``. Fields of OpenAI's API that this server does not implement are refused unless they ask for
nothing (``UNSUPPORTED``); hints the server has no use for (``prompt_cache_key``, ``prompt_cache_retention``,
``safety_identifier``, ``text.verbosity``: typed as on the chat request they are carried into, ``reasoning``,
``service_tier`` auto/default, ``prompt_cache_options`` but ``prewarm: true``) are accepted; safety controls
this server cannot honour (``moderation``, ``access_programs``) are refused by name (``SAFETY_CONTROLS``);
``background``, ``background_options`` and ``image`` are checked against what this server runs
(``gateway.responses.run_options``). A message's content is a string or at least one content part; the parts the
request sends carry at most four ``prompt_cache_breakpoint``s (``gateway.prompt_cache_breakpoints``).
"""

from typing import Annotated, Any, Literal

import msgspec

from gateway.errors import APIError
from gateway.prompt_cache_breakpoints import PromptCacheBreakpoint, check_breakpoint_count
from gateway.responses.run_options import BackgroundOptions, ImageOptions, check_run_options
from gateway.openai_schema import (
    INT32_MAX, FunctionDefinition, FunctionName, NonEmptyText, PromptCacheOptions, PromptCacheRetention, SamplingFields,
    Temperature, TopP, Verbosity, check_implemented, decode_body, error_param,
)
from gateway.response_format import JSONObjectFormat, SchemaName, TextFormat


MAX_ENCRYPTED_CONTENT = 2**20  # characters of a reasoning item's encrypted_content (OpenAI's are a few KB)


# Parts a request sends omit their defaults when stored: an item without a breakpoint is stored as before there
# were breakpoints, and one with a breakpoint keeps it (listed, and continued through previous_response_id).
class InputText(msgspec.Struct, tag="input_text", tag_field="type", omit_defaults=True, forbid_unknown_fields=True):
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None  # checked and counted (gateway.prompt_cache_breakpoints)


class OutputText(msgspec.Struct, tag="output_text", tag_field="type", forbid_unknown_fields=True):
    """Text of an earlier assistant message (sent back in the history, as the response gave it)."""

    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(msgspec.Struct, tag="refusal", tag_field="type", forbid_unknown_fields=True):
    refusal: str


class InputImage(msgspec.Struct, tag="input_image", tag_field="type", kw_only=True, omit_defaults=True,
                 forbid_unknown_fields=True):
    """An image in a user message, for a model that reads images: ``image_url`` a ``data:`` URL, or an http(s)
    URL of a host the operator allows (``gateway.remote_images``); run as the chat API's ``image_url`` part."""

    image_url: NonEmptyText | None = None
    file_id: str | None = None  # an uploaded file: not taken (send the image's bytes as a data: URL)
    detail: Literal["auto", "low", "high", "original"] | None = None  # accepted; read at the model's own size
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


ContentPart = InputText | OutputText | Refusal | InputImage
Content = str | list[ContentPart]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


# Input items are tagged by their ``type`` (which a message may leave out when decoded on its own), so that a
# list of typed items, a stored conversation's, decodes in one call.
class MessageItem(msgspec.Struct, tag="message", tag_field="type", kw_only=True, forbid_unknown_fields=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    id: str | None = None
    status: ItemStatus | None = None
    phase: str | None = None  # an assistant message's phase (commentary, final_answer): kept by clients, not used


class DirectCaller(msgspec.Struct, tag="direct", tag_field="type", forbid_unknown_fields=True):
    """A call the model made itself."""


class ProgramCaller(msgspec.Struct, tag="program", tag_field="type", forbid_unknown_fields=True):
    """A call made by a program item (OpenAI's code tools) whose call id is ``caller_id``."""

    caller_id: str


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type", kw_only=True,
                       forbid_unknown_fields=True):
    """A call the model made earlier (sent back before its output)."""

    call_id: NonEmptyText
    name: FunctionName
    arguments: str  # as the model wrote it: JSON text of an object, or less where the output was cut
    id: str | None = None
    status: ItemStatus | None = None
    # Fields of OpenAI's item that the openai SDK's own objects carry (null unless OpenAI's tools set them):
    # accepted so that clients can send a response's items back as they got them; not used here.
    namespace: str | None = None
    caller: DirectCaller | ProgramCaller | None = None
    async_: bool | None = msgspec.field(default=None, name="async")
    async_field: bool | None = msgspec.field(default=None, name="async_")  # the same, as model_dump() names it


class FunctionCallOutputItem(msgspec.Struct, tag="function_call_output", tag_field="type", kw_only=True,
                             forbid_unknown_fields=True):
    """The result of a call, answering ``call_id``."""

    call_id: NonEmptyText
    output: Content
    id: str | None = None
    status: ItemStatus | None = None


class SummaryText(msgspec.Struct, tag="summary_text", tag_field="type", forbid_unknown_fields=True):
    text: str


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type", forbid_unknown_fields=True):
    text: str


class ReasoningItem(msgspec.Struct, tag="reasoning", tag_field="type", kw_only=True, forbid_unknown_fields=True):
    """Earlier reasoning, sent back by agents as the response gave it; not rendered into the prompt (the chat
    templates drop the reasoning of earlier turns), stored with its text (counted against the tenant's
    stored-response bytes)."""

    id: str | None = None
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    # Another server's encrypted reasoning (this one makes none): taken back, neither stored nor rendered.
    encrypted_content: Annotated[str, msgspec.Meta(max_length=MAX_ENCRYPTED_CONTENT)] | None = None
    status: ItemStatus | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES: dict[str, type] = {"message": MessageItem, "function_call": FunctionCallItem,
                               "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


class FunctionTool(FunctionDefinition, kw_only=True):
    """The Responses API's flat function tool: the chat API's function definition with the tool's type."""

    type: Literal["function"]


class FunctionChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: FunctionName


class JSONSchemaTextFormat(msgspec.Struct, tag="json_schema", tag_field="type", kw_only=True,
                           forbid_unknown_fields=True):
    """``text.format`` for one JSON value valid against ``schema`` (the chat API's json_schema, flattened)."""

    name: SchemaName
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


TextFormatConfig = TextFormat | JSONObjectFormat | JSONSchemaTextFormat


class TextConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: TextFormatConfig | None = None
    verbosity: Verbosity | None = None  # accepted, echoed, carried into the chat request; not used


class ResponsesPromptCacheOptions(PromptCacheOptions, kw_only=True, forbid_unknown_fields=True):
    """Chat's ``prompt_cache_options`` and what the Responses API adds: a longer ``ttl``, and
    ``comparison_response_id`` (cache diagnostics: none are made, so it is accepted and not used). ``prewarm:
    true`` (fill the cache and answer nothing) is refused by ``decode_request``: the cache fills as requests run."""

    ttl: Literal["30m", "12h"] | None = None
    comparison_response_id: str | None = None
    prewarm: bool | None = None


class ReasoningConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Accepted and echoed: whether the served model thinks is its chat template's business."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    # Each event padded against length side channels (gateway.stream_padding); null asks for none, as false does
    # (it was taken before padding was offered).
    include_obfuscation: bool | None = None


# The bound on max_output_tokens, shared with the route's first look at the body (``prepare.Head``).
MaxOutputTokens = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]
Metadata = Annotated[dict[str, Annotated[str, msgspec.Meta(max_length=512)]], msgspec.Meta(max_length=16)]

# Fields this server does not implement, and the values that ask for nothing (null always does).
UNSUPPORTED: dict[str, tuple] = {
    "truncation": ("disabled",),
    "service_tier": ("auto", "default"),
    "top_logprobs": (0,),
    "max_tool_calls": (),
    "prompt": (),
    "conversation": (),
    "context_management": (),
}


class ResponsesRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's fields, and the sampling fields chat takes (``SamplingFields``: ``stop``, ``seed``, vLLM's
    ``top_k``, ``ignore_eos``, ``min_tokens``, ... which benchmark clients such as GuideLLM send here too)."""

    model: str | None = None
    input: NonEmptyText | Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: MaxOutputTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None  # default true: kept for previous_response_id and GET /v1/responses/{id}
    previous_response_id: NonEmptyText | None = None
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: PromptCacheRetention | None = None
    prompt_cache_options: ResponsesPromptCacheOptions | None = None
    moderation: Any = None  # SAFETY_CONTROLS: null only
    access_programs: Any = None
    # Extra output asked for: encrypted reasoning (which Codex and other agents ask for with store: false) is
    # accepted and never produced, this server's reasoning items carry their text.
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    background: bool | None = None  # true is refused, with background_options and image (run_options)
    background_options: BackgroundOptions | None = None
    image: ImageOptions | None = None
    truncation: Any = None
    service_tier: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    conversation: Any = None
    context_management: Any = None


def decode_request(data: bytes) -> tuple[ResponsesRequest, list[InputItem], list[FunctionTool]]:
    """The request, its input items and its tools, checked; a 400 naming the field otherwise."""
    req = decode_body(data, ResponsesRequest)
    check_run_options(req.background, req.background_options, req.stream, req.image)
    check_implemented(req, UNSUPPORTED)
    if req.prompt_cache_options is not None and req.prompt_cache_options.prewarm:
        raise APIError(400, "prompt_cache_options.prewarm is not offered by this server: the prefix cache fills as "
                            "requests run, so send the request itself (or leave prewarm out or false)",
                       param="prompt_cache_options.prewarm", code="unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true; leave it out or stream",
                       param="stream_options")
    items = input_items(req.input)
    check_breakpoint_count(_content_parts(items))
    return req, items, [_tool(t, i) for i, t in enumerate(req.tools or [])]


def _content_parts(items: list[InputItem]):
    """(place, part) of every content part of ``items`` (a message's content, a function call's output)."""
    for i, item in enumerate(items):
        for field in ("content", "output"):
            parts = getattr(item, field, None)
            if isinstance(parts, list) and not isinstance(item, ReasoningItem):
                yield from ((f"input[{i}].{field}[{j}]", part) for j, part in enumerate(parts))


def input_items(given: str | list[dict]) -> list[InputItem]:
    """``input`` as items: a string is one user message. A list is converted in one call (a message without its
    type typed first), or, where that fails, item by item, to name the place of what is wrong."""
    if isinstance(given, str):
        return [MessageItem(role="user", content=given)]
    try:
        items = msgspec.convert([raw if "type" in raw else {**raw, "type": "message"} for raw in given],
                                list[InputItem])
    except msgspec.ValidationError:
        items = [_item(raw, i) for i, raw in enumerate(given)]
    for i, item in enumerate(items):
        # Checked here rather than in the item's type: stored conversations that hold one still decode.
        if isinstance(item, MessageItem) and isinstance(item.content, list) and not item.content:
            raise APIError(400, f"input[{i}].content is an empty array: give at least one content part (input_text, "
                                "input_image, ...), or the text as a string", param=f"input[{i}].content")
    return items


class _Output(msgspec.Struct):
    output: list[InputItem]


def stored_input_items(input_json: str | bytes) -> list[InputItem]:
    """A stored response's input items (stored with their types), decoded in one call."""
    return msgspec.json.decode(input_json, type=list[InputItem])


def stored_output_items(response_json: str | bytes) -> list[InputItem]:
    """A stored response object's output items, decoded in one call (its other fields skipped)."""
    return msgspec.json.decode(response_json, type=_Output).output


def _item(raw: dict, i: int) -> InputItem:
    kind = raw.get("type", "message")
    cls = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise APIError(400, f"input[{i}].type {kind!r} is not supported by this server; input items may be "
                            f"{', '.join(ITEM_TYPES)}", param=f"input[{i}].type", code="unsupported_parameter")
    return _convert(raw, cls, f"input[{i}]")


def _tool(raw: dict, i: int) -> FunctionTool:
    if raw.get("type") != "function":
        raise APIError(400, f"tools[{i}].type {raw.get('type')!r} is not supported by this server; only function "
                            "tools are (run other tools in the client)", param=f"tools[{i}].type",
                       code="unsupported_parameter")
    return _convert(raw, FunctionTool, f"tools[{i}]")


def _convert(raw: dict, cls, where: str):
    """``raw`` as ``cls``; a validation error is a 400 naming its place under ``where``."""
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as e:
        text = str(e).replace("`$", f"`$.{where}", 1) if "`$" in str(e) else f"{e} - at `$.{where}`"
        param = error_param(msgspec.ValidationError(text))
        hint = ""
        if ".content[" in (param or "") and (param or "").endswith(".type"):
            hint = (" (content parts may be input_text, input_image, output_text or refusal: send other media another "
                    "way)")
        elif "unknown field" in text:
            hint = " (not a field of this item: check its spelling, or remove it)"
        raise APIError(400, f"invalid request body: {text}{hint}", param=param) from None
