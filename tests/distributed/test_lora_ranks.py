"""LoRA adapters on an engine split over 2 processes (gloo, 1 thread each): a batch mixing the base model and three
adapters gives, with tensor parallelism and with the experts divided among the ranks, exactly the single process's
greedy tokens, and those are transformers + PEFT's (up to a near tie). Qwen3-MoE: one KV head replicated on both
ranks, adapters on q/k/v/o and the routed experts, the all-to-all dispatch; Qwen2-MoE: a shared expert and a dense
layer, adapters on their gate/up/down too, the all-gather dispatch. Splits that do not serve adapters yet are refused
with one line."""


import functools

import pytest
import torch

from tests.distributed.ranks import run_ranks_each
from tests.distributed.test_tensor_parallel import VOCAB, family_checkpoints
from tests.engine.lora.peft_reference import peft_greedy_tokens, peft_last_logits
from tests.greedy_ties import assert_greedy_equal_up_to_a_near_tie

peft = pytest.importorskip("peft")

FAMILIES = ("qwen3_moe", "qwen2_moe")
ENGINE = dict(device="cpu", cpu_threads=1, dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=16,
              max_num_seqs=4, overlap_scheduling=False, max_loras=3, max_lora_rank=4)
MODES = {
    "single": {},
    "tp": dict(tensor_parallel_size=2),
    "ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "ep_gather": dict(tensor_parallel_size=2, enable_expert_parallel=True, expert_dispatch="all_gather"),
    # One slot and one host copy for three adapters: slot writes, and reads from disk on both ranks while serving
    "tp_one_slot": dict(tensor_parallel_size=2, max_loras=1),
}


def _generate_each_way(rank: int, world: int, address: str, model_dir: str, paths: str, reqs, max_new: int,
                       modes: dict):
    from engine import LLM, RequestPolicy, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    results = {}
    for name, extra in modes.items():
        llm = LLM(model_dir, lora_adapters=paths, **{**ENGINE, **extra})
        engine = llm.engine
        try:
            ids = [engine.add_request(p, params, policy=RequestPolicy(lora_adapter=a)) for a, p in reqs]
            outs = {}
            while engine.has_unfinished():
                for o in engine.step():
                    outs[o.request_id] = o if o.request_id not in outs else outs[o.request_id].merge(o)
            stats = engine.stats()
            results[name] = ([list(outs[rid].token_ids) for rid in ids],
                             (stats.lora_slot_evictions, stats.lora_host_misses, stats.lora_sync_reads))
        finally:
            engine.close()
    return results


@pytest.mark.timeout(400)
def test_split_engines_serve_adapters_as_one_process_and_peft(tmp_path_factory):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.engine.lora.test_lora_engine import FAMILY_ADAPTERS

    runs, expected, seeds, refs = {}, {}, {}, {}
    for family, (seed, model_dir, _, rng) in family_checkpoints(tmp_path_factory, "lora", FAMILIES).items():
        seeds[family] = seed
        torch.manual_seed(seed)
        adapters = FAMILY_ADAPTERS[family]
        for name, cfg in adapters.items():  # random non-zero A and B (init_lora_weights=False)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            get_peft_model(model, LoraConfig(init_lora_weights=False, **cfg)).save_pretrained(f"{model_dir}-{name}")
        ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                        f"{model_dir}-ad1", adapter_name="ad1")
        for name in ("ad2", "ad3"):
            ref.load_adapter(f"{model_dir}-{name}", adapter_name=name)
        refs[family] = ref
        prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (19, 5, 11, 2, 14, 7)]
        reqs = list(zip((None, "ad1", "ad2", "ad3", "ad1", "ad3"), prompts))
        max_new = 6
        expected[family] = [peft_greedy_tokens(ref, a, p, max_new) for a, p in reqs]
        # The adapters matter: some adapter request's answer differs from the base model's.
        assert any(want != peft_greedy_tokens(ref, None, p, max_new) for (a, p), want in zip(reqs, expected[family]) if a)
        paths = ",".join(f"{name}={model_dir}-{name}" for name in adapters)
        # Each dispatch on one family: all-to-all on Qwen3-MoE, all-gather beside the shared expert and dense layer.
        modes = {m: extra for m, extra in MODES.items()
                 if m not in (("ep", "tp_one_slot") if family == "qwen2_moe" else ("ep_gather",))}
        runs[family] = (model_dir, paths, reqs, max_new, modes)
    results = run_ranks_each(_generate_each_way, 1, runs, timeout_s=360)
    for family in FAMILIES:
        status, value = results[family].get(0, ("missing", None))
        assert status == "ok", f"family={family} seed={seeds[family]}: {value}"
        assert set(value) == set(runs[family][4])
        for mode, (tokens, _) in value.items():
            assert len(tokens) == len(expected[family]), mode
            for (adapter, prompt), got, want in zip(runs[family][2], tokens, expected[family]):
                assert_greedy_equal_up_to_a_near_tie(
                    functools.partial(peft_last_logits, refs[family], adapter), prompt, got, want,
                    f"{mode} differs from transformers + PEFT (family={family} seed={seeds[family]} adapter={adapter})")
    evictions, misses, sync_reads = results["qwen3_moe"][0][1]["tp_one_slot"][1]
    assert evictions > 0 and misses > 0 and sync_reads == 0, (evictions, misses, sync_reads)


@pytest.mark.parametrize("split, needs", [
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size 1"),
    (dict(data_parallel_size=2), "data_parallel_size 1"),
    (dict(role="prefill"), "role 'both'"),
    (dict(tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True), "enable_eplb off"),
])
def test_adapters_on_splits_not_served_are_refused_with_one_line(split, needs):
    from engine.core.config import EngineConfig

    with pytest.raises(ValueError, match=f"^lora_adapters are served with {needs}") as e:
        EngineConfig(model="m", lora_adapters="a=/adapters/a", **split)
    assert "\n" not in str(e.value)
    EngineConfig(model="m", lora_adapters="a=/adapters/a", tensor_parallel_size=2, enable_expert_parallel=True)
