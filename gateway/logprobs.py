"""Logprobs in OpenAI's response shapes: chat ``choices[i].logprobs.content`` and the completions object
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""

from engine.core.logprobs import Logprobs
from engine.core.outputs import RequestOutput

# JSON has no -inf; OpenAI reports such tokens at this value.
FLOOR = -9999.0


def _value(lp: float) -> float:
    return max(lp, FLOOR)


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="surrogatepass"))


def chat_logprobs(lp: Logprobs | None) -> dict | None:
    """``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], "refusal": null}``."""
    if lp is None:
        return None
    content = []
    for i, token in enumerate(lp.tokens):
        top = [{"token": t, "logprob": _value(v), "bytes": _bytes(t)} for t, v in zip(lp.top_tokens[i], lp.top_logprobs[i])]
        content.append({"token": token, "logprob": _value(lp.logprobs[i]), "bytes": _bytes(token), "top_logprobs": top})
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """The completions logprobs object of one choice, chunk by chunk (``text_offset`` runs on across chunks)."""

    def __init__(self) -> None:
        self.offset = 0  # characters of the choice's text so far (prompt included, with echo)

    def format(self, *parts: Logprobs | None) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for lp in parts:
            if lp is None:
                continue
            for i, token in enumerate(lp.tokens):
                tokens.append(token)
                offsets.append(self.offset)
                self.offset += len(token)
                value = lp.logprobs[i]
                values.append(None if value is None else _value(value))
                if value is None:  # the first prompt token: nothing precedes it
                    tops.append(None)
                    continue
                # As OpenAI: the top tokens and the chosen one (so up to logprobs + 1 entries).
                top = {t: _value(v) for t, v in zip(lp.top_tokens[i], lp.top_logprobs[i])}
                top.setdefault(token, _value(value))
                tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def echo_text(prompt, out: RequestOutput) -> str:
    """The prompt's text for ``echo``: the request's own string, or the prompt tokens' texts for token ids."""
    if isinstance(prompt, str):
        return prompt
    return "".join(out.prompt_logprobs.tokens) if out.prompt_logprobs is not None else ""
