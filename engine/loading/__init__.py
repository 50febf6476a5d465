"""Building a model: safetensors loading, quantized experts, random-weight models, the demo checkpoint and the
checks a checkpoint passes before any process starts."""
