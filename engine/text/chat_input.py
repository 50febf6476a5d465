"""What a chat request brings to prompt preparation, and the error for a prompt that cannot be served."""

from dataclasses import dataclass, field
from typing import Any


class InvalidPrompt(ValueError):
    """A prompt that cannot be served; ``message`` is for the user, ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass
class ChatInput:
    """A chat request's template inputs: turns as the template reads them (``content`` text, None, or a user
    turn's list of ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` parts when it holds images;
    assistant ``tool_calls`` with ``arguments`` objects, ``tool_call_id``), the tools (OpenAI's
    ``{"type": "function", "function": {...}}`` entries) and the template options."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Rendered by openai-harmony (gpt-oss) instead of the chat template; its reasoning effort (low, medium, high).
    harmony: bool = False
    reasoning_effort: str | None = None

    def num_chars(self) -> int:
        """About how much text goes into the template (bounds the prompt before rendering it)."""
        size = sum(_content_chars(m.get("content")) for m in self.messages)
        return size + (len(repr(self.tools)) if self.tools else 0)


def _content_chars(content) -> int:
    if isinstance(content, list):  # parts: their text
        return sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return len(content or "")
