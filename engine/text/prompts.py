"""Request inputs -> prompt token ids: chat templates, tokenization and the checks that refuse a prompt.

Torch-free, so the gateway runs it in its own process before a request
reaches the engine: a template that raises, a tokenizer that chokes or a
prompt far past the context window fails that request alone with a message
for the user, and a multi-megabyte prompt is refused by its size without
being tokenized, never stalling the engine's loop for other tenants.
"""

import functools
from collections.abc import Sequence
from typing import Protocol

from engine.text import harmony_chat
from engine.text.chat_input import ChatInput, InvalidPrompt  # the gateway imports them from here too
from engine.text.control_tokens import ControlTokens
from engine.text.harmony_vocab import harmony_encoding


class Turn(Protocol):
    role: str
    content: str


# Names apply_chat_template gives a meaning of its own: not settable through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def chat_size(messages: "Sequence[Turn] | ChatInput") -> int:
    return messages.num_chars() if isinstance(messages, ChatInput) else sum(len(t.content) for t in messages)


class InputProcessor:
    """Turns a request's prompt (text or token ids) or chat turns into checked prompt token ids.

    ``max_model_len`` bounds prompt plus output; a prompt may use at most
    ``max_model_len - 1`` tokens. Without a tokenizer only token-id prompts work.
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # No token decodes to more characters than its vocabulary string has (byte-level BPE maps one
        # byte to one character; SentencePiece one character to one): text longer than this many
        # characters cannot fit the context, and is refused without being tokenized.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer is not None else 1
        self.max_prompt_chars = max_model_len * max(longest, 1)

    # ---- checks -------------------------------------------------------------
    def _check_size(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise InvalidPrompt(
                f"the prompt has {num_chars:,} characters, more than fit this model's context of "
                f"{self.max_model_len:,} tokens; shorten it", param)

    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise InvalidPrompt("the prompt is empty", param)
        if len(ids) >= self.max_model_len:
            raise InvalidPrompt(
                f"the prompt has {len(ids):,} tokens; this model serves at most {self.max_model_len - 1:,} prompt "
                f"tokens (its context is {self.max_model_len:,} tokens, prompt and output together)", param)
        return ids

    # ---- text ---------------------------------------------------------------
    def _require_tokenizer(self, what: str, param: str) -> None:
        if self.tokenizer is None:
            raise InvalidPrompt(f"this checkpoint has no tokenizer files: {what}", param)

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """Token ids of ``text`` (too-long text refused before tokenizing)."""
        self._require_tokenizer("send prompts as lists of token ids", param)
        self._check_size(len(text), param)
        try:
            # The transformers call, not the raw tokenizers one: it releases the GIL while it works, so a
            # long prompt tokenized on a worker thread does not hold up the caller's event loop.
            return self.tokenizer.encode(text)
        except Exception as e:  # a tokenizer bug is this request's failure, not the server's
            raise InvalidPrompt(f"the tokenizer could not encode the prompt ({type(e).__name__}: {e})", param) from None

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's chat template text (None without one)."""
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        return template if isinstance(template, str) else None

    @functools.cached_property
    def control_tokens(self) -> ControlTokens:
        """The tokens client text never becomes (``engine.text.control_tokens``), found once."""
        return ControlTokens(self.tokenizer, self.chat_template)

    def _chat(self, turns: "Sequence[Turn] | ChatInput", add_generation_prompt: bool) -> ChatInput:
        """Chat turns as a checked ``ChatInput`` (plain turns take ``add_generation_prompt``)."""
        self._require_tokenizer("chat needs one", "messages")
        chat = turns if isinstance(turns, ChatInput) else ChatInput(
            [{"role": t.role, "content": t.content} for t in turns], add_generation_prompt=add_generation_prompt)
        if not chat.messages:
            raise InvalidPrompt("messages must not be empty", "messages")
        self._check_size(chat.num_chars(), "messages")
        return chat

    def render_chat(self, turns: "Sequence[Turn] | ChatInput", add_generation_prompt: bool = True) -> str:
        """Chat turns -> prompt text through the checkpoint's chat template (a plain transcript without one).

        A ``ChatInput`` brings tools and template options, passed to the template as transformers'
        ``apply_chat_template`` does; plain turns take ``add_generation_prompt`` (end with the assistant's
        turn opening). The text is the template's: tokenizing it reads control tokens spelled in client
        strings as those tokens, which ``chat_token_ids`` never does."""
        chat = self._chat(turns, add_generation_prompt)
        if not self.chat_template:
            if chat.tools:
                raise InvalidPrompt("this model has no chat template, so it cannot be given tools", "tools")
            text = "".join(f"{t['role']}: {t.get('content') or ''}\n" for t in chat.messages)
            return text + "assistant:" if chat.add_generation_prompt else text
        try:
            return self.tokenizer.apply_chat_template(
                chat.messages, tools=chat.tools or None, tokenize=False, add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message, **chat.template_kwargs)
        except Exception as e:  # jinja2's TemplateError from raise_exception(), or any bug in the template
            raise InvalidPrompt(f"the model's chat template refused these messages: {e}", "messages") from None

    def chat_token_ids(self, turns: "Sequence[Turn] | ChatInput", add_generation_prompt: bool = True) -> list[int]:
        """A chat's prompt token ids: rendered by the chat template, the template's markup tokenized as such and
        the client's strings as plain text (``engine.text.control_tokens``)."""
        shielded, sentinels = self.control_tokens.shield(self._chat(turns, add_generation_prompt))
        text = self.render_chat(shielded)
        if not sentinels:
            return self.encode(text, "messages")
        try:
            return self.control_tokens.encode(text, sentinels)
        except Exception as e:  # a tokenizer bug is this request's failure, not the server's
            raise InvalidPrompt(f"the tokenizer could not encode the prompt ({type(e).__name__}: {e})",
                                "messages") from None

    def render_harmony(self, chat: ChatInput) -> list[int]:
        """A gpt-oss chat's prompt token ids, rendered by openai-harmony (``engine.text.harmony_chat``); its
        vocabulary comes from this tokenizer (``engine.text.harmony_vocab``, whose HarmonyVocabError is raised
        for a tokenizer that is not o200k)."""
        self._require_tokenizer("chat needs one", "messages")
        if not chat.messages:
            raise InvalidPrompt("messages must not be empty", "messages")
        self._check_size(chat.num_chars(), "messages")
        return harmony_chat.render(chat, harmony_encoding(self.tokenizer))

    # ---- the whole step ---------------------------------------------------------
    def token_ids(self, prompt: str | Sequence[int], param: str = "prompt") -> list[int]:
        """Text or token ids -> checked token ids (each id in the vocabulary)."""
        if isinstance(prompt, str):
            return self._check_ids(self.encode(prompt, param), param)
        ids = list(prompt)
        vocab = self.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidPrompt(f"token ids must be integers in [0, {vocab}); got {bad[:3]}", param)
        return self._check_ids(ids, param)

    def prepare(self, prompt: str | Sequence[int] | None = None,
                messages: "Sequence[Turn] | ChatInput | None" = None, add_generation_prompt: bool = True) -> list[int]:
        """The prompt token ids of a completion (``prompt``) or a chat request (``messages``)."""
        if isinstance(messages, ChatInput) and messages.harmony:
            return self._check_ids(self.render_harmony(messages), "messages")
        if messages is not None:
            return self._check_ids(self.chat_token_ids(messages, add_generation_prompt), "messages")
        if prompt is None:
            raise InvalidPrompt("a prompt is required", "prompt")
        return self.token_ids(prompt)

    def decode(self, token_ids: Sequence[int], param: str = "tokens") -> str:
        """Text of token ids (special tokens included, as the tokenizer writes them)."""
        self._require_tokenizer("there is no text for token ids", param)
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidPrompt(f"token ids must be integers in [0, {self.vocab_size}); got {bad[:3]}", param)
        if len(token_ids) > self.max_model_len:
            raise InvalidPrompt(f"{len(token_ids):,} token ids are more than this model's context of "
                                f"{self.max_model_len:,}", param)
        return self.tokenizer.decode(list(token_ids))
