"""Text in and out: prompt preparation (chat templates, tokenization, length checks) and incremental detokenization. No torch."""
