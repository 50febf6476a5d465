"""Qwen3-Next: Gated DeltaNet : gated full attention 3:1, q/k/v/z and b/a packed per key head, a shared expert."""

from engine.models.hybrid import HybridCausalLM


class Qwen3NextForCausalLM(HybridCausalLM):
    deltanet_layout = "per_key_head"
