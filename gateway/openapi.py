"""The OpenAPI description of the API, built from the msgspec structs that validate request bodies."""

import msgspec

from gateway.openai_schema import ChatCompletionRequest, CompletionRequest

_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]},
    }, "required": ["message", "type"]}},
}
_ERRORS = {
    str(status): {"description": text, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for status, text in [(400, "bad input"), (401, "missing or invalid API key"), (403, "tenant disabled"),
                         (404, "unknown model or route"), (413, "request body too large"),
                         (429, "quota exceeded (Retry-After and x-ratelimit-* headers)"),
                         (503, "engine unavailable (Retry-After)")]
}


def _generation(summary: str, schema_ref: str) -> dict:
    return {"post": {
        "summary": summary,
        "security": [{"bearer": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": schema_ref}}}},
        "responses": {"200": {"description": "JSON, or text/event-stream chunks ending with `data: [DONE]` when stream=true"},
                      **_ERRORS},
    }}


def openapi_document(version: str) -> dict:
    (completion, chat), components = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest], ref_template="#/components/schemas/{name}"
    )
    components["Error"] = _ERROR
    return {
        "openapi": "3.1.0",
        "info": {"title": "moegate", "version": version,
                 "description": "OpenAI-compatible API of moegate, a multi-tenant server for MoE language models."},
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "mg-... API key"}}},
        "paths": {
            "/v1/completions": _generation("Text completion", completion["$ref"]),
            "/v1/chat/completions": _generation("Chat completion", chat["$ref"]),
            "/v1/models": {"get": {"summary": "Served models", "security": [{"bearer": []}],
                                   "responses": {"200": {"description": "model list"}, **_ERRORS}}},
            "/health": {"get": {"summary": "ready / starting / engine down",
                                "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text format"}}}},
        },
    }
