"""Moving prompts' KV blocks between engines: a prefill engine computes a prompt, a decode engine continues it."""
