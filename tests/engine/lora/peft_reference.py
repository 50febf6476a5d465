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


def save_random_adapters(model_dir: str, out_dir, ranks: dict[str, int], targets: dict):
    """PEFT adapters of the checkpoint at ``model_dir`` with random, non-zero A and B (alpha 2r), one per name of
    ``ranks`` (its rank), saved as ``out_dir/<name>``; returns (name -> directory, a PeftModel holding them all,
    each under its name). ``targets``: LoraConfig's target_modules / target_parameters."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {}
    for name, rank in ranks.items():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(init_lora_weights=False, r=rank, lora_alpha=2 * rank, **targets)
        get_peft_model(model, config).save_pretrained(str(out_dir / name))
        paths[name] = str(out_dir / name)
    ref = None
    for name, path in paths.items():
        if ref is None:
            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            ref = PeftModel.from_pretrained(base, path, adapter_name=name)
        else:
            ref.load_adapter(path, adapter_name=name)
    return paths, ref
