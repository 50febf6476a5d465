"""What one forward reads, as device tensors: the flat batch, its attention metadata, and the one-copy
host-to-device staging they travel by. Below the layers, kernels and transforms that read them, and below the
worker that builds them (``engine.worker.batch_builder``)."""
