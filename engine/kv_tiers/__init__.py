"""Prefix-cache tiers below the device KV pool: host memory, then disk, keyed by the device pool's salted
chained block hash plus the layout fingerprint (``keys``). See docs/prefix_cache_tiers.md."""
