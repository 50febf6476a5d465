"""Validation of a Batch API input file: every problem found, by line, before anything runs.

The same checks serve ``POST /v1/batches`` and ``moegate run-batch``: a line
must be a JSON object ``{"custom_id", "method": "POST", "url", "body"}`` whose
body the live endpoint would accept (decoded with the same msgspec structs and
sampling checks), all lines must target one endpoint and one model, and
custom_ids must be unique.
"""

from dataclasses import dataclass, field

from collections.abc import Collection

import msgspec

from gateway.admission import estimate_prompt_tokens
from gateway.errors import APIError
from gateway.responses import batch_lines
from tenants.models import MAX_CUSTOM_ID_CHARS
from gateway.openai_schema import (
    ChatCompletionRequest, CompletionRequest, check_choices, decode_body, decode_json, message_text, prompts_of,
    sampling_params_of,
)

ENDPOINTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
             batch_lines.ENDPOINT: ChatCompletionRequest}  # a Responses API line runs as chat
MAX_ERRORS = 100  # a file with thousands of bad lines reports the first hundred


@dataclass(slots=True)
class BatchLineSpec:
    line_no: int  # 1-based, as editors count
    custom_id: str
    body_json: str  # the request body, re-encoded compactly


@dataclass(slots=True)
class ValidatedBatch:
    lines: list[BatchLineSpec] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)  # {"code", "message", "param", "line"}
    model: str | None = None
    token_estimate: int = 0  # prompt estimates + max_tokens, for the tenant's batch queue limit

    @property
    def ok(self) -> bool:
        return not self.errors


class _Line(msgspec.Struct, forbid_unknown_fields=True):
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


def validate_batch_file(data: bytes, endpoint: str, served_model: str | None, max_lines: int,
                        max_new_tokens: int, adapters: Collection[str] = ()) -> ValidatedBatch:
    """Check every line of ``data``; ``max_new_tokens`` stands in for a line without max_tokens.

    ``served_model`` None accepts any model name (still one per file), as ``moegate run-batch`` does;
    ``adapters``: the LoRA adapters the batch's tenant may name instead of the served model.
    """
    out = ValidatedBatch()

    def error(code: str, message: str, line: int | None = None, param: str | None = None) -> None:
        if len(out.errors) < MAX_ERRORS:
            out.errors.append({"code": code, "message": message, "param": param, "line": line})

    if endpoint not in ENDPOINTS:
        error("invalid_endpoint", f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint")
        return out
    body_type = ENDPOINTS[endpoint]
    seen: dict[str, int] = {}
    raw_lines = data.split(b"\n")
    numbered = [(i + 1, raw) for i, raw in enumerate(raw_lines) if raw.strip()]
    if not numbered:
        error("empty_file", "the input file has no request lines")
        return out
    if len(numbered) > max_lines:
        error("too_many_lines", f"the input file has {len(numbered)} requests; the limit is {max_lines}")
        return out
    for line_no, raw in numbered:
        try:
            line = decode_json(raw, _Line)
        except msgspec.ValidationError as e:
            error("invalid_request", f"line {line_no}: {e}", line_no)
            continue
        except msgspec.DecodeError as e:
            error("invalid_json_line", f"line {line_no} is not valid JSON: {e}", line_no)
            continue
        if not line.custom_id or len(line.custom_id) > MAX_CUSTOM_ID_CHARS:
            error("invalid_custom_id", f"line {line_no}: custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} "
                  f"characters, got {len(line.custom_id):,}", line_no, "custom_id")
        elif line.custom_id in seen:
            error("duplicate_custom_id", f"line {line_no}: custom_id {line.custom_id!r} already used on line "
                  f"{seen[line.custom_id]}", line_no, "custom_id")
        else:
            seen[line.custom_id] = line_no
        if line.method != "POST":
            error("invalid_method", f"line {line_no}: method must be POST, got {line.method!r}", line_no, "method")
        if line.url != endpoint:
            error("mismatched_endpoint", f"line {line_no}: url {line.url!r} differs from the batch's endpoint "
                  f"{endpoint!r}", line_no, "url")
            continue
        try:
            body = (batch_lines.line_request(line.body)[1] if endpoint == batch_lines.ENDPOINT
                    else decode_body(line.body, body_type))
            sampling_params_of(body)
            if body.stream:
                raise APIError(400, "stream is not supported in a batch", param="stream")
        except APIError as e:
            error("invalid_request", f"line {line_no}: {e.message}", line_no, f"body.{e.param}" if e.param else "body")
            continue
        if body.model is None:
            error("missing_model", f"line {line_no}: body.model is required", line_no, "body.model")
        elif out.model is None:
            out.model = body.model
        elif body.model != out.model:
            error("mismatched_model", f"line {line_no}: model {body.model!r} differs from {out.model!r} used above",
                  line_no, "body.model")
        if body.model is not None and served_model is not None and body.model != served_model \
                and body.model not in adapters:
            error("model_not_found", f"line {line_no}: model {body.model!r} does not exist; this server serves "
                  f"{served_model!r}", line_no, "body.model")
        chat = line.url != "/v1/completions"
        try:
            prompt = [message_text(m) for m in body.messages] if chat else prompts_of(body)
            sampling_params = sampling_params_of(body)
            if not chat:
                check_choices(len(prompt), sampling_params.n)
        except APIError as e:
            error("invalid_request", f"line {line_no}: {e.message}", line_no, f"body.{e.param}" if e.param else "body")
            continue
        outputs = (sampling_params.max_tokens or max_new_tokens) * sampling_params.n * (1 if chat else len(prompt))
        out.token_estimate += sum(estimate_prompt_tokens(p) for p in prompt) + outputs
        out.lines.append(BatchLineSpec(line_no, line.custom_id, bytes(line.body).decode()))
    return out
