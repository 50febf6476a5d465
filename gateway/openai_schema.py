"""Request bodies of the OpenAI-compatible routes, decoded and validated with msgspec."""

import re
from typing import Annotated, Any, Literal

import msgspec

from engine.core.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, SamplingParams
from gateway.choices import MAX_CHOICES
from gateway.errors import APIError
from gateway.json_types import decode_typed
from gateway.nesting import check_nesting
from gateway.prompt_cache_breakpoints import PromptCacheBreakpoint, check_breakpoint_count
from gateway.response_format import ResponseFormat, StructuredOutputs, requested_structured_output

# Bounds for integers: JSON has none, and a value past 64 bits fails wherever it is used next (the
# engine's message encoding, a seed for torch). Refused while decoding, with the field named.
INT32_MAX = 2**31 - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
Count = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)]  # 0 or -1: off
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]  # int64, as OpenAI documents it
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
# Constraints the handlers check are declared here too, so the OpenAPI document (built from these
# structs) accepts exactly what the server does.
NonEmptyText = Annotated[str, msgspec.Meta(min_length=1)]
TokenIds = Annotated[list[TokenId], msgspec.Meta(min_length=1)]
StopStrings = Annotated[list[NonEmptyText], msgspec.Meta(max_length=4)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=1e4)]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
# Token id (as a JSON object key, a string) -> value added to its logit.
LogitBias = Annotated[dict[str, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]],
                      msgspec.Meta(max_length=MAX_LOGIT_BIAS)]


class TextPart(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    """A ``{"type": "text", "text": ...}`` content part."""

    text: str
    cache_control: Any = None  # Anthropic-style prompt caching hint (sent through LiteLLM): accepted, ignored
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None  # checked and counted, see its module


class ImageURL(msgspec.Struct, forbid_unknown_fields=True):
    # a ``data:image/...;base64,...`` URL, or an http(s) URL of a host the operator allows (gateway.remote_images)
    url: NonEmptyText
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the image is read at the model's own size


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url", forbid_unknown_fields=True):
    """A ``{"type": "image_url", "image_url": {"url": "data:..."}}`` content part (user messages, a model that
    reads images); other part types (audio, files) are refused."""

    image_url: ImageURL
    cache_control: Any = None
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: NonEmptyText
    arguments: str  # JSON text of an object, as the assistant's reply carried it
    parsed_arguments: Any = None  # the openai SDK's parse helpers add it to their messages: ignored


class ToolCallMessage(msgspec.Struct, forbid_unknown_fields=True):
    """A call in an earlier assistant turn (sent back in the history)."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"
    index: int | None = None  # a streamed call's position, kept by clients that add up deltas: ignored


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    # null (or left out) only for an assistant turn that made tool calls; a string or an array of text parts
    # otherwise.
    content: str | Annotated[list[TextPart | ImagePart], msgspec.Meta(min_length=1)] | None = None
    name: str | None = None  # a participant's name: accepted, not used by the chat templates we render
    tool_calls: list[ToolCallMessage] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers
    # What an assistant message carries when a client sends a reply back as it came (the openai SDK's
    # message object, or its model_dump()). The reasoning reaches the chat template as `reasoning_content`
    # (Qwen3's renders it for the turns after the last user message); `reasoning` is newer vLLM's name
    # for it. A refusal is the turn's text when content is null. The rest are output-only and ignored;
    # `function_call` (the legacy form of tool_calls) only when null.
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    parsed: Any = None  # the openai SDK's parse helpers


FunctionName = Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema of the arguments object
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: FunctionName


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


def message_text(message: ChatMessage) -> str:
    """A message's content as one string: text parts joined by newlines (as vLLM renders them), image parts left
    out (``gateway.chat_plan`` places them); "" for the null content of an assistant turn that only made tool calls."""
    content = message.content
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(p.text for p in content if isinstance(p, TextPart))


def text_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    """The messages with string content, as the chat template takes them."""
    return [m if isinstance(m.content, str) else msgspec.structs.replace(m, content=message_text(m)) for m in messages]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk carries the usage so far (not only the last).
    continuous_usage_stats: bool = False
    # OpenAI's: each chunk padded against token-length side channels (gateway.stream_padding); off by default here.
    include_obfuscation: bool = False


# Fields of OpenAI's request bodies that this server does not implement yet, and the values that mean
# "not asked for" (null always does). Any other value is a 400 naming the field, never silently ignored.
NOT_IMPLEMENTED: dict[str, tuple] = {
    "suffix": ("",),
    "best_of": (1,),
    "functions": ([],),
    "function_call": ("none",),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "metadata": ({},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
}
# A chat's reasoning_effort is read where its model's format has one (gpt-oss's harmony: gateway.chat_plan).
CHAT_NOT_IMPLEMENTED = {field: off for field, off in NOT_IMPLEMENTED.items() if field != "reasoning_effort"}


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Sampling fields that OpenAI's chat API and vLLM's extensions add to every generating route: the chat
    and completion bodies and the Responses API's (which runs as a chat request, so they reach the sampler
    through ``sampling_params_of`` on every route). null means the default (clients send explicit nulls)."""

    top_k: TopK | None = None  # off
    stop: NonEmptyText | StopStrings | None = None
    seed: Seed | None = None
    ignore_eos: bool | None = None
    presence_penalty: Penalty | None = None  # 0
    frequency_penalty: Penalty | None = None  # 0
    repetition_penalty: RepetitionPenalty | None = None  # 1 (off); a vLLM extension
    min_p: MinP | None = None  # 0 (off); a vLLM extension
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)] | None = None  # 0; a vLLM extension
    logit_bias: LogitBias | None = None
    stop_token_ids: list[TokenId] | None = None  # a vLLM extension
    # vLLM's extensions that evaluation and benchmark harnesses send (docs/api.md says what each does here).
    skip_special_tokens: bool | None = None  # True
    spaces_between_special_tokens: bool | None = None  # True
    include_stop_str_in_output: bool | None = None  # False
    # Larger waits longer: it may only lower a request's place within its tenant's priority class.
    priority: Annotated[int, msgspec.Meta(ge=-INT32_MAX, le=INT32_MAX)] | None = None


class _Common(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    # null means the default wherever OpenAI accepts it (clients send explicit nulls).
    temperature: Temperature | None = None  # 1.0
    top_p: TopP | None = None  # 1.0
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = None  # choices per prompt
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    suffix: Any = None
    best_of: Any = None
    response_format: ResponseFormat | None = None
    functions: Any = None
    function_call: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    # vLLM's output and structured-output extensions.
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    return_tokens_as_token_ids: bool | None = None  # False
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], msgspec.Meta(min_length=1)] | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_Common, kw_only=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)] | None = None  # 0 with echo: scoring only
    # A string, token ids, or a list of either (one prompt each); checked for a mix by ``prompts_of``.
    prompt: NonEmptyText | Annotated[list[NonEmptyText | TokenId | TokenIds], msgspec.Meta(min_length=1)]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None  # top tokens per position; null: none
    echo: bool | None = None  # the prompt before the completion (and its logprobs, with logprobs)


# OpenAI's hints that the openai client sends with chat completions and the Responses API alike (its completions
# send none): the chat request declares them, and a Responses API request carries its own into the chat request
# it runs as (``gateway.responses.translate``). Accepted, and not used: this server's replicas are chosen by the
# prompt's own prefix (``gateway.prefix_index``), which a cache key only approximates; it keeps cached prefixes
# by its own tiers, checks no safety identifiers, and leaves an answer's length to the model.
PromptCacheRetention = Literal["in_memory", "24h"]
Verbosity = Literal["low", "medium", "high"]  # GPT-5's length hint
HINT_FIELDS = ("prompt_cache_key", "prompt_cache_retention", "safety_identifier")


class PromptCacheOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's ``prompt_cache_options`` as chat takes them (the Responses API's add to them): checked, and
    accepted without effect. This server's prefix cache is always on, per tenant, and keeps every full block it
    can (``mode: "explicit"`` does not switch it off, nor does ``ttl`` set how long blocks stay); caching never
    changes an answer, only how soon it starts."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


# Safety controls of OpenAI's API that the openai client sends and this server cannot honour, and why: a
# request that asks for one is refused by name (``check_safety_controls``) rather than answered as if the
# control had run. null asks for nothing and is taken.
SAFETY_CONTROLS: dict[str, str] = {
    "moderation": "moderation is not offered by this server: no moderation model runs here, so neither the "
                  "input nor the output would be checked; remove the field (or send null), and moderate in the "
                  "client or with a separate moderation service if you need it",
    "access_programs": "access programs are not offered by this server: it has no gated access tiers to select; "
                       "remove the field (or send null)",
}


def check_safety_controls(req: msgspec.Struct) -> None:
    """400 naming the first safety control (``SAFETY_CONTROLS``) the request declares and asks for."""
    for field, why in SAFETY_CONTROLS.items():
        if getattr(req, field, None) is not None:
            raise APIError(400, why, param=field, code="unsupported_parameter")


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None  # needs logprobs: true
    tools: Annotated[list[Tool], msgspec.Meta(min_length=1)] | None = None  # [] is refused, as OpenAI does
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Chat-template options (vLLM's extensions): extra template variables such as enable_thinking, whether
    # to open the assistant's turn, or to continue the last (assistant) message instead.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    # A template for this request instead of the checkpoint's (vLLM's extension): see chat_plan.
    chat_template: str | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # gpt-oss's (harmony's system message)
    # OpenAI's hints (HINT_FIELDS, verbosity, prompt_cache_options): accepted, not used.
    prompt_cache_key: str | None = None
    prompt_cache_retention: PromptCacheRetention | None = None
    safety_identifier: str | None = None
    verbosity: Verbosity | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    moderation: Any = None  # SAFETY_CONTROLS: null only


def error_param(err: msgspec.ValidationError) -> str | None:
    """The field a msgspec validation error points at (``$.messages[0].content`` -> ``messages[0].content``;
    an unknown or a missing field, by its own name under the object that holds it; a value in a map such as
    ``logit_bias``, by the map's name)."""
    text = str(err)
    named = _UNKNOWN_FIELD.match(text) or _MISSING_FIELD.match(text)
    if named:
        where = named.group(2) or "$"  # msgspec names no place for the top level
        return f"{where[2:]}.{named.group(1)}" if where.startswith("$.") else named.group(1)
    path = text.rsplit("at `$.", 1)
    if len(path) != 2:
        return None
    return path[1].rstrip("`").removesuffix("[...]") or None


_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `(\$[^`]*)`)?$")
_MISSING_FIELD = re.compile(r"Object missing required field `([^`]*)`(?: - at `(\$[^`]*)`)?$")


def check_implemented(req: msgspec.Struct, fields: dict[str, tuple] = NOT_IMPLEMENTED) -> None:
    """400 naming the first OpenAI field (of ``fields``: name -> the values that ask for nothing) that asks for
    something this server does not implement."""
    for field, defaults in fields.items():
        value = getattr(req, field)
        if value is not None and value not in defaults:
            raise APIError(400, f"`{field}` is not supported by this server yet; leave it out (or null) and "
                                "handle it in the client", param=field, code="unsupported_parameter")


def decode_json(data: bytes, cls):
    """``data`` decoded as ``cls`` (``decode_typed``: an integral number such as ``1.0`` is taken for an integer
    field, as JSON Schema and so the OpenAPI document count it one, and no other value changes its type);
    nesting too deep to decode and text that is not UTF-8 are a ``DecodeError`` like any bad JSON."""
    try:
        return decode_typed(data, cls)
    except RecursionError:
        raise msgspec.DecodeError("JSON is nested too deeply") from None
    except UnicodeDecodeError as e:
        raise msgspec.DecodeError(f"JSON text must be UTF-8 ({e.reason} at byte {e.start})") from None


def decode_body(body: bytes, cls):
    try:
        req = decode_json(body, cls)
    except msgspec.ValidationError as e:
        message = str(e)
        param = error_param(e)
        if _UNKNOWN_FIELD.match(message):
            message += " (not a field of this request: check its spelling, or remove it)"
        elif param and ".content[" in param and param.endswith(".type"):
            message += (' (content parts may only be {"type": "text", "text": ...} or '
                        '{"type": "image_url", "image_url": {"url": "data:..."}})')
        raise APIError(400, f"invalid request body: {message}", param=param) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if isinstance(req, _Common):
        check_implemented(req, CHAT_NOT_IMPLEMENTED if isinstance(req, ChatCompletionRequest) else NOT_IMPLEMENTED)
    if isinstance(req, ChatCompletionRequest):
        check_breakpoint_count((f"messages[{i}].content[{j}]", part) for i, m in enumerate(req.messages)
                               if isinstance(m.content, list) for j, part in enumerate(m.content))
    check_safety_controls(req)
    check_nesting(req)  # before any recursive code (templates, json.dumps, the grammar compiler) reads it
    return req


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: a string or a list of token ids is one; a list of strings or of token-id lists is
    one each. A list mixing the forms is a 400."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    kinds = {type(p) for p in prompt}
    if kinds == {int}:
        return [prompt]
    if kinds == {str} or kinds == {list}:
        return list(prompt)
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of token-id "
                        "lists, not a mix of these", param="prompt")


def check_choices(num_prompts: int, n: int) -> None:
    """At most MAX_CHOICES choices (prompts x n) in one request."""
    if num_prompts * n > MAX_CHOICES:
        raise APIError(400, f"{num_prompts} prompts x n={n} asks for {num_prompts * n} choices; at most "
                            f"{MAX_CHOICES} per request (send several requests)", param="n" if n > 1 else "prompt")


def _logit_bias(req: _Common, vocab_size: int | None) -> dict[int, float] | None:
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab_size or 'vocabulary size'}) "
                                f"written as strings; got {key!r}", param="logit_bias")
        bias[token] = value
    return bias or None


def _logprobs_asked(req: _Common) -> tuple[int | None, int | None]:
    """(top count for generated tokens, top count for prompt tokens), None where not asked. vLLM's
    ``prompt_logprobs`` asks for the prompt's too; with echo's, the larger count is computed."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None, req.prompt_logprobs
    if not req.echo:
        return req.logprobs, req.prompt_logprobs
    # echo: the prompt's logprobs with the completion's; a token-id prompt's text comes from them too.
    prompt_k = req.logprobs if req.logprobs is not None else (0 if not isinstance(req.prompt, str) else None)
    if req.prompt_logprobs is not None:
        prompt_k = max(prompt_k or 0, req.prompt_logprobs)
    return req.logprobs, prompt_k


def max_tokens_of(req: _Common) -> int | None:
    """The request's output limit (``max_completion_tokens`` over ``max_tokens``; 16 for completions, as
    OpenAI's API; None: to the end of the context)."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None and isinstance(req, CompletionRequest):
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    return max_tokens


def check_output_room(req: _Common, prompt_lengths: list[int], max_model_len: int) -> None:
    """400 when the output limit the request asks for does not fit the context after its longest prompt (as
    OpenAI's API and vLLM answer, never cut silently); a request that names no limit fills the context."""
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    asked = getattr(req, param)
    if asked is None or scoring_only(req) or not prompt_lengths:
        return
    prompt = max(prompt_lengths)
    if prompt + asked > max_model_len:
        raise APIError(400, f"this model's context is {max_model_len:,} tokens: the prompt's {prompt:,} tokens and "
                            f"{param} {asked:,} ({prompt + asked:,} in all) do not fit; ask for at most "
                            f"{max_model_len - prompt:,} tokens, leave {param} out to fill the context, or shorten "
                            "the prompt", param=param, code="context_length_exceeded")


def scoring_only(req: _Common) -> bool:
    """``max_tokens: 0`` with ``echo``: the prompt and its logprobs, nothing generated (lm-eval's loglikelihood,
    as vLLM serves it). The engine samples one token, which costs nothing past the prompt's forward; the
    response drops it and bills the prompt alone."""
    return isinstance(req, CompletionRequest) and max_tokens_of(req) == 0


def sampling_params_of(req: _Common, vocab_size: int | None = None) -> SamplingParams:
    """Validate OpenAI sampling fields; 400 with the offending parameter named. With ``vocab_size``, token
    ids (logit_bias, stop_token_ids) are checked against the vocabulary."""
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 <= temperature <= 2.0:
        raise APIError(400, "temperature must be between 0 and 2", param="temperature")
    if not 0.0 < top_p <= 1.0:
        raise APIError(400, "top_p must be in (0, 1]", param="top_p")
    max_tokens = max_tokens_of(req)
    if scoring_only(req):
        if not req.echo:
            raise APIError(400, "max_tokens 0 generates nothing: it is for scoring the prompt, with echo: true "
                                "(and logprobs for its logprobs); otherwise ask for at least 1 token",
                           param="max_tokens")
        max_tokens = 1
    elif max_tokens is not None and max_tokens < 1:
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise APIError(400, f"{param} must be at least 1", param=param)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise APIError(400, "stop must be up to 4 non-empty strings", param="stop")
    stop_token_ids = list(req.stop_token_ids or [])
    if vocab_size is not None and any(t >= vocab_size for t in stop_token_ids):
        raise APIError(400, f"stop_token_ids must be token ids below the vocabulary size {vocab_size}",
                       param="stop_token_ids")
    min_tokens = req.min_tokens or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true; leave it out or stream",
                       param="stream_options")
    if req.min_tokens and scoring_only(req):
        raise APIError(400, "min_tokens needs max_tokens of at least 1 (max_tokens 0 only scores the prompt)",
                       param="min_tokens")
    logprobs, prompt_logprobs = _logprobs_asked(req)
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=req.top_k or 0, seed=req.seed,
        max_tokens=max_tokens, stop=stop, ignore_eos=bool(req.ignore_eos), n=req.n or 1,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0, min_tokens=min_tokens, stop_token_ids=stop_token_ids,
        logit_bias=_logit_bias(req, vocab_size), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        structured_output=requested_structured_output(req, bool(req.ignore_eos)),
        skip_special_tokens=req.skip_special_tokens is not False,
        spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
    )
