"""Run the Triton kernels in Triton's CPU interpreter when there is no GPU.

TRITON_INTERPRET must be set before any module defining a Triton kernel is first
imported (``triton.jit`` chooses compiled or interpreted at decoration), so it
is set here, before pytest collects any test module: then no order of test
files can import a kernel first. Only without CUDA: with a GPU the same tests run
the compiled kernels. The torch tests never look at it; on a CPU-only machine
nothing else can run Triton, so the rest of the suite is unaffected.

Fixtures for several test directories: ``qwen3_vl_checkpoint``, ``qwen3_5_vl_checkpoint``.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def qwen3_vl_checkpoint(tmp_path_factory):
    """(path, transformers' model, seed): the tiny random Qwen3-VL-MoE of ``tests.engine.vision.qwen3_vl_checkpoint``
    with its ``preprocessor_config.json``, built once for every test file of the session that reads it. Tests only
    read it: one that needs more files beside the weights (a tokenizer) copies it first."""
    from tests.engine.vision.qwen3_vl_checkpoint import make_qwen3_vl_moe, write_preprocessor_config

    seed = random.randrange(2**31)
    path = str(tmp_path_factory.mktemp("qwen3_vl_moe"))
    model = make_qwen3_vl_moe(path, seed)
    write_preprocessor_config(path)
    return path, model, seed


@pytest.fixture(scope="session")
def qwen3_5_vl_checkpoint(tmp_path_factory):
    """(path, transformers' model, tokenizer, seed): the tiny random Qwen3.5-MoE image-text checkpoint of
    ``tests.engine.vision.qwen3_5_vl_checkpoint``, with its preprocessor config and tokenizer, built once for every
    test file of the session that reads it (tests only read it)."""
    from tests.engine.vision.qwen3_5_vl_checkpoint import make_qwen3_5_moe_vl

    seed = random.randrange(2**31)
    path = str(tmp_path_factory.mktemp("qwen3_5_moe_vl"))
    model, tok = make_qwen3_5_moe_vl(path, seed)
    return path, model, tok, seed
