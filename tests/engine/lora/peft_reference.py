"""The reference every LoRA test compares with: transformers + PEFT's greedy tokens under one adapter (or none)."""

import contextlib

import torch


def peft_greedy_tokens(ref, adapter: str | None, prompt: list[int], max_new: int) -> list[int]:
    """``max_new`` greedy tokens of the PeftModel ``ref`` after ``prompt``, under ``adapter`` (None: the base model)."""
    if adapter is None:
        ctx = ref.disable_adapter()
    else:
        ref.set_adapter(adapter)
        ctx = contextlib.nullcontext()
    with ctx, torch.no_grad():
        out = ref.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
