"""Running one step on the device: building the flat batch, the model runner, overlapped launches, the draft model, the
expert-load reader, and the CPUs memory settings. The batchs tensors live below (``engine.device_batch``), sampling
beside (``engine.sampling``)."""
