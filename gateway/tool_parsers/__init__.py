"""Tool calls and reasoning in a chat completion's text: streaming parsers for each model family's format,
and the JSON schemas that force a call (``tool_choice`` required or named).

Choose parsers with ``tool_parser_named`` / ``reasoning_parser_named`` (``--tool-call-parser``,
``--reasoning-parser``) or from the checkpoint with ``detect_tool_parser`` / ``detect_reasoning_parser``.
"""

from gateway.tool_parsers.base import ParsedDelta, ToolCall, ToolParser
from gateway.tool_parsers.deepseek import CALLS_BEGIN as DEEPSEEK_CALLS_BEGIN, DeepSeekR1ReasoningParser, DeepSeekToolParser
from gateway.tool_parsers.hermes import HermesToolParser
from gateway.tool_parsers.mistral import MistralToolParser
from gateway.tool_parsers.reasoning import ThinkReasoningParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "mistral": MistralToolParser,
                                             "deepseek_v3": DeepSeekToolParser}
REASONING_PARSERS = {"qwen3": ThinkReasoningParser, "think": ThinkReasoningParser,
                     "deepseek_r1": DeepSeekR1ReasoningParser}


def detect_tool_parser(chat_template: str | None, architecture: str | None) -> str | None:
    """The tool-call format a checkpoint's chat template (or, failing that, its architecture) writes; None if unknown."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if DEEPSEEK_CALLS_BEGIN in template:
        return "deepseek_v3"
    arch = (architecture or "").lower()
    if arch.startswith("deepseek"):
        return "deepseek_v3"
    if arch.startswith(("mistral", "mixtral")):
        return "mistral"
    if arch.startswith("qwen"):
        return "hermes"
    return None


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """``qwen3`` for templates that know ``<think>`` blocks (the Qwen3 family), else None."""
    return "qwen3" if "<think>" in (chat_template or "") else None


__all__ = ["ParsedDelta", "ToolCall", "ToolParser", "HermesToolParser", "MistralToolParser", "DeepSeekToolParser",
           "ThinkReasoningParser", "DeepSeekR1ReasoningParser", "TOOL_PARSERS", "REASONING_PARSERS", "detect_tool_parser",
           "detect_reasoning_parser"]
