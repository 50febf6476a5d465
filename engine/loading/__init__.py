"""Building a model: checkpoint configs, safetensors loading, random-weight models and the demo checkpoint."""
