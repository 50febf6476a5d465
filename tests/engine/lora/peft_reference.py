"""The reference every LoRA test compares with: transformers + PEFT's greedy tokens under one adapter (or none)."""

import contextlib

import torch


def _under(ref, adapter: str | None):
    """A context in which ``ref`` runs under ``adapter`` (None: the base model)."""
    if adapter is None:
        return ref.disable_adapter()
    ref.set_adapter(adapter)
    return contextlib.nullcontext()


def peft_last_logits(ref, adapter: str | None, ids: list[int]) -> torch.Tensor:
    """The PeftModel ``ref``'s logits [V] for the token after ``ids``, under ``adapter`` (None: the base model)."""
    with _under(ref, adapter), torch.no_grad():
        return ref(input_ids=torch.tensor([ids])).logits[0, -1]


def peft_greedy_tokens(ref, adapter: str | None, prompt: list[int], max_new: int) -> list[int]:
    """``max_new`` greedy tokens of the PeftModel ``ref`` after ``prompt``, under ``adapter`` (None: the base model)."""
    with _under(ref, adapter), torch.no_grad():
        out = ref.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
