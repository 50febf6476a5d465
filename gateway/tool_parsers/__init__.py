"""Tool calls and reasoning in a chat completion's text: streaming parsers for each model family's format
(gpt-oss's harmony read from its token ids, by openai-harmony), and the JSON schemas that force a call
(``tool_choice`` required or named).

Choose parsers with ``tool_parser_named`` / ``reasoning_parser_named`` (``--tool-call-parser``,
``--reasoning-parser``) or from the checkpoint with ``detect_tool_parser`` / ``detect_reasoning_parser``.
"""

from gateway.tool_parsers.base import ParsedDelta, ToolCall, ToolParser
from gateway.tool_parsers.glm45 import Glm45ToolParser
from gateway.tool_parsers.harmony import HarmonyParser
from gateway.tool_parsers.deepseek import CALLS_BEGIN as DEEPSEEK_CALLS_BEGIN, DeepSeekR1ReasoningParser, DeepSeekToolParser
from gateway.tool_parsers.deepseek_v32 import DSML, DeepSeekV32ToolParser
from gateway.tool_parsers.hermes import HermesToolParser
from gateway.tool_parsers.kimi_k2 import SECTION_BEGIN as KIMI_SECTION_BEGIN, KimiK2ToolParser
from gateway.tool_parsers.minimax_m2 import MiniMaxM2ToolParser
from gateway.tool_parsers.mistral import MistralToolParser
from gateway.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from gateway.tool_parsers.reasoning import OpenThinkReasoningParser, ThinkReasoningParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "mistral": MistralToolParser, "glm45": Glm45ToolParser,
    "minimax_m2": MiniMaxM2ToolParser, "harmony": HarmonyParser, "deepseek_v3": DeepSeekToolParser,
    "qwen3_coder": Qwen3CoderToolParser, "deepseek_v32": DeepSeekV32ToolParser, "kimi_k2": KimiK2ToolParser,
}
# gpt-oss's harmony parser (openai-harmony's, from token ids) reads reasoning and calls at once: it is both kinds.
REASONING_PARSERS = {"qwen3": ThinkReasoningParser, "think": ThinkReasoningParser, "glm45": ThinkReasoningParser,
                     "minimax_m2": OpenThinkReasoningParser, "harmony": HarmonyParser,
                     "deepseek_r1": DeepSeekR1ReasoningParser}
# The opening of an assistant turn in MiniMax-M2's template, which then opens the <think> block itself.
MINIMAX_TURN = "]~b]ai"


def detect_tool_parser(chat_template: str | None, architecture: str | None) -> str | None:
    """The tool-call format a checkpoint's chat template (or, failing that, its architecture) writes; None if unknown."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return "harmony"
    if KIMI_SECTION_BEGIN in template:  # before DeepSeek's: Kimi-K2 has DeepSeek-V3's architecture
        return "kimi_k2"
    if DSML in template:
        return "deepseek_v32"
    if "<function=" in template:  # before Hermes: Qwen3-Coder's and Qwen3.5's calls open with <tool_call> too
        return "qwen3_coder"
    if "<arg_key>" in template:  # before Hermes: GLM's calls open with <tool_call> too
        return "glm45"
    if "<minimax:tool_call>" in template:
        return "minimax_m2"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if DEEPSEEK_CALLS_BEGIN in template:
        return "deepseek_v3"
    arch = (architecture or "").lower()
    if arch.startswith("gptoss"):
        return "harmony"
    if arch.startswith("deepseekv32"):  # ships no Jinja template: its DSML format is known by architecture
        return "deepseek_v32"
    if arch.startswith("deepseek"):
        return "deepseek_v3"
    if arch.startswith(("mistral", "mixtral")):
        return "mistral"
    if arch.startswith("qwen3_5"):
        return "qwen3_coder"
    if arch.startswith("qwen"):
        return "hermes"
    if arch.startswith(("glm4moe", "glmmoedsa")):  # GLM-5 writes GLM-4.7's calls, which the GLM-4.5 parser reads
        return "glm45"
    if arch.startswith("kimilinear"):
        return "kimi_k2"
    if arch.startswith("minimaxm2"):
        return "minimax_m2"
    return None


def detect_reasoning_parser(chat_template: str | None, architecture: str | None = None) -> str | None:
    """``harmony`` for templates that write harmony channels and for gpt-oss's architecture, ``minimax_m2`` for
    MiniMax-M2's template (its prompt opens the ``<think>`` block), ``qwen3`` for other templates that know
    ``<think>`` blocks (Qwen3, GLM-4.5), else None."""
    template = chat_template or ""
    if "<|channel|>" in template or (architecture or "").lower().startswith("gptoss"):
        return "harmony"
    if "<think>" not in template:
        return None
    return "minimax_m2" if MINIMAX_TURN in template else "qwen3"


__all__ = ["ParsedDelta", "ToolCall", "ToolParser", "HarmonyParser", "HermesToolParser", "MistralToolParser",
           "Glm45ToolParser", "MiniMaxM2ToolParser", "DeepSeekToolParser", "Qwen3CoderToolParser",
           "DeepSeekV32ToolParser", "KimiK2ToolParser", "ThinkReasoningParser",
           "OpenThinkReasoningParser", "DeepSeekR1ReasoningParser", "TOOL_PARSERS", "REASONING_PARSERS",
           "detect_tool_parser",
           "detect_reasoning_parser"]
