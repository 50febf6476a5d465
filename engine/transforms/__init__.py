"""Build-time transforms applied to a loaded model: Triton fusion, dense-gemv selection, MoE kernel warm-up and decode CUDA graphs."""
