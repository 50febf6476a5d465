"""Running one step on the device: the flat batch, attention metadata, host-to-device copies, the model runner and the sampler."""
