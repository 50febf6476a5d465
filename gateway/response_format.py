"""OpenAI's ``response_format`` request field and vLLM's ``guided_*`` / ``structured_outputs``, and what the
engine is asked to enforce for them.

``{"type": "text"}`` asks for nothing; ``{"type": "json_object"}`` for any JSON object;
``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` for one JSON value
valid against the schema. vLLM's ``guided_json`` (a schema), ``guided_regex``, ``guided_choice`` and its
``structured_outputs`` object (``json``, ``regex``, ``choice``, ``json_object``) ask for the same things.
Objects in a schema are closed (``additionalProperties: false``) unless the schema says otherwise, as
OpenAI's strict mode and vLLM do. What is asked for is compiled once the request is admitted
(``gateway.schema_check``), by the same grammar library the engine enforces it with, so a format it cannot
enforce is a 400 naming its field before anything is queued.
"""

import json
from typing import Annotated, Any

import msgspec

from engine.core.structured_output_spec import StructuredOutput
from gateway.errors import APIError

# OpenAI: a-z, A-Z, 0-9, underscores and dashes, at most 64 characters.
SchemaName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class JSONSchemaSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: SchemaName
    # Absent: any JSON value (OpenAI makes it optional). Strict or not, the schema is always enforced.
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class TextFormat(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    pass


class JSONObjectFormat(msgspec.Struct, tag="json_object", tag_field="type", forbid_unknown_fields=True):
    pass


class JSONSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type", forbid_unknown_fields=True):
    json_schema: JSONSchemaSpec


ResponseFormat = TextFormat | JSONObjectFormat | JSONSchemaFormat


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` request field: one of ``json`` (a schema, as an object or JSON text),
    ``regex``, ``choice``, ``json_object``. Its options that concern other backends are accepted: this
    server's JSON is always compact (``disable_any_whitespace``) and has one backend (``disable_fallback``)."""

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], msgspec.Meta(min_length=1)] | None = None
    json_object: bool | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None


# Keywords whose value is one schema, a list of schemas, or a map of names to schemas.
_ONE_SCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not", "if", "then",
               "else", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say otherwise, as
    OpenAI's strict mode requires and vLLM enforces: pydantic, instructor, LangChain and llama-index send
    schemas without it, and JSON Schema's open default lets a model add keys of its own until max_tokens.
    An object stays open where its schema says ``additionalProperties`` (true, or a schema for the extra
    values) or ``unevaluatedProperties``. Values (``const``, ``enum``, ``default``, ``examples``) are not
    schemas and are left alone."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE_SCHEMA:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or (
        kind is None and isinstance(out.get("properties"), dict))
    if is_object and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def schema_text(schema) -> str:
    """A schema as the engine takes it: objects closed (``closed_objects``), keys in the client's order (the
    grammar writes properties in the order the schema lists them)."""
    return json.dumps(closed_objects({} if schema is None else schema))


def _format_spec(response_format: ResponseFormat) -> StructuredOutput | None:
    if isinstance(response_format, TextFormat):
        return None
    if isinstance(response_format, JSONObjectFormat):
        return StructuredOutput(json_object=True)
    return StructuredOutput(json_schema=schema_text(response_format.json_schema.schema))


def _json_value(schema, param: str):
    """A schema given as an object or as JSON text (vLLM takes both)."""
    if not isinstance(schema, str):
        return schema
    try:
        return json.loads(schema)
    except ValueError:
        raise APIError(400, f"{param} must be a JSON schema (an object, or its JSON text)", param=param) from None


def _structured_outputs_spec(so: StructuredOutputs) -> StructuredOutput:
    for name in ("grammar", "structural_tag", "whitespace_pattern"):
        if getattr(so, name) is not None:
            raise APIError(400, f"structured_outputs.{name} is not supported by this server; use json, regex, "
                                "choice or json_object", param=f"structured_outputs.{name}",
                           code="unsupported_parameter")
    given = [name for name in ("json", "regex", "choice") if getattr(so, name) is not None]
    given += ["json_object"] if so.json_object else []
    if len(given) != 1:
        raise APIError(400, "structured_outputs needs exactly one of json, regex, choice or json_object",
                       param="structured_outputs")
    if so.json is not None:
        return StructuredOutput(json_schema=schema_text(_json_value(so.json, "structured_outputs.json")))
    if so.regex is not None:
        return StructuredOutput(regex=so.regex)
    if so.choice is not None:
        return StructuredOutput(choice=so.choice)
    return StructuredOutput(json_object=True)


def requested_structured_output(req, ignore_eos: bool) -> StructuredOutput | None:
    """What the engine must enforce for a completions or chat request: its ``response_format``, or vLLM's
    ``guided_json`` / ``guided_regex`` / ``guided_choice`` or ``structured_outputs`` (at most one of them;
    None: free text)."""
    asked = []  # (field, spec, what)
    if req.response_format is not None and (spec := _format_spec(req.response_format)) is not None:
        asked.append(("response_format", spec, "JSON schema"))
    if req.guided_json is not None:
        schema = _json_value(req.guided_json, "guided_json")
        asked.append(("guided_json", StructuredOutput(json_schema=schema_text(schema)), "JSON schema"))
    if req.guided_regex is not None:
        asked.append(("guided_regex", StructuredOutput(regex=req.guided_regex), "regular expression"))
    if req.guided_choice is not None:
        asked.append(("guided_choice", StructuredOutput(choice=req.guided_choice), "choice"))
    if req.structured_outputs is not None:
        asked.append(("structured_outputs", _structured_outputs_spec(req.structured_outputs), "structured output"))
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(a[0] for a in asked)} each fix the output's format: send one of them",
                       param=asked[1][0])
    return _enforced(asked, ignore_eos)


def _enforced(asked: list[tuple[str, StructuredOutput, str]], ignore_eos: bool) -> StructuredOutput | None:
    """The one format asked for (none: None); its grammar is compiled after admission (``gateway.schema_check``)."""
    if not asked:
        return None
    param = asked[0][0]
    if ignore_eos:
        raise APIError(400, f"ignore_eos cannot be combined with {param}: the output ends where the format is "
                            "complete; drop ignore_eos", param="ignore_eos")
    return asked[0][1]


# The fields that may fix the output's format (at most one per request), and what each names in a refusal.
_FORMAT_FIELDS = (("response_format", "JSON schema"), ("guided_json", "JSON schema"), ("guided_regex", "regular expression"),
                  ("guided_choice", "choice"), ("structured_outputs", "structured output"))


def format_source(req) -> tuple[str, str]:
    """(field, what it holds) of the field that fixed a request's format, for a refusal of its grammar."""
    for field, what in _FORMAT_FIELDS:
        value = getattr(req, field, None)
        if value is not None and not isinstance(value, TextFormat):
            return field, what
    return _FORMAT_FIELDS[0]
