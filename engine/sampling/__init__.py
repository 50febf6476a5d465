"""Sampling on the device, for the whole batch at once: the sampler, penalties and logit_bias, min_p, and the
log-probabilities of sampled and prompt tokens as tensors (the reported values are ``engine.core.logprob_outputs``)."""
