"""What a request's output must look like, as the engine receives it: the contract between the API layer
(which turns ``response_format`` and ``tool_choice`` into one of these) and the grammar-constrained sampler
(which enforces it)."""

import json

import msgspec


class StructuredOutput(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Exactly one of the fields is set.

    ``json_schema`` is JSON Schema text: the output is one JSON value valid against it. ``json_object``
    asks for any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
    """

    json_schema: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if (self.json_schema is not None) == self.json_object:
            raise ValueError("structured output needs exactly one of json_schema or json_object")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema must be a JSON object (or true/false)")

    @property
    def cache_key(self) -> str:
        """Equal for requests that compile to the same grammar."""
        return "json_object" if self.json_object else "schema:" + self.json_schema
