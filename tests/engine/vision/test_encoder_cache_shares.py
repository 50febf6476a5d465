"""The vision encoder's cache bounded per tenant: a tenant flooding it with distinct images evicts only its own
entries past its share, never another tenant's while both fit. The cache against a plain list model of the
rule over random operation sequences (counters, bytes and held keys after each step), a flood scenario with and
without shares (the shared LRU does lose the victim's entry), and an engine on a tiny random Qwen3-VL-MoE whose
``--encoder-cache-tenant-share`` keeps one tenant's image cached through another's flood (the vision tower's
calls and the engine's counters), while a tenant whose quota share is 1 can still push it out."""

import json
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.request_policy import RequestPolicy
from engine.kv_tiers.setup import GB
from engine.loading.model_check import check_model
from engine.vision.encoder_cache import EncoderCache
from engine.vision.qwen3_vl_tower import VisionFeatures
from engine.vision.qwen_image_processing import process_image
from tests.engine.vision.image_engine_checks import on_tower_runs
from tests.engine.vision.qwen3_vl_checkpoint import (IMAGE_CONFIG, IMAGE_TOKEN, VISION_END, VISION_START,
                                                     make_qwen3_vl_moe, random_image)

TOKENS, HIDDEN, TAPS = 4, 8, 2
ENTRY = TOKENS * HIDDEN * 4 * (1 + TAPS)  # bytes of one image's features (float32 embeds and deepstack)


def _features(gen: torch.Generator) -> VisionFeatures:
    return VisionFeatures(torch.randn(TOKENS, HIDDEN, generator=gen), torch.randn(TAPS, TOKENS, HIDDEN, generator=gen))


class Reference:
    """The rule in plain lists, every entry the same size: the held keys, least recently used first."""

    def __init__(self, slots: int, default_share: float | None) -> None:
        self.slots, self.default_share = slots, default_share
        self.held: list[tuple[bytes, str, str]] = []  # (digest, salt, tenant)
        self.hits = self.misses = self.evictions = self.not_kept = 0

    def get(self, digest, salt) -> bool:
        for i, (d, s, t) in enumerate(self.held):
            if (d, s) == (digest, salt):
                self.held.append(self.held.pop(i))
                self.hits += 1
                return True
        self.misses += 1
        return False

    def put(self, digest, salt, tenant, share) -> None:
        if any((d, s) == (digest, salt) for d, s, _ in self.held):
            return
        share = share if share is not None else self.default_share
        if share is not None:
            allowed = int(share * (self.slots * ENTRY) // ENTRY)
            if allowed < 1:
                self.not_kept += 1
                return
            while sum(1 for e in self.held if e[2] == tenant) + 1 > allowed:
                self.held.remove(next(e for e in self.held if e[2] == tenant))
                self.evictions += 1
        while len(self.held) + 1 > self.slots:
            self.held.pop(0)
            self.evictions += 1
        self.held.append((digest, salt, tenant))


@pytest.mark.parametrize("default_share", [None, 0.5, 0.3])
def test_shares_match_the_plain_model_on_random_sequences(default_share):
    seed = random.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    slots = rng.randint(3, 8)
    cache = EncoderCache(slots * ENTRY, default_share)
    ref = Reference(slots, default_share)
    tenants = {"a": None, "b": rng.choice([None, 0.25, 0.6]), "c": rng.choice([None, 1.0, 0.4])}  # quota shares
    feats = _features(gen)
    for step in range(300):
        tenant = rng.choice(list(tenants))
        digest, salt = bytes([rng.randrange(12)]), f"salt-{tenant}"
        if cache.get(digest, salt, torch.device("cpu")) is None:
            cache.put(digest, salt, feats, tenant, tenants[tenant])
        if not ref.get(digest, salt):
            ref.put(digest, salt, tenant, tenants[tenant])
        assert (cache.hits, cache.misses, cache.evictions, cache.not_kept) == (
            ref.hits, ref.misses, ref.evictions, ref.not_kept), f"seed={seed} step={step}"
        assert {(d, s) for d, s, _ in ref.held} == set(cache._index.entries), f"seed={seed} step={step}"
        held_by = {}
        for _, _, t in ref.held:
            held_by[t] = held_by.get(t, 0) + ENTRY
        assert cache.bytes_by_tenant == held_by and cache.bytes_used == len(ref.held) * ENTRY <= slots * ENTRY


def test_a_flood_evicts_only_its_own_entries_past_its_share():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    cpu = torch.device("cpu")
    for share, bob_kept in ((0.5, True), (None, False)):
        cache = EncoderCache(10 * ENTRY, share)
        for digest in (b"bob-1", b"bob-2"):
            cache.put(digest, "salt-bob", _features(gen), "bob")
        for i in range(50):  # distinct images, none sent twice
            cache.put(f"flood-{i}".encode(), "salt-mallory", _features(gen), "mallory")
        held = [cache.get(d, "salt-bob", cpu) is not None for d in (b"bob-1", b"bob-2")]
        if bob_kept:
            assert held == [True, True] and (cache.hits, cache.misses) == (2, 0)
            assert cache.evicted_by_tenant == {"mallory": 45} and cache.evictions == 45
            assert cache.bytes_by_tenant == {"bob": 2 * ENTRY, "mallory": 5 * ENTRY}
        else:  # one shared LRU: the flood pushed bob's out
            assert held == [False, False] and cache.evicted_by_tenant["bob"] == 2
    # a tenant's own (quota) share overrides the cache's default, either way
    cache = EncoderCache(10 * ENTRY, 0.5)
    for i in range(20):
        cache.put(f"x-{i}".encode(), "s1", _features(gen), "small", share=0.2)
        cache.put(f"y-{i}".encode(), "s2", _features(gen), "big", share=0.8)
    assert cache.bytes_by_tenant == {"small": 2 * ENTRY, "big": 8 * ENTRY}
    cache.put(b"huge", "s3", VisionFeatures(torch.zeros(40, HIDDEN), torch.zeros(TAPS, 40, HIDDEN)), "other")
    assert cache.not_kept == 1 and (b"huge", "s3") not in cache  # larger than its share (half the cache)


def test_the_share_is_an_engine_setting_refused_out_of_range():
    with pytest.raises(ValueError, match=r"encoder_cache_tenant_share must be in \(0, 1\] or none, got 1.5"):
        EngineConfig(model="m", encoder_cache_tenant_share=1.5)
    with pytest.raises(ValueError, match="encoder_cache_tenant_share"):
        EngineConfig(model="m", encoder_cache_tenant_share=0.0)


def _prompt(rng: random.Random, processed) -> list[int]:
    text = lambda n: [rng.randrange(1, VISION_START) for _ in range(n)]  # noqa: E731
    return text(rng.randint(3, 6)) + [VISION_START] + [IMAGE_TOKEN] * processed.num_tokens(IMAGE_CONFIG.merge_size) \
        + [VISION_END] + text(2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    seed = random.randrange(2**31)
    path = str(tmp_path_factory.mktemp("qwen3_vl_moe_shares"))
    make_qwen3_vl_moe(path, seed)
    with open(f"{path}/preprocessor_config.json", "w") as f:
        json.dump({"patch_size": IMAGE_CONFIG.patch_size, "temporal_patch_size": IMAGE_CONFIG.temporal_patch_size,
                   "merge_size": IMAGE_CONFIG.merge_size, "image_mean": list(IMAGE_CONFIG.image_mean),
                   "image_std": list(IMAGE_CONFIG.image_std),
                   "size": {"shortest_edge": IMAGE_CONFIG.min_pixels, "longest_edge": IMAGE_CONFIG.max_pixels}}, f)
    return path, seed


@pytest.mark.parametrize("setting, flag", [
    (dict(pipeline_parallel_size=2), "--pipeline-parallel-size"),
    (dict(enable_expert_parallel=True, data_parallel_size=2, distributed_init_method="tcp://127.0.0.1:1"),
     "--enable-expert-parallel"),
])
def test_split_settings_are_refused_at_start(checkpoint, setting, flag):
    """The settings docs/models.md lists as refused with images: one line naming the flag, before any process.
    Tensor parallelism is not refused (tests/distributed/test_image_tensor_parallel.py serves it)."""
    path, _ = checkpoint
    with pytest.raises(ValueError) as refused:
        check_model(EngineConfig(model=path, **setting))
    text = str(refused.value)
    assert "\n" not in text and text.startswith(f"{flag} is not supported with Qwen3VLMoeForConditionalGeneration yet: "), \
        text
    check_model(EngineConfig(model=path, tensor_parallel_size=2))


def test_engine_keeps_a_tenants_image_through_anothers_flood(checkpoint):
    path, seed = checkpoint
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    pics = [random_image(gen, 16, 16) for _ in range(10)]  # 4 tokens each: 4 x 32 x 4 x 3 bytes of features
    entry = 4 * 32 * 4 * 3
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=48, block_size=4, max_num_batched_tokens=32,
              encoder_cache_gb=(4 * entry + 0.5) / GB, encoder_cache_tenant_share=0.5)
    cache = llm.engine.model.encoder_cache
    assert (cache.capacity_bytes, cache.tenant_share) == (4 * entry, 0.5)
    calls = []
    on_tower_runs(llm.engine.model, lambda grid: calls.append(1))
    alice = RequestPolicy(tenant="alice", cache_salt="salt-alice")
    mallory = RequestPolicy(tenant="mallory", cache_salt="salt-mallory")
    greedy = RequestPolicy(tenant="greedy", cache_salt="salt-greedy", cache_share=1.0)  # its quota's share

    def run(pic, policy):
        processed = process_image(pic, IMAGE_CONFIG)
        llm.engine.add_request(_prompt(rng, processed), SamplingParams(temperature=0.0, max_tokens=1,
                                                                     ignore_eos=True), policy=policy, images=[pic])
        while llm.engine.has_unfinished():
            llm.engine.step()

    run(pics[0], alice)
    for pic in pics[1:6]:  # five distinct images: mallory holds at most two entries (half the cache)
        run(pic, mallory)
    assert len(calls) == 6 and cache.evicted_by_tenant == {"mallory": 3}
    run(pics[0], alice)
    assert len(calls) == 6, f"alice's image was evicted by another tenant's flood (seed={seed})"
    stats = llm.engine.stats()
    assert (stats.encoder_cache_hits, stats.encoder_cache_evictions) == (1, 3)
    # a tenant held to the whole cache by its quota can push alice's image out (the shared LRU's behaviour)
    for pic in pics[6:10]:  # four distinct images fill the cache: the least recently used go, alice's last
        run(pic, greedy)
    run(pics[0], alice)
    assert len(calls) == 11 and cache.evicted_by_tenant["alice"] == 1, f"seed={seed}"
