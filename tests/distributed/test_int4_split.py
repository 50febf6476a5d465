"""An INT4 (compressed-tensors pack-quantized) Kimi-K2 checkpoint split over 2 processes: each tensor-parallel rank
reads its half of every expert's intermediate size straight from the packed words and scale columns (32 channels a
rank: one scale group), and with expert parallelism whole packed experts; both generate exactly the single process's
greedy tokens (which tests/engine/loading/test_int4_experts.py checks against transformers)."""

import random

import pytest

from tests.distributed.test_engine_ranks import (MODES, check_each_way_generates_the_single_tokens,
                                                 generate_each_way)
from tests.engine.loading.int4_checkpoint import write_int4
from tests.hf_models import make_hf_model

VOCAB = 211


@pytest.mark.timeout(300)
def test_int4_split_engines_generate_the_single_process_tokens(tmp_path):
    seed = random.randrange(2**31)
    src, path = str(tmp_path / "src"), str(tmp_path / "int4")
    make_hf_model("deepseek_v3", src, seed=seed, vocab_size=VOCAB, moe_intermediate_size=64)
    write_int4(src, path, dict(model_type="kimi_k2",
                               auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"}))
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (17, 5, 9)]
    max_tokens = [6, 8, 5]
    runs = {"int4": (path, prompts, max_tokens, {"single": {}, **MODES})}
    check_each_way_generates_the_single_tokens("int4", generate_each_way(runs, {"int4": seed}, timeout_s=280)["int4"])
