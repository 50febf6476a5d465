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
from gateway.tool_parsers.blocks import BlockToolParser

DSML = "｜DSML｜"
_INVOKE = re.compile(rf'\s*<{DSML}invoke name="([^"]+)">(.*?)</{DSML}invoke>', re.DOTALL)
_PARAMETER = re.compile(rf'\s*<{DSML}parameter name="([^"]+)" string="(true|false)">(.*?)</{DSML}parameter>',
                        re.DOTALL)


class DeepSeekV32ToolParser(BlockToolParser):
    name = "deepseek_v32"
    START, END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"

    def calls_in(self, body: str) -> list[ToolCall] | None:
        calls, rest = [], body
        while rest.strip():
            invoke = _INVOKE.match(rest)
            if invoke is None:
                return None
            params, args = invoke.group(2), {}
            while params.strip():
                param = _PARAMETER.match(params)
                if param is None:
                    return None
                key, is_string, raw = param.groups()
                if is_string == "true":
                    args[key] = raw
                else:
                    try:
                        args[key] = json.loads(raw)
                    except ValueError:
                        return None
                params = params[param.end():]
            calls.append(ToolCall(invoke.group(1).strip(), json.dumps(args, ensure_ascii=False)))
            rest = rest[invoke.end():]
        return calls
