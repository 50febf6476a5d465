"""The host cache keeps an adapter planned into a slot until the slot write takes it, even when a background read
finishing in between would evict it (one host copy, two adapters)."""

import pytest
import torch

from engine.lora.host_cache import HostLoraCache
from engine.lora.peft_format import load_adapter
from tests.engine.lora.adapter_dirs import EXPERT_SIZE, EXPERTS, HIDDEN, write_adapter

pytestmark = pytest.mark.timeout(60)


def test_a_claimed_adapter_survives_a_read_that_would_evict_it(tmp_path):
    paths = {name: write_adapter(str(tmp_path / name), rank=2) for name in ("a", "b")}  # random factors

    def read(name, path):
        return load_adapter(name, path, EXPERTS, HIDDEN, EXPERT_SIZE)

    cache = HostLoraCache(1, read)
    try:
        cache.put("a", paths["a"], read("a", paths["a"]))
        assert cache.claim("a", paths["a"])  # planned into a slot
        assert not cache.ready("b", paths["b"])  # another request's adapter: read in the background
        cache.wait_for_reads(10)
        assert cache.ready("b", paths["b"])  # read and inserted, past the capacity: "a" is claimed
        taken = cache.take("a", paths["a"])
        assert cache.sync_reads == 0 and cache.hits == 1
        want = read("a", paths["a"])
        for target, parts in want.linears.items():
            assert torch.equal(taken.linears[target][0].a, parts[0].a)
        # Back to one copy: "a" (in its slot now, and the older) went, "b" stays for its slot write.
        assert cache.evictions == 1 and cache.ready("b", paths["b"]) and not cache.ready("a", paths["a"])
        cache.wait_for_reads(10)

        # Unclaimed, the same sequence evicts "a" and its slot write reads the file again.
        cache.discard("b", paths["b"])
        assert cache.ready("a", paths["a"]) and not cache.ready("b", paths["b"])
        cache.wait_for_reads(10)
        cache.take("a", paths["a"])
        assert cache.sync_reads == 1
    finally:
        cache.close()
