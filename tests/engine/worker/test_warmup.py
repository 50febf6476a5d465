"""Which token counts the MoE warm-up runs: exactly the buckets a step could be given."""

import random

from engine.transforms.warmup import warmup_token_counts
from moe_kernels.launch_config import nearest_entry


def test_warmup_reaches_every_bucket_a_call_can_pick():
    rng = random.Random()
    for _ in range(200):
        buckets = sorted(rng.sample(range(1, 20000), rng.randint(1, 12)))
        max_tokens = rng.randint(1, 20000)
        configs = {b: b for b in buckets}  # nearest_entry only looks at the keys
        picked = {nearest_entry(configs, t) for t in range(1, max_tokens + 1)}
        counts = warmup_token_counts(buckets, max_tokens)
        assert all(1 <= t <= max_tokens for t in counts)
        assert {nearest_entry(configs, t) for t in counts} == picked, (buckets, max_tokens, counts)
