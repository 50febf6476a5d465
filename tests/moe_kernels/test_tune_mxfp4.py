"""``benchmarks.tune_moe --quantization mxfp4``: the candidates it times launch on its random MXFP4 weights and
compute what a float64 loop over the independently decoded weights (``test_mxfp4.decode64``) gives (the tile
kernels, the matrix-vector ones both ways, the swapped-operand ones with K split and not); the dry run
under the CPU interpreter writes the file ``launch_config`` looks up for MXFP4 weights.

Shapes stay tiny: without a GPU the kernels run in Triton's CPU interpreter (conftest.py).
"""

import json

import pytest
import torch
import torch.nn.functional as F

import moe_kernels
from benchmarks import tune_moe as tune
from moe_kernels.launch_config import ENV_CONFIG_DIR, config_path, load_config_file, quantization_name
from tests.moe_kernels.test_mxfp4 import decode64
from tests.moe_kernels.test_triton import DEVICE

T, E, K, H, I = 1, 4, 2, 64, 32  # noqa: E741 (one token: every path, gemv and unsorted included)


def _slot_refs(t: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (inter [S, I] from x, slot_out [S, H] from the tuner's inter) of the tuner's tensors ``t``."""
    w13, w2 = decode64(t["w13"], t["w13_scale"]), decode64(t["w2"], t["w2_scale"])  # [E, 2I, H], [E, H, I]
    ids = t["topk_ids"].reshape(-1).long().cpu()  # [S]
    x = t["x"].double().cpu()[torch.arange(ids.numel()) // K]  # [S, H]
    h = torch.einsum("snh,sh->sn", w13[ids], x)  # [S, 2I]
    inter = F.silu(h[:, :I]) * h[:, I:]
    slot_out = t["slot_weights"].double().cpu()[:, None] * torch.einsum("shi,si->sh", w2[ids], t["inter"].double().cpu())
    return inter, slot_out


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got.double().cpu() - want).norm() <= 1e-5 * want.norm())


def test_mxfp4_candidates_run_on_random_weights_and_match_float64():
    if "triton" not in moe_kernels.available_backends():
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    problem = tune.Problem(T, E, K, H, I, "float32", "mxfp4")
    t = tune._tensors(problem, DEVICE)
    assert t["w13"].dtype == t["w13_scale"].dtype == torch.uint8
    assert t["w13"].shape == (E, 2 * I, H // 2) and t["w2_scale"].shape == (E, H, I // 32)
    assert len(t["w13"].unique()) == 256, "every byte value drawn (8192 random bytes)"
    scales = torch.cat([t["w13_scale"].flatten(), t["w2_scale"].flatten()])
    assert len(scales.unique()) > 1 and 118 <= int(scales.min()) and int(scales.max()) <= 126
    space = tune.space_for(tune.INTERPRETER_SPACES, T)
    by_path: dict[tuple[str, int], dict[str, list]] = {}
    for mode, block_m, which, cfg in tune.candidates(problem, tune.INTERPRETER_SPACES, 1 << 30):
        assert cfg.BLOCK_K % 32 == 0
        by_path.setdefault((mode, block_m), {"w13": [], "w2": []})[which].append(cfg)
    assert {mode for mode, _ in by_path} == {"gemv", "sorted", "unsorted"}
    for (mode, _), cfgs in by_path.items():  # the grouped GEMMs' swapped-operand kernels, K split and not
        if mode != "gemv":
            assert {(c.SWAP, c.SPLIT_K) for c in cfgs["w13"]} == {(False, 1), (True, 1), (True, 2)}, mode
    assert set(by_path) == set(tune.row_tilings(problem, space))
    for (mode, block_m), cfgs in by_path.items():
        for cfg in cfgs["w13"]:
            t["inter"].fill_(float("nan"))
            tune._launcher(problem, t, mode, block_m, "w13")(cfg)
            inter, slot_out = _slot_refs(t)
            assert _close(t["inter"], inter), f"{mode} BLOCK_M={block_m} w13 {cfg}"
        for cfg in cfgs["w2"]:
            t["out"].fill_(float("nan"))
            t["slot_out"].fill_(float("nan"))
            tune._launcher(problem, t, mode, block_m, "w2")(cfg)
            if mode == "gemv":  # the sum over k inside the kernel
                assert _close(t["out"], slot_out.view(T, K, H).sum(1)), f"gemv w2 {cfg}"
            else:
                assert _close(t["slot_out"], slot_out), f"{mode} BLOCK_M={block_m} w2 {cfg}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels were compiled for the GPU, not interpreted")
def test_tune_mxfp4_dry_run_writes_the_file_mxfp4_weights_look_up(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = ["--E", "4", "--topk", "2", "--H", "64", "--I", "32", "--dtype", "float32", "--quantization", "mxfp4",
            "--tokens", "1,6", "--out", str(tmp_path)]
    assert tune.main(args) == 0
    (path,) = tmp_path.iterdir()
    monkeypatch.setenv(ENV_CONFIG_DIR, str(tmp_path))
    assert config_path(4, 64, 64, torch.float32, "cpu", quantization_name(torch.uint8)) == str(path)
    assert config_path(4, 64, 64, torch.float32, "cpu") != str(path)  # float weights do not take it
    configs = load_config_file(str(path))
    assert set(configs) == {1, 6}
    assert all(c.w13.BLOCK_K % 32 == 0 and c.w2.BLOCK_K % 32 == 0 for c in configs.values())
    assert json.loads(path.read_text())["quantization"] == "mxfp4"


def test_tune_mxfp4_refuses_dims_off_the_scale_groups(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune.main(["--E", "4", "--H", "48", "--I", "32", "--quantization", "mxfp4", "--out", "unused"])
    assert exit_info.value.code == 2 and "multiples of 32" in capsys.readouterr().err
