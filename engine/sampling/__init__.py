"""The sampler's math on the device: penalties and logit_bias, min_p, log-probabilities."""
