"""LoRA adapters over the base model: reading PEFT's format, and the batched low-rank deltas of a mixed batch."""
