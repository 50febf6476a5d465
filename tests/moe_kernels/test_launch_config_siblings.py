"""Launch-config lookup across sibling cards (``moe_kernels.launch_config.SAME_CHIP``), over the shipped files: a
card's own tuned file first, then a sibling's on the same die, then the untuned defaults."""

from pathlib import Path

import torch

from moe_kernels.launch_config import CONFIG_DIR, config_path


def _name(path: str) -> str:
    assert Path(path).parent == CONFIG_DIR
    return Path(path).name


def test_a_card_without_its_own_file_reads_its_siblings():
    # Qwen3-30B-A3B's expert shape is tuned on the H100 only: the H200 reads that file, not the defaults.
    got = _name(config_path(128, 1536, 2048, torch.bfloat16, "NVIDIA H200"))
    assert got == "E=128,N=1536,K=2048,dtype=bfloat16,device=NVIDIA_H100_80GB_HBM3.json"


def test_a_cards_own_file_comes_before_its_siblings():
    # gpt-oss-20b's expert shape has H200 files (bf16 and MXFP4) and no H100 one.
    assert _name(config_path(32, 5760, 2880, torch.bfloat16, "NVIDIA H200")) == \
        "E=32,N=5760,K=2880,dtype=bfloat16,device=NVIDIA_H200.json"
    assert _name(config_path(32, 5760, 2880, torch.bfloat16, "NVIDIA H200", "mxfp4")) == \
        "E=32,N=5760,K=2880,dtype=bfloat16,quantization=mxfp4,device=NVIDIA_H200.json"
    # ... and the H100, the H200's sibling, reads the H200's tuned file before the defaults
    assert _name(config_path(32, 5760, 2880, torch.bfloat16, "NVIDIA H100 80GB HBM3")) == \
        "E=32,N=5760,K=2880,dtype=bfloat16,device=NVIDIA_H200.json"


def test_a_card_with_no_sibling_takes_the_defaults():
    assert _name(config_path(128, 1536, 2048, torch.bfloat16, "NVIDIA A100-SXM4-80GB")) == "default.json"
