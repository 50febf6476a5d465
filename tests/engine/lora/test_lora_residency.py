"""More adapters than device slots and host copies: five adapters over two slots and three host copies, mixed with
the base model, give each request transformers + PEFT's greedy tokens for its adapter (up to a near tie), while
slot evictions, host evictions, reads from disk and preemption happen (asserted); adapters added and removed while
serving; bad adapters refused with one line while the engine keeps serving."""

import functools
import os
import random

import pytest
import torch

from engine import LLM, RequestPolicy, SamplingParams
from engine.lora import reader_process
from tests.hf_models import make_hf_model
from tests.engine.lora.peft_reference import peft_greedy_tokens, peft_last_logits
from tests.greedy_ties import assert_greedy_equal_up_to_a_near_tie

peft = pytest.importorskip("peft")

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# PEFT serves several adapters side by side only when they target the same parameters: all adapt the experts.
ADAPTERS = {
    "ad1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS),
    "ad2": dict(r=2, lora_alpha=5, target_modules=["o_proj"], target_parameters=EXPERTS),
    "ad3": dict(r=3, lora_alpha=3, use_rslora=True, target_modules=["k_proj", "o_proj"], target_parameters=EXPERTS),
    "ad4": dict(r=4, lora_alpha=6, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=EXPERTS),
    "ad5": dict(r=1, lora_alpha=4, target_modules=["v_proj"], target_parameters=EXPERTS),  # added while serving
}
VOCAB = 211
MAX_NEW = 6


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The checkpoint, the adapters (and two unservable ones), the workload's waves and PEFT's tokens for each."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    tmp_path = tmp_path_factory.mktemp("residency")
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model_dir = str(tmp_path / "base")
    make_hf_model("qwen3_moe", model_dir, seed=seed, vocab_size=VOCAB)

    def save(name, **cfg):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        get_peft_model(model, LoraConfig(init_lora_weights=False, **cfg)).save_pretrained(str(tmp_path / name))
        return str(tmp_path / name)

    paths = {name: save(name, **cfg) for name, cfg in ADAPTERS.items()}
    paths["wide"] = save("wide", r=8, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS)
    paths["router"] = save("router", r=2, lora_alpha=4, target_modules=["gate"], target_parameters=EXPERTS)
    (tmp_path / "empty").mkdir()
    paths["empty"] = str(tmp_path / "empty")
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                    paths["ad1"], adapter_name="ad1")
    for name in list(ADAPTERS)[1:]:
        ref.load_adapter(paths[name], adapter_name=name)

    def prompt(n):
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    # ad1's prompt comes back in the last wave, after ad1 left its slot and host memory: read from disk again.
    again = prompt(13)
    waves = ([("ad1", again), (None, prompt(9)), ("ad2", prompt(12)), ("ad3", prompt(7)), ("ad4", prompt(10)),
              ("ad2", prompt(5)), (None, prompt(11)), ("ad3", prompt(14)), ("ad4", prompt(6)), ("ad1", prompt(8))],
             [("ad5", prompt(9)), ("ad4", prompt(7)), (None, prompt(6)), ("ad3", prompt(10)), ("ad5", prompt(12))],
             [("ad2", prompt(8)), ("ad1", again), ("ad3", prompt(9))])
    expected = [peft_greedy_tokens(ref, a, p, MAX_NEW) for a, p in sum(waves, [])]
    adapted_differs = any(want != peft_greedy_tokens(ref, None, p, MAX_NEW)
                          for (a, p), want in zip(sum(waves, []), expected) if a)
    return dict(seed=seed, model_dir=model_dir, paths=paths, prompt=prompt, waves=waves, expected=expected,
                adapted_differs=adapted_differs, ref=ref)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
def test_adapters_beyond_slots_match_transformers_peft(overlap, world):
    seed, model_dir, paths, prompt = world["seed"], world["model_dir"], world["paths"], world["prompt"]
    first, second, third = world["waves"]
    expected, max_new = world["expected"], MAX_NEW
    start = ",".join(f"{n}={paths[n]}" for n in ("ad1", "ad2", "ad3", "ad4"))
    llm = LLM(model=model_dir, dtype="float32", device="cpu", lora_adapters=start, max_loras=2, max_cpu_loras=3,
              max_lora_rank=4, num_kv_blocks=7, block_size=8, max_num_seqs=4, overlap_scheduling=overlap)
    engine = llm.engine
    assert engine.list_loras() == ["ad1", "ad2", "ad3", "ad4"]
    assert engine.stats().lora_host_evictions == 1  # four adapters read at start, three kept
    # More adapters than host copies: the reader process started at the start, before any read from disk.
    assert (engine.lora.reader_pid is not None) == reader_process.available()
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    outs: dict[str, object] = {}
    overlap_seen = 0  # steps where requests waited for a slot while others (base model or adapters) ran

    def add(wave):
        return [engine.add_request(p, params, policy=RequestPolicy(lora_adapter=a)) for a, p in wave]

    def drain():
        nonlocal overlap_seen
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id] = o if o.request_id not in outs else outs[o.request_id].merge(o)
            stats = engine.stats()
            overlap_seen += stats.lora_waiting_requests > 0 and stats.num_running > 0

    ids = add(first)
    drain()
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request(prompt(5), params, policy=RequestPolicy(lora_adapter="ad5"))
    engine.add_lora("ad5", paths["ad5"])
    engine.add_lora("ad5", paths["ad5"])  # the same name and path again: nothing happens
    ids += add(second)
    # Removed while its requests wait or run: they finish under it, new ones are refused.
    engine.add_request(prompt(4), params, request_id="last-ad4", policy=RequestPolicy(lora_adapter="ad4"))
    engine.remove_lora("ad4")
    assert "ad4" not in engine.list_loras()
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request(prompt(5), params, policy=RequestPolicy(lora_adapter="ad4"))
    drain()
    assert len(outs["last-ad4"].token_ids) == max_new
    misses = engine.stats().lora_host_misses
    ids += add(third)
    drain()
    assert engine.stats().lora_host_misses > misses, f"seed={seed}: ad1 should have been read from disk again"
    for i, (rid, (adapter, p)) in enumerate(zip(ids, first + second + third)):
        assert_greedy_equal_up_to_a_near_tie(functools.partial(peft_last_logits, world["ref"], adapter), p,
                                             outs[rid].token_ids, expected[i],
                                             f"seed={seed} request {i} adapter={adapter}")
    assert outs[ids[0]].token_ids == outs[ids[-2]].token_ids  # evicted, reloaded from disk: the same tokens

    stats = engine.stats()
    assert stats.lora_slot_evictions > 0, f"seed={seed}: five adapters over two slots evict"
    assert stats.lora_host_evictions > 1 and stats.lora_host_misses > 0, f"seed={seed}: no host eviction and reload"
    assert stats.lora_slot_loads >= 6 and stats.lora_host_hits > 0
    assert overlap_seen > 0, f"seed={seed}: requests waiting for a slot never ran beside others"
    assert engine.scheduler.num_preemptions > 0, f"seed={seed}: the small KV pool should have forced preemption"
    assert world["adapted_differs"]  # a base-model answer would have failed above for some adapter request

    # Bad adapters: one line each, nothing registered, the engine keeps serving.
    for name, path, why in (("bad", paths["empty"], "adapter_config.json"), ("wide", paths["wide"], "max_lora_rank"),
                            ("router", paths["router"], "not supported"), ("ad1", paths["ad2"], "registered with")):
        with pytest.raises(ValueError, match=why) as err:
            engine.add_lora(name, path)
        assert "\n" not in str(err.value)
    assert engine.list_loras() == ["ad1", "ad2", "ad3", "ad5"]
    with pytest.raises(ValueError, match="not registered"):
        engine.remove_lora("ad4")
    rid = engine.add_request(first[0][1], params, policy=RequestPolicy(lora_adapter="ad1"))
    drain()
    assert outs[rid].token_ids == expected[0]
    engine.scheduler.kv.pool.check_all_free()
    reader = engine.lora.reader_pid  # more adapters than host copies: reads from disk in a reader process
    assert reader is not None or not reader_process.available()
    engine.close()
    assert engine.lora.reader_pid is None
    if reader is not None:
        with pytest.raises(ChildProcessError):
            os.waitpid(reader, os.WNOHANG)  # reaped by close: no longer this process's child


def test_max_cpu_loras_default_and_bounds():
    from engine.core.config import EngineConfig

    assert EngineConfig(model="m", max_loras=3).cpu_loras == 3  # default: max_loras (as vLLM)
    assert EngineConfig(model="m", max_loras=3, max_cpu_loras=7).cpu_loras == 7
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(model="m", max_loras=3, max_cpu_loras=2)
