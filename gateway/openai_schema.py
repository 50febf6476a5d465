"""Request bodies of the OpenAI-compatible routes, decoded and validated with msgspec."""

import msgspec

from engine.protocol import SamplingSpec
from gateway.errors import APIError


class ChatMessage(msgspec.Struct):
    role: str
    content: str


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    user: str | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int]


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]


def decode_body(body: bytes, cls):
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as e:
        path = str(e).rsplit("at `$.", 1)
        param = path[1].rstrip("`") if len(path) == 2 else None
        raise APIError(400, f"invalid request body: {e}", param=param) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None


def sampling_spec(req: _Common) -> SamplingSpec:
    """Validate OpenAI sampling fields; 400 with the offending parameter named."""
    if req.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    if not 0.0 <= req.temperature <= 2.0:
        raise APIError(400, "temperature must be between 0 and 2", param="temperature")
    if not 0.0 < req.top_p <= 1.0:
        raise APIError(400, "top_p must be in (0, 1]", param="top_p")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise APIError(400, "stop must be up to 4 non-empty strings", param="stop")
    return SamplingSpec(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
        max_tokens=max_tokens, stop=stop, ignore_eos=req.ignore_eos,
    )
