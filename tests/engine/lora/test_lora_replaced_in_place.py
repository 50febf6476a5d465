"""An adapter whose files are replaced in place (the same name, the same directory, new weights) between two runs
of an engine with a disk prefix-cache tier: after the restart it is served with transformers + PEFT's tokens for
the new weights, never from the blocks the old weights computed; unchanged, it is served from them."""

import functools
import os
import random
import shutil

import pytest
import torch

from engine import LLM, RequestPolicy, SamplingParams
from tests.engine.helpers import complete
from tests.engine.lora.peft_reference import peft_greedy_tokens, peft_last_logits
from tests.greedy_ties import assert_greedy_equal_up_to_a_near_tie
from tests.hf_models import make_hf_model

peft = pytest.importorskip("peft")

VOCAB, BLOCK = 211, 8
TARGETS = dict(target_modules=["q_proj", "v_proj", "o_proj"], target_parameters=["mlp.experts.gate_up_proj"])


@pytest.mark.timeout(600)
def test_adapter_replaced_in_place_is_not_served_from_the_old_weights_blocks(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model_dir, served, disk = str(tmp_path / "base"), str(tmp_path / "served"), str(tmp_path / "disk")
    make_hf_model("qwen3_moe", model_dir, seed=seed, vocab_size=VOCAB)
    versions = {}
    for version in ("old", "new"):  # the same config, other random weights
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        get_peft_model(model, LoraConfig(init_lora_weights=False, r=2, lora_alpha=4, **TARGETS)).save_pretrained(
            str(tmp_path / version))
        versions[version] = str(tmp_path / version)
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                    versions["old"], adapter_name="old")
    ref.load_adapter(versions["new"], adapter_name="new")
    prompt = [rng.randrange(1, VOCAB) for _ in range(4 * BLOCK + 3)]
    fillers = [[rng.randrange(1, VOCAB) for _ in range(5 * BLOCK)] for _ in range(3)]
    want = {v: peft_greedy_tokens(ref, v, prompt, 8) for v in versions}
    assert want["old"] != want["new"], f"seed={seed}: the two versions must give different tokens"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    x = RequestPolicy(tenant="acme", cache_salt="acme", lora_adapter="x")

    def run(version_on_disk: str, flush: bool):
        """A fresh engine serving ``x`` from ``served``; the prompt's output (and its blocks pushed to disk)."""
        llm = LLM(model=model_dir, dtype="float32", device="cpu", lora_adapters=f"x={served}", max_lora_rank=2,
                  num_kv_blocks=12, block_size=BLOCK, host_cache_gb=0.002, disk_cache_dir=disk, disk_cache_gb=0.01)
        engine = llm.engine
        try:
            out = complete(engine, prompt, params, x)
            if flush:  # 5 blocks each through a 12-block pool: the prompt's blocks go to host, then disk
                for filler in fillers:
                    complete(engine, filler, params, x)
                engine.tiers.flush()
            assert_greedy_equal_up_to_a_near_tie(functools.partial(peft_last_logits, ref, version_on_disk), prompt,
                                                 out.token_ids, want[version_on_disk], f"seed={seed}")
            return out
        finally:
            engine.close()

    shutil.copytree(versions["old"], served)
    assert run("old", flush=True).num_cached_tokens == 0
    assert run("old", flush=False).num_cached_tokens == 4 * BLOCK  # a restart: the disk tier serves it
    for name in os.listdir(versions["new"]):  # new weights written over the old files, in place
        shutil.copyfile(os.path.join(versions["new"], name), os.path.join(served, name))
    assert run("new", flush=False).num_cached_tokens == 0, f"seed={seed}: served from the old weights' blocks"

