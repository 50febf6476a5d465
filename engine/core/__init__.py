"""Request state and scheduling in plain Python (no torch): configs (the engine's, and a checkpoint's as the
engine reads it), requests, sampling settings, the scheduler, its waiting queue, the KV block pool and cache
manager, outputs and statistics."""
