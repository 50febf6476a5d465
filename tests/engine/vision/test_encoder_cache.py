"""The vision encoder's cache and the per-step encoder budget, on a tiny random Qwen3-VL-MoE (every parameter
random) against transformers' greedy tokens: an image sent again by the same tenant is not encoded again (the
tower's calls counted, and the engine's Prometheus counters), another tenant's same image is encoded for it; a
request with several images under a small encoder budget is encoded over several steps while a text-only request
decodes a token every step; encoded bytes a tenant sent before are not even preprocessed again while the cache
holds their features. Layer-chunked: requests sent together with one picture run the tower over it once (each
their own without a cache), and a step's pieces never evict the features that step reads from the cache."""

import io
import random

import msgspec
import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request_policy import RequestPolicy
from engine.core.stats import SchedulerStats
from engine.vision.encoder_cache import EncoderCache
from engine.vision.prompt_images import LazyPixels
from engine.vision.qwen3_vl_tower import VisionFeatures
from engine.vision.qwen_image_processing import process_image
from gateway.engine_metrics import EngineCollector
from tests.engine.vision.image_engine_checks import on_tower_runs
from tests.engine.vision.qwen3_vl_checkpoint import IMAGE_CONFIG, hf_greedy, random_image, text_ids, with_images


def _tower_calls(llm: LLM) -> list[int]:
    """Image tokens of each vision-tower forward from now on (a hook on the engine's own tower)."""
    calls: list[int] = []
    merge = IMAGE_CONFIG.merge_size ** 2
    on_tower_runs(llm.engine.model, lambda grid: calls.append(grid[1] * grid[2] // merge))
    return calls


def _run(llm: LLM, prompt: list[int], images: list, policy: RequestPolicy, max_new: int) -> list[int]:
    rid = llm.engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True),
                                 policy=policy, images=images)
    tokens = []
    while llm.engine.has_unfinished():
        tokens += [t for out in llm.engine.step() if out.request_id == rid for t in out.token_ids]
    return tokens


def test_repeated_image_is_encoded_once_per_tenant(qwen3_vl_checkpoint):
    path, model, seed = qwen3_vl_checkpoint
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pic = random_image(gen, rng.randint(12, 40), rng.randint(12, 40))
    processed = process_image(pic, IMAGE_CONFIG)
    # three prompts around the same picture, each with its own text before it: no prefix-cache block holds it twice
    prompts = [with_images(rng, [processed]) for _ in range(3)]
    expected = [hf_greedy(model, p, [processed], 6) for p in prompts]
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=48, block_size=4, max_num_batched_tokens=32,
              encoder_cache_gb=0.001)
    calls = _tower_calls(llm)
    alice = RequestPolicy(tenant="alice", cache_salt="salt-of-alice")
    bob = RequestPolicy(tenant="bob", cache_salt="salt-of-bob")
    # the engine decodes and preprocesses the encoded bytes each time: the pixels' digest is the key
    assert _run(llm, prompts[0], [pic], alice, 6) == expected[0], f"seed={seed}"
    assert len(calls) == 1
    assert _run(llm, prompts[1], [pic], alice, 6) == expected[1], f"seed={seed}"
    assert len(calls) == 1, "the same tenant's same image was encoded again"
    assert _run(llm, prompts[2], [pic], bob, 6) == expected[2], f"seed={seed}"
    assert len(calls) == 2, "another tenant's request was served the first tenant's encoding"
    assert _run(llm, prompts[0], [processed], bob, 6) == expected[0], f"seed={seed}"
    assert len(calls) == 2

    # the counters as /metrics exports them, from the engine's own statistics sent over its pipe
    stats = msgspec.msgpack.decode(msgspec.msgpack.encode(llm.engine.stats()), type=SchedulerStats)
    engine = type("Engine", (), dict(info=object(), dead=None, stats=stats))()
    families = {f.name: f for f in EngineCollector(engine).collect()}
    totals = {name: [s.value for s in families[name].samples if s.name == name + "_total"]
              for name in ("moegate_encoder_cache_hits", "moegate_encoder_cache_misses")}
    assert totals == {"moegate_encoder_cache_hits": [2], "moegate_encoder_cache_misses": [2]}
    assert [s.value for s in families["moegate_encoder_cache_bytes"].samples] == [llm.engine.model.encoder_cache.bytes_used]
    assert llm.engine.model.encoder_cache.bytes_used > 0


def test_repeated_bytes_are_not_preprocessed_again(qwen3_vl_checkpoint):
    """The API's path: encoded bytes. Sent again by the same tenant, their digest is known without preprocessing
    and the pixels are never computed (the features come from the encoder cache); another tenant's same bytes
    are preprocessed and encoded for it."""
    path, model, seed = qwen3_vl_checkpoint
    rng = random.Random(seed + 2)
    gen = torch.Generator().manual_seed(seed + 2)
    pic = random_image(gen, rng.randint(12, 40), rng.randint(12, 40))
    png = io.BytesIO()
    pic.save(png, format="PNG")
    data = png.getvalue()
    processed = process_image(pic, IMAGE_CONFIG)
    prompts = [with_images(rng, [processed]) for _ in range(3)]
    expected = [hf_greedy(model, p, [processed], 4) for p in prompts]
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=48, block_size=4, max_num_batched_tokens=32)
    calls = _tower_calls(llm)
    alice = RequestPolicy(tenant="alice", cache_salt="salt-of-alice")
    bob = RequestPolicy(tenant="bob", cache_salt="salt-of-bob")
    first = llm.engine.prompt_images(prompts[0], [data], alice.cache_salt)
    assert not isinstance(first[0].pixels, LazyPixels)
    assert _run(llm, prompts[0], first, alice, 4) == expected[0], f"seed={seed}"
    again = llm.engine.prompt_images(prompts[1], [data], alice.cache_salt)
    assert isinstance(again[0].pixels, LazyPixels) and again[0].digest == first[0].digest
    assert _run(llm, prompts[1], again, alice, 4) == expected[1], f"seed={seed}"
    assert not again[0].pixels.loaded and len(calls) == 1
    theirs = llm.engine.prompt_images(prompts[1], [data], bob.cache_salt)
    assert not isinstance(theirs[0].pixels, LazyPixels)
    assert _run(llm, prompts[1], theirs, bob, 4) == expected[1] and len(calls) == 2, f"seed={seed}"
    # not in the encoder cache any more (an empty one in its place): bytes seen before are preprocessed when the
    # tower needs them, in the step
    llm.engine.model.encoder_cache = EncoderCache(1 << 20)
    lazy = llm.engine.prompt_images(prompts[2], [data], alice.cache_salt)
    assert isinstance(lazy[0].pixels, LazyPixels) and not lazy[0].pixels.loaded
    assert _run(llm, prompts[2], lazy, alice, 4) == expected[2], f"seed={seed}"
    assert lazy[0].pixels.loaded and len(calls) == 3


def test_encoder_budget_spreads_images_over_steps_while_text_decodes(qwen3_vl_checkpoint):
    path, model, seed = qwen3_vl_checkpoint
    rng = random.Random(seed + 1)
    gen = torch.Generator().manual_seed(seed + 1)
    # the first image takes the whole budget (12 tokens), the others 2..12 each: at least two encoding steps
    sizes = [(32, 24)] + [(rng.randint(12, 40), rng.randint(12, 40)) for _ in range(2)]
    processed = [process_image(random_image(gen, w, h), IMAGE_CONFIG) for w, h in sizes]
    budget = 12
    many = with_images(rng, processed)
    text = text_ids(rng, rng.randint(5, 20))
    text_new, many_new = 16, 4
    want_text = hf_greedy(model, text, [], text_new)
    want_many = hf_greedy(model, many, processed, many_new)
    # a step holds every token of the image prompt: only the encoder budget spreads it over steps
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=128, max_num_encoder_tokens=budget, encoder_cache_gb=0)
    calls = _tower_calls(llm)
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    engine = llm.engine
    engine.add_request(text, msgspec.structs.replace(params, max_tokens=text_new), request_id="text")
    got = {"text": [t for out in engine.step() for t in out.token_ids]}  # its prefill: its first token
    engine.add_request(many, msgspec.structs.replace(params, max_tokens=many_new), request_id="many",
                       images=processed)
    got["many"] = []
    encoded_per_step = []
    while engine.has_unfinished():
        before = len(calls)
        outputs = engine.step()
        encoded_per_step.append(sum(calls[before:]))
        new = {rid: [t for out in outputs if out.request_id == rid for t in out.token_ids] for rid in got}
        if len(got["text"]) < text_new:
            assert len(new["text"]) == 1, "the text-only request missed a step while images were encoded"
        for rid in got:
            got[rid] += new[rid]
    assert got == {"text": want_text, "many": want_many}, f"seed={seed}"
    steps_encoding = [n for n in encoded_per_step if n]
    assert sum(steps_encoding) == sum(p.num_tokens(IMAGE_CONFIG.merge_size) for p in processed)
    assert len(steps_encoding) >= 2 and max(steps_encoding) <= budget, encoded_per_step


def test_encoder_cache_evicts_least_recently_used():
    rng = random.Random()
    hidden, deep = rng.randint(4, 16), rng.randint(0, 3)

    def features(n: int) -> VisionFeatures:
        return VisionFeatures(torch.randn(n, hidden), torch.randn(deep, n, hidden))

    rows = {"a": rng.randint(1, 12), "b": rng.randint(1, 12)}
    rows["c"] = rng.randint(1, rows["b"])  # room for c once b is out, never for all three
    feats = {name: features(n) for name, n in rows.items()}
    size = {k: (v.embeds.numel() + v.deepstack.numel()) * 4 for k, v in feats.items()}
    cache = EncoderCache(size["a"] + size["b"])
    cpu = torch.device("cpu")
    for name in "ab":
        assert cache.get(name.encode(), "s", cpu) is None
        cache.put(name.encode(), "s", feats[name])
    assert cache.get(b"a", "t", cpu) is None, "another salt's lookup must miss"
    assert torch.equal(cache.get(b"a", "s", cpu).embeds, feats["a"].embeds)  # a is now the most recent
    cache.put(b"c", "s", feats["c"])
    assert (b"b", "s") not in cache and (b"a", "s") in cache and (b"c", "s") in cache
    assert (cache.hits, cache.misses, cache.evictions) == (1, 3, 1)
    assert cache.bytes_used == size["a"] + size["c"] <= cache.capacity_bytes
    cache.put(b"big", "s", features(1000))  # larger than the whole cache: not kept, nothing evicted for it
    assert len(cache) == 2 and cache.evictions == 1


def _one_picture(model, seed: int, n: int, max_new: int):
    """A random picture, ``n`` prompts with it, transformers' ``max_new`` greedy tokens for each, and the tower's
    token-blocks over it: patches x (the patch embedding, each block)."""
    rng = random.Random(seed)
    pic = random_image(torch.Generator().manual_seed(seed), rng.randint(24, 40), rng.randint(24, 40))
    processed = process_image(pic, IMAGE_CONFIG)
    prompts = [with_images(rng, [processed]) for _ in range(n)]
    t, h, w = processed.grid_thw
    return (pic, prompts, [hf_greedy(model, p, [processed], max_new) for p in prompts],
            t * h * w * (1 + len(model.model.visual.blocks)))


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("images_a_step", [0.1, 1.5])
def test_requests_sent_together_with_one_image_encode_it_once(qwen3_vl_checkpoint, images_a_step, overlap):
    """Layer-chunked encoding, a step's budget a tenth of the image's tower (spread over steps) or one and a half
    of it (one request's whole image and the start of the next one's in a step): requests sent at once with the
    same picture (a Batch API job over one document) run the tower over it once per tenant: the first to begin
    it encodes it, the others wait and read the encoder cache (with steps overlapped too, where the next step is
    planned before the tower's last piece runs); each gets transformers' tokens."""
    path, model, seed = qwen3_vl_checkpoint
    pic, prompts, expected, token_blocks = _one_picture(model, seed + 3, 4, 4)
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=96, block_size=4, max_num_batched_tokens=64,
              max_num_encoder_token_blocks=max(1, int(images_a_step * token_blocks)), encoder_cache_gb=0.001,
              overlap_scheduling=overlap)
    calls = _tower_calls(llm)
    tenants = [RequestPolicy(tenant=t, cache_salt=f"salt-of-{t}") for t in ("alice", "alice", "bob", "alice")]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, (prompt, policy) in enumerate(zip(prompts, tenants)):
        llm.engine.add_request(prompt, params, request_id=str(i), policy=policy, images=[pic])
    got = {str(i): [] for i in range(4)}
    steps = 0
    while llm.engine.has_unfinished():
        steps += 1
        for out in llm.engine.step():
            got[out.request_id] += out.token_ids
    assert [got[str(i)] for i in range(4)] == expected, f"seed={seed}"
    assert len(calls) == 2, f"one tower run per tenant, got {len(calls)} (seed={seed})"


def test_with_no_encoder_cache_requests_with_one_image_do_not_wait_for_each_other(qwen3_vl_checkpoint):
    """``encoder_cache_gb`` 0, layer-chunked with a budget of three images' towers a step: three requests sent at
    once with the same picture each run the tower over it in the first step (none waits for another's encoding,
    which it could not read back), and each gets transformers' tokens."""
    path, model, seed = qwen3_vl_checkpoint
    pic, prompts, expected, token_blocks = _one_picture(model, seed + 5, 3, 3)
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=96, block_size=4, max_num_batched_tokens=256,
              max_num_encoder_token_blocks=3 * token_blocks, encoder_cache_gb=0)
    assert llm.engine.scheduler.config.encoder_cache_keeps is False
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(prompt, params, request_id=str(i), images=[pic])
    got = {str(i): [] for i in range(3)}
    encoded_first_step = None
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            got[out.request_id] += out.token_ids
        if encoded_first_step is None:
            encoded_first_step = llm.engine.model.encoder_cache.misses
    assert [got[str(i)] for i in range(3)] == expected, f"seed={seed}"
    assert encoded_first_step == 3, f"seed={seed}"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_an_image_read_from_the_cache_is_not_evicted_by_a_piece_of_the_same_step(qwen3_vl_checkpoint, overlap):
    """Layer-chunked, an encoder cache that holds one image's features and not two: a request whose picture the
    cache holds (planned to read it: no tower work for it) and one whose picture of the same size is encoded in
    the same step. The second's features go in the cache before the forward reads the first's, evicting them: the
    first must still read its features, not run the whole tower inside the forward (past the step's budget)."""
    path, model, seed = qwen3_vl_checkpoint
    rng = random.Random(seed + 7)
    gen = torch.Generator().manual_seed(seed + 7)
    width, height = rng.randint(24, 40), rng.randint(24, 40)
    pics = [random_image(gen, width, height) for _ in range(2)]
    processed = [process_image(p, IMAGE_CONFIG) for p in pics]
    prompts = [with_images(rng, processed[:1]) for _ in range(2)] + [with_images(rng, processed[1:])]
    prompts.append(with_images(rng, processed[:1]))  # the first picture again, after other text: no prefix hit
    expected = [hf_greedy(model, p, im, 3) for p, im in zip(prompts, [processed[:1]] * 2 + [processed[1:]])]
    t, h, w = processed[0].grid_thw
    token_blocks = t * h * w * (1 + len(model.model.visual.blocks))
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=96, block_size=4, max_num_batched_tokens=256,
              max_num_encoder_token_blocks=2 * token_blocks, encoder_cache_gb=0.01, overlap_scheduling=overlap)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert _run(llm, prompts[0], pics[:1], RequestPolicy(), 3) == expected[0]
    one = llm.engine.model.encoder_cache.bytes_used
    llm.engine.model.encoder_cache = cache = EncoderCache(one * 3 // 2)  # one image's features, not two
    _run(llm, prompts[3], pics[:1], RequestPolicy(), 3)  # in the cache again
    assert len(cache) == 1
    calls = _tower_calls(llm)
    for i in (1, 2):
        llm.engine.add_request(prompts[i], params, request_id=str(i), images=pics[i - 1:i])
    got = {"1": [], "2": []}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            got[out.request_id] += out.token_ids
    assert [got["1"], got["2"]] == expected[1:], f"seed={seed}"
    assert len(calls) == 1, f"the tower ran {len(calls)} times, the second picture's only expected (seed={seed})"
