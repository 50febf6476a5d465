"""An adapter name removed and added again, from another directory or the same one, while a request under the
earlier registration still runs: the running request finishes with transformers + PEFT's tokens for the weights it
started under, requests added after get the new directory's tokens, on the same prompt (whose blocks the old
request cached: a prefix hit across the two would serve the old weights' KV). With one slot the new registration
waits for the old one's request; with two they run side by side."""

import functools
import random

import pytest
import torch

from engine import LLM, RequestPolicy, SamplingParams
from engine.lora import reader_process
from tests.engine.lora.peft_reference import peft_greedy_tokens, peft_last_logits, save_random_adapters
from tests.greedy_ties import assert_greedy_equal_up_to_a_near_tie
from tests.hf_models import make_hf_model

peft = pytest.importorskip("peft")

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# PEFT serves several adapters side by side only when they target the same parameters.
TARGETS = dict(target_modules=["q_proj", "v_proj", "o_proj"], target_parameters=EXPERTS)
VOCAB = 211


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The checkpoint, two adapters of different ranks and weights, a prompt of three full blocks and PEFT's tokens."""
    tmp = tmp_path_factory.mktemp("reload")
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model_dir = str(tmp / "base")
    make_hf_model("qwen3_moe", model_dir, seed=seed, vocab_size=VOCAB)
    paths, ref = save_random_adapters(model_dir, tmp, {"old": 2, "new": 4}, TARGETS)
    prompt = [rng.randrange(1, VOCAB) for _ in range(3 * 8 + rng.randrange(1, 8))]
    max_new = 10
    want = {name: peft_greedy_tokens(ref, name, prompt, max_new) for name in ("old", "new")}
    assert want["old"] != want["new"], f"seed={seed}: the two adapters must give different tokens"
    return dict(seed=seed, model_dir=model_dir, paths=paths, prompt=prompt, max_new=max_new, want=want, ref=ref)


def _drain(engine, outs: dict) -> None:
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o if o.request_id not in outs else outs[o.request_id].merge(o)


def _step_until_decoding(engine, request_id: str, outs: dict) -> None:
    """Step until ``request_id`` has produced a token: its prompt's blocks are computed and cached."""
    for _ in range(50):
        for o in engine.step():
            outs[o.request_id] = o if o.request_id not in outs else outs[o.request_id].merge(o)
        if outs.get(request_id) is not None and outs[request_id].token_ids:
            return
    raise AssertionError(f"request {request_id} never produced a token")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("max_loras", [1, 2])
def test_name_added_again_serves_the_new_directory_while_the_old_finishes(world, max_loras):
    seed, paths, prompt, max_new, want = (world[k] for k in ("seed", "paths", "prompt", "max_new", "want"))
    llm = LLM(model=world["model_dir"], dtype="float32", device="cpu", lora_adapters=f"x={paths['old']}",
              max_loras=max_loras, max_lora_rank=4, num_kv_blocks=32, block_size=8, max_num_seqs=4,
              overlap_scheduling=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    x = RequestPolicy(lora_adapter="x")
    outs: dict[str, object] = {}

    # Another directory under the name, while a request under the first one decodes.
    engine.add_request(prompt, params, request_id="old", policy=x)
    _step_until_decoding(engine, "old", outs)
    engine.remove_lora("x")
    engine.add_lora("x", paths["new"])
    assert engine.list_loras() == ["x"]
    engine.add_request(prompt, params, request_id="new", policy=x)
    assert len(outs["old"].token_ids) < max_new, "the old request must still run when the name is added again"
    _drain(engine, outs)
    msg = f"seed={seed} max_loras={max_loras}"

    def served(rid: str, adapter: str) -> None:  # PEFT's tokens under that directory's adapter, up to a near tie
        assert_greedy_equal_up_to_a_near_tie(functools.partial(peft_last_logits, world["ref"], adapter), prompt,
                                             outs[rid].token_ids, want[adapter], f"{msg} request {rid}")

    served("old", "old")
    served("new", "new")

    # The same directory again, while a request under the current registration decodes.
    engine.add_request(prompt, params, request_id="before", policy=x)
    _step_until_decoding(engine, "before", outs)
    engine.remove_lora("x")
    assert engine.list_loras() == []
    engine.add_lora("x", paths["new"])
    engine.add_request(prompt, params, request_id="after", policy=x)
    _drain(engine, outs)
    served("before", "new")
    served("after", "new")

    # Back to the first directory once nothing runs under the name.
    engine.remove_lora("x")
    engine.add_lora("x", paths["old"])
    engine.add_request(prompt, params, request_id="again", policy=x)
    _drain(engine, outs)
    served("again", "old")

    with pytest.raises(ValueError, match="registered with"):  # a name registered now keeps its directory
        engine.add_lora("x", paths["new"])
    stats = engine.stats()
    assert stats.lora_registered == 1 and stats.lora_resident <= max_loras, msg
    engine.scheduler.kv.pool.check_all_free()

    # The reader process starts once more adapters are registered than host copies (max_loras here), counting
    # registered names: one name at a time under ever new names, nothing is read back from disk and none starts.
    assert stats.lora_host_misses == 0, msg
    previous = "x"
    for i in range(max_loras + 1):
        engine.remove_lora(previous)
        previous = f"y{i}"
        engine.add_lora(previous, paths["new" if i % 2 else "old"])
        assert engine.lora.reader_pid is None, msg
    for i in range(max_loras):
        engine.add_lora(f"z{i}", paths["old"])
    assert (engine.lora.reader_pid is not None) == reader_process.available(), msg
    engine.close()
