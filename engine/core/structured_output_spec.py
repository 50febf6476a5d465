"""What a request's output must look like, as the engine receives it: the contract between the API layer
(which turns ``response_format`` and ``tool_choice`` into one of these) and the grammar-constrained sampler
(which enforces it)."""

import json

import msgspec


class StructuredOutput(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Exactly one of the fields is set.

    ``json_schema`` is JSON Schema text: the output is one JSON value valid against it. ``json_object``
    asks for any JSON object (OpenAI's ``response_format: {"type": "json_object"}``). ``regex``: the whole
    output matches the regular expression (Rust ``regex`` syntax, as llguidance reads it); ``choice``: the
    output is exactly one of the strings (vLLM's ``guided_regex`` and ``guided_choice``).
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None

    def __post_init__(self) -> None:
        given = [self.json_schema is not None, self.json_object, self.regex is not None, self.choice is not None]
        if sum(given) != 1:
            raise ValueError("structured output needs exactly one of json_schema, json_object, regex or choice")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("choice must be a non-empty list of strings")
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
        if self.json_object:
            return "json_object"
        if self.regex is not None:
            return "regex:" + self.regex
        if self.choice is not None:
            return "choice:" + json.dumps(self.choice)
        return "schema:" + self.json_schema
