"""OpenAI's ``response_format`` request field, and what the engine is asked to enforce for it.

``{"type": "text"}`` asks for nothing; ``{"type": "json_object"}`` for any JSON object;
``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` for one JSON value
valid against the schema. Schemas are compiled once the request is admitted (``gateway.schema_check``), by the
same grammar library the engine enforces them with, so a schema it cannot enforce is a 400 naming
``response_format`` before anything is queued.
"""

import json
from typing import Annotated, Any

import msgspec

from engine.core.structured_output import StructuredOutput
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


def structured_output_of(response_format: ResponseFormat | None, ignore_eos: bool) -> StructuredOutput | None:
    """What the engine must enforce for ``response_format`` (None: free text)."""
    if response_format is None or isinstance(response_format, TextFormat):
        return None
    if isinstance(response_format, JSONObjectFormat):
        spec = StructuredOutput(json_object=True)
    else:
        schema = response_format.json_schema.schema
        # Keys keep their order: the grammar writes properties in the order the schema lists them.
        spec = StructuredOutput(json_schema=json.dumps({} if schema is None else schema))
    if ignore_eos:
        raise APIError(400, "ignore_eos cannot be combined with a JSON response_format: the output ends where "
                            "the JSON value is complete; drop ignore_eos", param="ignore_eos")
    return spec  # its grammar is compiled after admission (gateway.schema_check)
