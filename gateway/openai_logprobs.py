"""Logprobs in OpenAI's response shapes: chat ``choices[i].logprobs.content`` and the completions object
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""

from engine.core.logprob_outputs import Logprobs
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


def prompt_logprobs_list(lp: Logprobs | None, body) -> list | None:
    """vLLM's ``prompt_logprobs`` response field: per prompt position, null for the first, else
    ``{token id: {"logprob", "rank", "decoded_token"}}`` for the prompt's token and the ``k`` most likely
    (``k``: the request's ``prompt_logprobs``; rank 1 is the most likely; the prompt's token has rank null
    when it is not among them). Tokens as ``token_id:N`` with ``return_tokens_as_token_ids``."""
    if lp is None:
        return None
    k = body.prompt_logprobs
    if body.return_tokens_as_token_ids:
        lp = as_token_ids(lp)
    out: list = []
    for i, token_id in enumerate(lp.token_ids):
        value = lp.logprobs[i]
        if value is None:
            out.append(None)
            continue
        ranked = {str(t): {"logprob": _value(v), "rank": r, "decoded_token": text}
                  for r, (t, v, text) in enumerate(zip(lp.top_ids[i][:k], lp.top_logprobs[i][:k], lp.top_tokens[i][:k]),
                                                   start=1)}
        own = ranked.pop(str(token_id), {"logprob": _value(value), "rank": None, "decoded_token": lp.tokens[i]})
        out.append({str(token_id): own, **ranked})
    return out


def top_k(lp: Logprobs | None, k: int | None) -> Logprobs | None:
    """``lp`` with at most ``k`` top tokens per position (the engine computed the most any field asked)."""
    if lp is None or k is None or all(len(top) <= k for top in lp.top_ids):
        return lp
    return Logprobs(lp.token_ids, lp.logprobs, [t[:k] for t in lp.top_ids], [t[:k] for t in lp.top_logprobs],
                    lp.tokens, [t[:k] for t in lp.top_tokens])


def as_token_ids(lp: Logprobs | None) -> Logprobs | None:
    """``lp`` with every token shown as ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``: text that
    does not decode on its own, a piece of a multi-byte character, stays unambiguous)."""
    if lp is None:
        return None
    return Logprobs(lp.token_ids, lp.logprobs, lp.top_ids, lp.top_logprobs, [f"token_id:{t}" for t in lp.token_ids],
                    [[f"token_id:{t}" for t in top] for top in lp.top_ids])


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
