"""DeepSeek-V3.2 format (DSML): one block of one or more invocations, each argument a named parameter that
says whether its value is a string as written (``string="true"``) or JSON (``string="false"``)::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

(``｜`` is the full-width bar, U+FF5C, as in DeepSeek's other markers.) A ``string="false"`` value that is not
JSON makes the block text, as written.
"""

import json
import re

from gateway.tool_parsers.base import ToolCall
from gateway.tool_parsers.blocks import BlockToolParser, invocations

DSML = "｜DSML｜"
_INVOKE = re.compile(rf'\s*<{DSML}invoke name="([^"]+)">(.*?)</{DSML}invoke>', re.DOTALL)
_PARAMETER = re.compile(rf'\s*<{DSML}parameter name="([^"]+)" string="(true|false)">(.*?)</{DSML}parameter>',
                        re.DOTALL)


class DeepSeekV32ToolParser(BlockToolParser):
    name = "deepseek_v32"
    needs_special_tokens = True  # as DeepSeek's other markers: kept however the tokenizer marks them
    START, END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"

    def calls_in(self, body: str) -> list[ToolCall] | None:
        found, calls = invocations(body, _INVOKE, _PARAMETER), []
        for name, params in found or []:
            args = {}
            for param in params:
                key, is_string, raw = param.groups()
                if is_string == "true":
                    args[key] = raw
                    continue
                try:
                    args[key] = json.loads(raw)
                except ValueError:
                    return None  # a value said to be JSON that is not: the block is text
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return None if found is None else calls
