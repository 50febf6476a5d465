"""The grammar check of a request's JSON schema: after admission, off the event loop, within a time budget.

Compiling a schema can take seconds (it grows faster than the schema), so it runs after the request was admitted
(counted against the tenant's rate limits, so a flood of heavy schemas is refused at ``429`` like any other
flood), on one worker thread (the grammar library releases the GIL while it compiles: other requests' streams keep
their pace, and a flood costs at most one core), and a compile that outlasts ``COMPILE_BUDGET_S`` is a ``400``. A
schema seen before is found in the grammar cache without a thread hop.
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor

from engine.core.structured_output_spec import StructuredOutput
from engine.structured_output.grammar import cached_grammar, grammar_of
from gateway.errors import APIError
from gateway.response_format import format_source

COMPILE_BUDGET_S = 5.0
_COMPILER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="schema-compile")


def _refusal(body, forced_call: bool, why: str) -> APIError:
    if forced_call:
        return APIError(400, f"tool_choice forces a call, but a tool's parameters schema cannot be enforced ({why}); "
                             "simplify the schema or use tool_choice 'auto'", param="tools")
    param, what = format_source(body)
    return APIError(400, f"{param}: this {what} cannot be enforced ({why}); simplify it or remove the unsupported "
                         "keyword", param=param)


async def check_schema(spec: StructuredOutput | None, body, forced_call: bool = False,
                       budget_s: float = COMPILE_BUDGET_S) -> None:
    """400 naming the field of ``body`` that asked for ``spec`` (``tools`` when ``forced_call``: the schema forcing
    a tool call) if the grammar library cannot enforce it or does not compile it within ``budget_s``."""
    if spec is None or cached_grammar(spec) is not None:
        return
    work = asyncio.get_running_loop().run_in_executor(_COMPILER, grammar_of, spec)
    try:
        await asyncio.wait_for(asyncio.shield(work), budget_s)
    except ValueError as e:
        raise _refusal(body, forced_call, str(e)) from None
    except TimeoutError:
        # The compile goes on in its thread (it cannot be stopped); its result is cached for the next request.
        work.add_done_callback(lambda f: f.cancelled() or f.exception())
        raise _refusal(body, forced_call, f"it did not compile within {budget_s:g} s") from None
