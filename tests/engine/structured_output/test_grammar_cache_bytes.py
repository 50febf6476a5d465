"""Per-schema matchers are kept by their bytes, not their count: many distinct schemas grow the engine's memory
by at most the budget (measured as the process's resident memory), and the most recent schemas stay ready."""

import gc
import json
import random

import torch
from transformers import AutoTokenizer

from engine.core.structured_output_spec import StructuredOutput
from engine.loading.demo_model import write_demo_model
from engine.structured_output import matchers
from engine.structured_output.matchers import GrammarMatchers


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _schema(properties: int) -> StructuredOutput:
    tag = f"k{random.randrange(10**9)}_"
    names = [f"{tag}{i}" for i in range(properties)]
    return StructuredOutput(json_schema=json.dumps(
        {"type": "object", "properties": {n: {"type": "string", "maxLength": random.randrange(1, 9)} for n in names},
         "required": names}))


def test_many_distinct_schemas_stay_within_the_byte_budget(tmp_path, monkeypatch):
    write_demo_model(str(tmp_path / "demo"), seed=random.randrange(1000))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "demo"))
    budget = 8 * 1024 * 1024
    monkeypatch.setattr(matchers, "PROTOTYPE_CACHE_BYTES", budget)
    grammars = GrammarMatchers(tokenizer, len(tokenizer), tokenizer.eos_token_id, torch.device("cpu"))
    for _ in range(3):  # the tokenizer's own structures and the allocator's first arenas, before measuring
        grammars.prepare(_schema(150))
    gc.collect()
    before = _rss_bytes()
    specs = [_schema(150) for _ in range(80)]  # each reckoned ~0.7 MB: 80 of them are ~7x the budget
    for spec in specs:
        grammars.prepare(spec)
    gc.collect()
    grown = _rss_bytes() - before
    assert grown < 2 * budget, f"{grown / 2**20:.1f} MB for a {budget / 2**20:.0f} MB budget"
    kept = [spec for spec in specs if grammars.prepared(spec)]
    assert 0 < len(kept) < len(specs) and kept == specs[-len(kept):]  # the most recent ones
