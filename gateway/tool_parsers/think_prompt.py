"""Whether a chat template's generation prompt opens the ``<think>`` block itself (Qwen3's Thinking-2507
checkpoints and Qwen3.5 with thinking on, for instance): then the model's output starts inside its reasoning,
with no ``<think>`` of its own, and must be read from its first character as reasoning until ``</think>``.

The answer depends on the request's template options (``enable_thinking: false`` closes the block in the prompt
instead), so the template is rendered for a one-message probe chat with those options; answers are cached.
The gateway's process does not load transformers (the engine renders real prompts), so the template is
rendered here with jinja2 in a sandbox set up as transformers sets up its own (the same options, filters and
functions that chat templates use).
"""

import functools
import json
from datetime import datetime

_PROBE = [{"role": "user", "content": "Hi"}]
# Names templates read from the tokenizer; empty here, as they do not decide how the assistant's turn opens.
_TOKENS = {"bos_token": "", "eos_token": "", "pad_token": "", "unk_token": ""}


def prompt_opens_think(chat_template: str, template_kwargs: dict) -> bool:
    """True if ``chat_template``'s generation prompt, with ``template_kwargs``, ends inside an open ``<think>``."""
    try:
        key = json.dumps(template_kwargs, sort_keys=True)
    except (TypeError, ValueError):
        return False
    return _opens(chat_template, key)


@functools.lru_cache(maxsize=64)
def _opens(chat_template: str, kwargs_json: str) -> bool:
    try:
        rendered = _compiled(chat_template).render(messages=_PROBE, add_generation_prompt=True,
                                                   **{**_TOKENS, **json.loads(kwargs_json)})
    except Exception:  # a template that refuses the probe: keep the parser chosen from its text
        return False
    return rendered.rstrip().endswith("<think>")


@functools.lru_cache(maxsize=8)
def _compiled(chat_template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(chat_template)
