"""Whether a chat template's generation prompt opens the ``<think>`` block itself (Qwen3's Thinking-2507
checkpoints and Qwen3.5 with thinking on, for instance): then the model's output starts inside its reasoning,
with no ``<think>`` of its own, and must be read from its first character as reasoning until ``</think>``.

The answer depends on the request's template options (``enable_thinking: false`` closes the block in the prompt
instead), so the template is rendered for a one-message probe chat with those options; answers are cached.
"""

import functools
import json

from transformers.utils.chat_template_utils import render_jinja_template

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
        rendered, _ = render_jinja_template([_PROBE], chat_template=chat_template, add_generation_prompt=True,
                                            **{**_TOKENS, **json.loads(kwargs_json)})
    except Exception:  # a template that refuses the probe: keep the parser chosen from its text
        return False
    return rendered[0].rstrip().endswith("<think>")
