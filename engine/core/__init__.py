"""Request state and scheduling in plain Python (no torch): configs, requests, sampling settings, the scheduler, its waiting queue, the KV block pool and cache manager, outputs and statistics."""
