"""Grammar-constrained decoding: what a StructuredOutput compiles to, and the per-request matchers whose
token masks the sampler applies."""
