"""An adapter whose directory goes bad after it was added (its weights no longer finite) fails only the requests
that need it, the next time the engine reads it from disk: they end with finish_reason 'error' and a reason naming
the adapter and the tensor, the engine's other requests (base model and another adapter, in the same steps) keep
transformers + PEFT's tokens, and once the file is mended the adapter is served again. Files replaced by other
sound weights while serving fail its requests the same way (they are not the adapter that was added), until the
added files are back."""

import asyncio
import functools
import random
import shutil
import time

import pytest
import torch

from engine import LLM, RequestPolicy, SamplingParams
from engine.core.config import EngineConfig
from engine.serving.async_engine import AsyncEngine, RequestRejectedError
from tests.engine.lora.peft_reference import peft_greedy_tokens, peft_last_logits, save_random_adapters
from tests.greedy_ties import assert_greedy_equal_up_to_a_near_tie
from tests.hf_models import make_hf_model

peft = pytest.importorskip("peft")

TARGETS = dict(target_modules=["q_proj", "v_proj", "o_proj"],
               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
VOCAB = 211


def _run(engine, requests: dict[str, tuple[list[int], RequestPolicy]], max_new: int, limit_s: float = 60.0) -> dict:
    """Run ``requests`` (id -> prompt, policy) together to the end; their merged outputs. Fails past ``limit_s``."""
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    for rid, (prompt, policy) in requests.items():
        engine.add_request(prompt, params, request_id=rid, policy=policy)
    outs: dict = {}
    deadline = time.monotonic() + limit_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline, f"requests still unfinished after {limit_s} s: {engine.scheduler.requests}"
        for o in engine.step():
            outs[o.request_id] = o if o.request_id not in outs else outs[o.request_id].merge(o)
    return outs


@pytest.mark.timeout(300)
def test_adapter_spoiled_on_disk_fails_its_requests_alone(tmp_path):
    from safetensors.torch import load_file, save_file

    seed = random.randrange(2**31)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model_dir = str(tmp_path / "base")
    make_hf_model("qwen3_moe", model_dir, seed=seed, vocab_size=VOCAB)
    paths, ref = save_random_adapters(model_dir, tmp_path, {"a": 2, "b": 2}, TARGETS)
    prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(9, 20))]
    max_new = 8

    # One device slot and one host copy: "b" used after "a" pushes "a" out of both, so "a" is read again from disk.
    llm = LLM(model=model_dir, dtype="float32", device="cpu", lora_adapters=f"a={paths['a']},b={paths['b']}",
              max_loras=1, max_cpu_loras=1, max_lora_rank=2, num_kv_blocks=32, block_size=8, max_num_seqs=4,
              overlap_scheduling=False)
    engine = llm.engine
    adapter = {name: RequestPolicy(lora_adapter=name) for name in ("a", "b")}
    _run(engine, {"warm-b": (prompt, adapter["b"])}, 2)

    weights = f"{paths['a']}/adapter_model.safetensors"
    shutil.copy(weights, tmp_path / "a-sound.safetensors")
    tensors = load_file(weights)
    key = rng.choice(sorted(k for k in tensors if ".lora_B." in k))
    tensors[key].view(-1)[rng.randrange(tensors[key].numel())] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})

    outs = _run(engine, {"spoiled": (prompt, adapter["a"]), "base": (prompt, RequestPolicy()),
                         "other": (prompt, adapter["b"])}, max_new)
    failed = outs["spoiled"]
    assert failed.finished and failed.finish_reason == "error" and failed.token_ids == [], failed
    assert "'a'" in failed.stop_reason and key in failed.stop_reason and "\n" not in failed.stop_reason
    assert engine.take_rejected() == {"spoiled": failed.stop_reason} and engine.take_rejected() == {}
    for rid, name in (("base", None), ("other", "b")):
        assert_greedy_equal_up_to_a_near_tie(functools.partial(peft_last_logits, ref, name), prompt,
                                             outs[rid].token_ids, peft_greedy_tokens(ref, name, prompt, max_new),
                                             f"seed={seed} request {rid}")

    shutil.copy(tmp_path / "a-sound.safetensors", weights)  # mended: the next request reads it again
    mended = _run(engine, {"mended": (prompt, adapter["a"])}, max_new)["mended"]
    assert_greedy_equal_up_to_a_near_tie(functools.partial(peft_last_logits, ref, "a"), prompt, mended.token_ids,
                                         peft_greedy_tokens(ref, "a", prompt, max_new), f"seed={seed} mended")

    # Other sound weights written over "a"'s files while serving ("b"'s: the same targets and rank). "b" pushes "a"
    # out of the slot and the host copy again, so "a" is read from disk: its files no longer match the digest it
    # was registered (and its cached blocks keyed) under, and serving them as "a" would mix two adapters.
    _run(engine, {"warm-b2": (prompt, adapter["b"])}, 2)
    shutil.copy(f"{paths['b']}/adapter_model.safetensors", weights)
    outs = _run(engine, {"replaced": (prompt, adapter["a"]), "base2": (prompt, RequestPolicy())}, max_new)
    failed = outs["replaced"]
    assert failed.finished and failed.finish_reason == "error" and failed.token_ids == [], failed
    assert "'a'" in failed.stop_reason and "changed since it was added" in failed.stop_reason, failed.stop_reason
    assert engine.take_rejected() == {"replaced": failed.stop_reason}
    assert_greedy_equal_up_to_a_near_tie(functools.partial(peft_last_logits, ref, None), prompt,
                                         outs["base2"].token_ids, peft_greedy_tokens(ref, None, prompt, max_new),
                                         f"seed={seed} request base2")
    shutil.copy(tmp_path / "a-sound.safetensors", weights)  # its registered files back: served again
    again = _run(engine, {"again": (prompt, adapter["a"])}, max_new)["again"]
    assert_greedy_equal_up_to_a_near_tie(functools.partial(peft_last_logits, ref, "a"), prompt, again.token_ids,
                                         peft_greedy_tokens(ref, "a", prompt, max_new), f"seed={seed} again")
    engine.scheduler.kv.pool.check_all_free()
    engine.close()

    # The engine process refuses such a request (param "model"), the gateway's 400; the base request beside it runs.
    config = EngineConfig(model=model_dir, dtype="float32", device="cpu", lora_adapters=f"a={paths['a']},b={paths['b']}",
                          max_loras=1, max_cpu_loras=1, max_lora_rank=2, num_kv_blocks=32, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)

    async def scenario():
        served = AsyncEngine(config)
        await served.start()  # reads "a", then "b", which takes the one host copy
        save_file(tensors, weights, metadata={"format": "pt"})
        try:
            base = asyncio.ensure_future(_collect(served.generate(prompt, params, "base", RequestPolicy())))
            with pytest.raises(RequestRejectedError) as refused:
                [o async for o in served.generate(prompt, params, "spoiled", adapter["a"])]
            return refused.value, await asyncio.wait_for(base, 60)
        finally:
            await served.shutdown()

    refused, base = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert (refused.param, refused.code) == ("model", "adapter_unavailable") and key in str(refused), refused
    assert_greedy_equal_up_to_a_near_tie(functools.partial(peft_last_logits, ref, None), prompt, base,
                                         peft_greedy_tokens(ref, None, prompt, max_new), f"seed={seed} served base")


async def _collect(stream) -> list[int]:
    return [t async for o in stream for t in o.token_ids]
