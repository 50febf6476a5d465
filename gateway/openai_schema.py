"""Request bodies of the OpenAI-compatible routes, decoded and validated with msgspec."""

from typing import Annotated

import msgspec

from engine.core.sampling_params import SamplingParams
from gateway.errors import APIError

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


class ChatMessage(msgspec.Struct):
    role: str
    content: str


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1  # one choice per request
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyText | StopStrings | None = None
    seed: Seed | None = None
    ignore_eos: bool = False
    user: str | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: NonEmptyText | TokenIds


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]


def error_param(err: msgspec.ValidationError) -> str | None:
    """The field a msgspec validation error points at (``$.messages[0].content`` -> ``messages[0].content``)."""
    path = str(err).rsplit("at `$.", 1)
    return path[1].rstrip("`") or None if len(path) == 2 else None


def decode_json(data: bytes, cls):
    """msgspec's decode; nesting too deep to decode and text that is not UTF-8 are a ``DecodeError``
    like any bad JSON.

    Not strict: JSON Schema (and so the OpenAPI document) counts ``1.0`` as an integer, and clients
    written against it send that, so integral numbers are taken for integer fields (``1.5`` is not).
    """
    try:
        return msgspec.json.decode(data, type=cls, strict=False)
    except RecursionError:
        raise msgspec.DecodeError("JSON is nested too deeply") from None
    except UnicodeDecodeError as e:
        raise msgspec.DecodeError(f"JSON text must be UTF-8 ({e.reason} at byte {e.start})") from None


def decode_body(body: bytes, cls):
    try:
        return decode_json(body, cls)
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid request body: {e}", param=error_param(e)) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None


def sampling_params(req: _Common) -> SamplingParams:
    """Validate OpenAI sampling fields; 400 with the offending parameter named."""
    if req.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    if not 0.0 <= req.temperature <= 2.0:
        raise APIError(400, "temperature must be between 0 and 2", param="temperature")
    if not 0.0 < req.top_p <= 1.0:
        raise APIError(400, "top_p must be in (0, 1]", param="top_p")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None and isinstance(req, CompletionRequest):
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS  # OpenAI's default for /v1/completions (chat: to the end)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise APIError(400, "stop must be up to 4 non-empty strings", param="stop")
    return SamplingParams(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
        max_tokens=max_tokens, stop=stop, ignore_eos=req.ignore_eos,
    )
