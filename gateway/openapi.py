"""The OpenAPI description of the API, built from the msgspec structs that validate request bodies."""

import msgspec

from gateway.batch.batches import CreateBatch
from gateway.batch.files import MAX_EXPIRY_S, MIN_EXPIRY_S, FileExpiry
from gateway.openai_schema import (
    CHAT_NOT_IMPLEMENTED, NOT_IMPLEMENTED, SAFETY_CONTROLS, ChatCompletionRequest, CompletionRequest,
)
from gateway.responses.request import ITEM_TYPES, UNSUPPORTED, FunctionTool, ResponsesRequest
from gateway.tokenization import DetokenizeRequest, TokenizeRequest

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
    (completion, chat, create_batch, tokenize, detokenize, responses, tool, expiry, *items), components = \
        msgspec.json.schema_components(
            [CompletionRequest, ChatCompletionRequest, CreateBatch, TokenizeRequest, DetokenizeRequest, ResponsesRequest,
             FunctionTool, FileExpiry, *ITEM_TYPES.values()], ref_template="#/components/schemas/{name}")
    components["Error"] = _ERROR
    # Checked by file_expiry after decoding (to name the part at fault and say what to give): as it checks it.
    components["CreateBatch"]["properties"]["output_expires_after"] = {"anyOf": [expiry, {"type": "null"}]}
    for name, fields in (("CompletionRequest", NOT_IMPLEMENTED), ("ChatCompletionRequest", CHAT_NOT_IMPLEMENTED)):
        properties = components[name]["properties"]
        for field, off in fields.items():  # what the server accepts for them: null or "off"
            properties[field] = {"enum": [None, *off], "description": "not supported yet: leave it out"}
    # Input items and tools are decoded one by one (a message item may leave out its type); documented as
    # the item types they are decoded as.
    properties = components["ResponsesRequest"]["properties"]
    properties["input"]["anyOf"][1]["items"] = {"anyOf": items}
    components["MessageItem"]["required"].remove("type")  # a message item may leave its type out
    properties["tools"]["anyOf"][0]["items"] = tool
    for field, nothing in UNSUPPORTED.items():
        properties[field] = {"enum": [None, *nothing], "description": "not supported: leave it out"}
    for name in ("ChatCompletionRequest", "ResponsesRequest"):
        properties = components[name]["properties"]
        for field, why in SAFETY_CONTROLS.items():  # declared to refuse them by name: null only
            if field in properties:
                properties[field] = {"type": "null", "description": why}
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
            "/v1/models/{model}": {"get": _op("A served model (404 model_not_found for any other name)", "model object",
                                              params=("model",))},
            **_responses_paths(responses["$ref"]),
            **_batch_paths(create_batch["$ref"]),
            "/tokenize": {"post": _op("Token ids of a prompt or of chat messages, as the generation routes would run "
                                      "them: {tokens, count, max_model_len}", "token ids",
                                      {"application/json": {"schema": {"$ref": tokenize["$ref"]}}})},
            "/detokenize": {"post": _op("Text of token ids: {prompt}", "text",
                                        {"application/json": {"schema": {"$ref": detokenize["$ref"]}}})},
            "/health": {"get": {"summary": "ready / starting / engine down",
                                "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text format"}}}},
        },
    }


def _op(summary: str, ok: str, body: dict | None = None, params: tuple[str, ...] = ()) -> dict:
    op = {"summary": summary, "security": [{"bearer": []}], "responses": {"200": {"description": ok}, **_ERRORS}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": body}
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params]
    return op


def _responses_paths(request_ref: str) -> dict:
    create = _op("Create a response (the Responses API, run as a chat completion); with stream=true, "
                 "text/event-stream events (`event:` and `data:` lines) ending with response.completed",
                 "response object", {"application/json": {"schema": {"$ref": request_ref}}})
    return {"/v1/responses": {"post": create},
            "/v1/responses/{response_id}": {
                "get": _op("A stored response of the tenant's", "response object", params=("response_id",)),
                "delete": _op("Delete a stored response", "deletion status", params=("response_id",))},
            "/v1/responses/{response_id}/input_items": {"get": _op(
                "A stored response's input items (?order asc|desc, default desc; ?after; ?limit 1..100)",
                "list of items", params=("response_id",))}}


def _batch_paths(create_batch_ref: str) -> dict:
    # An upload's expiry policy, as the openai client sends it (checked by gateway.batch.files.file_expiry).
    expiry = {"expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
              "expires_after[seconds]": {"type": "integer", "minimum": MIN_EXPIRY_S, "maximum": MAX_EXPIRY_S}}
    upload = {"multipart/form-data": {"schema": {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary"}, "purpose": {"type": "string", "enum": ["batch"]}, **expiry}}}}
    return {
        "/v1/files": {"post": _op("Upload a file (purpose=batch; 413 over the size limit)", "file object", upload),
                      "get": _op("List the tenant's files (?purpose, ?after, ?limit, ?order)", "list of file objects")},
        "/v1/files/{file_id}": {"get": _op("A file's metadata", "file object", params=("file_id",)),
                                "delete": _op("Delete a file", "deletion status", params=("file_id",))},
        "/v1/files/{file_id}/content": {"get": _op("A file's bytes", "the file", params=("file_id",))},
        "/v1/batches": {
            "post": _op("Create a batch: the input file is validated first; problems are listed by line and the "
                        "batch fails without running anything (429 over the batch queue limit)", "batch object",
                        {"application/json": {"schema": {"$ref": create_batch_ref}}}),
            "get": _op("List the tenant's batches, newest first (?after, ?limit)", "list of batch objects")},
        "/v1/batches/{batch_id}": {"get": _op("A batch", "batch object", params=("batch_id",))},
        "/v1/batches/{batch_id}/cancel": {"post": _op("Cancel: no new lines start; finished results are kept",
                                                      "batch object", params=("batch_id",))},
    }
