"""The Triton backend against the torch reference and a plain float64 loop; alignment; launch configs.

Without a GPU the kernels run in Triton's CPU interpreter (conftest.py sets
TRITON_INTERPRET=1), which is slow: shapes stay tiny. Inputs are fresh random
each run; the seed is in every assertion message (MOE_TEST_SEED=<n> replays one).

float32 tolerance 1e-5 assumes no tf32: the CPU interpreter multiplies in
IEEE float32, and on a GPU the kernels pass input_precision="ieee" for float32.
"""

import json
import math
import os
import random

import pytest
import torch
import torch.nn.functional as F

import moe_kernels
from benchmarks import moe_backends as bench, tune_moe as tune
from moe_kernels.align import align_slots, max_padded_slots, unsorted_slots
from moe_kernels.launch_config import (
    ENV_CONFIG_DIR, GemmConfig, LaunchConfig, config_file_name, get_launch_config, load_config_file, nearest_entry,
)
from moe_kernels.triton_backend import fused_moe_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("MOE_TEST_SEED") or random.SystemRandom().randrange(2**31))


def cfg(align: bool = True, block_m: int = 16, block_n: int = 32, block_k: int = 32, group_m: int = 2,
        gemv: bool = False, planes: bool = False, swap: bool = False, split_k: int = 1) -> LaunchConfig:
    gemm = GemmConfig(block_n, block_k, group_m, num_warps=4, num_stages=2, PLANES=planes, SWAP=swap,
                      SPLIT_K=split_k)
    return LaunchConfig(align, block_m, gemm, gemm, gemv)


def make_inputs(seed, T, E, k, H, I, dtype, ids=None):  # noqa: E741
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] f32, topk_ids [T, k] i32 on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    weights, topk_ids = moe_kernels.route(torch.randn(T, E, generator=gen), k, renormalize=True)
    if ids is not None:
        topk_ids = torch.as_tensor(ids, dtype=torch.int32).expand(T, k).contiguous()
        weights = torch.rand(T, k, generator=gen)
    to = dict(device=DEVICE, dtype=dtype)
    return x.to(**to), w13.to(**to), w2.to(**to), weights.to(DEVICE), topk_ids.to(DEVICE)


def moe_float64_loop(x, w13, w2, topk_weights, topk_ids, activation="silu"):
    act = F.silu if activation == "silu" else F.gelu
    x, w13, w2, tw = x.double().cpu(), w13.double().cpu(), w2.double().cpu(), topk_weights.double().cpu()
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w13[e] @ x[t]
            out[t] += tw[t, j] * (w2[e] @ (act(h[:inter]) * h[inter:]))
    return out


def run_poisoned(x, w13, w2, weights, ids, config=None, activation="silu"):
    """fused_moe_triton with every buffer it writes pre-filled with NaN: an unwritten element shows."""
    num_slots, hidden, inter = ids.numel(), x.shape[1], w2.shape[2]
    nan = dict(fill_value=float("nan"), dtype=x.dtype, device=x.device)
    bufs = dict(inter=torch.full((num_slots, inter), **nan), slot_out=torch.full((num_slots, hidden), **nan),
                out=torch.full((x.shape[0], hidden), **nan))
    out = fused_moe_triton(x, w13, w2, weights, ids, activation, config=config, **bufs)
    assert out.data_ptr() == bufs["out"].data_ptr() and out.dtype == x.dtype and out.shape == x.shape
    assert not bufs["inter"].isnan().any(), "kernel 1 left elements unwritten"
    if not (config is not None and config.gemv):  # the matrix-vector path sums over k without slot_out
        assert not bufs["slot_out"].isnan().any(), "kernel 2 left elements unwritten"
    return out


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


def check(seed, inputs, config=None, activation="silu"):
    x, w13, w2, weights, ids = inputs
    out = run_poisoned(x, w13, w2, weights, ids, config, activation)
    tol = TOLERANCE[x.dtype]
    torch_ref = moe_kernels.fused_moe(x, w13, w2, weights, ids, backend="torch", activation=activation)
    loop_ref = moe_float64_loop(x, w13, w2, weights, ids, activation)
    for name, ref in (("torch backend", torch_ref), ("float64 loop", loop_ref)):
        err = rel_err(out, ref)
        assert err < tol, f"seed={seed} {x.dtype} config={config}: relative error {err:.2e} vs {name} (tolerance {tol})"
    return out


# id: (T, E, k, H, I, dtype, config); H and I often not multiples of the tiles.
CASES = {
    "T1-default-f32": (1, 8, 2, 64, 32, torch.float32, None),  # default config: the path without alignment
    "T1-aligned-bf16": (1, 8, 2, 64, 32, torch.bfloat16, cfg(True, 16)),
    "T37-bm16-f32": (37, 8, 2, 48, 40, torch.float32, cfg(True, 16)),
    "T37-bm32-bf16": (37, 8, 2, 48, 40, torch.bfloat16, cfg(True, 32, 16, 16)),
    "T37-bm64-f16": (37, 8, 2, 48, 40, torch.float16, cfg(True, 64, 64, 64, group_m=1)),
    "T3-unaligned-bf16": (3, 8, 2, 32, 24, torch.bfloat16, cfg(False, 16)),
    "k1-T20-f32": (20, 8, 1, 32, 16, torch.float32, cfg(True, 16)),
    "k1-T20-bf16-default": (20, 8, 1, 32, 16, torch.bfloat16, None),
    "k8-E8-T5-f32": (5, 8, 8, 32, 16, torch.float32, cfg(True, 16)),
    "k8-E128-T6-f32": (6, 128, 8, 32, 16, torch.float32, cfg(True, 16)),  # most experts get nothing
    "k8-E128-T4-bf16-default": (4, 128, 8, 32, 32, torch.bfloat16, None),
    "k8-E128-T1-bf16-default": (1, 128, 8, 32, 32, torch.bfloat16, None),
    # The matrix-vector path: K not a multiple of BLOCK_K, N past the last tile, k=1 and k=8.
    "gemv-T1-f32": (1, 8, 2, 48, 40, torch.float32, cfg(block_n=16, block_k=32, gemv=True)),
    "gemv-T3-bf16": (3, 8, 2, 64, 32, torch.bfloat16, cfg(block_n=32, block_k=16, gemv=True)),
    "gemv-k8-E128-T2-f32": (2, 128, 8, 32, 24, torch.float32, cfg(block_n=16, block_k=16, gemv=True)),
    "gemv-k1-T4-f16": (4, 8, 1, 40, 16, torch.float16, cfg(block_n=16, block_k=32, gemv=True)),
    "gemv-bn8-T2-bf16": (2, 8, 2, 48, 40, torch.bfloat16, cfg(block_n=8, block_k=32, gemv=True)),  # no tl.dot
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_references(case, seed):
    T, E, k, H, I, dtype, config = CASES[case]  # noqa: E741
    check(seed, make_inputs(seed, T, E, k, H, I, dtype), config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,ids", [(1, [3]), (2, [5, 3])], ids=["k1", "k2"])
def test_all_tokens_on_the_same_experts(dtype, k, ids, seed):
    # 21 slots on one expert: two blocks of 16 for it, nothing for the others.
    check(seed, make_inputs(seed, 21, 8, k, 32, 16, dtype, ids=ids), cfg(True, 16))


def test_experts_without_tokens_and_gelu(seed):
    x, w13, w2, weights, ids = make_inputs(seed, 7, 16, 2, 32, 24, torch.float32)
    ids = torch.where(torch.arange(7, device=DEVICE)[:, None] % 2 == 0, ids.new_tensor([2, 9]), ids.new_tensor([9, 2]))
    check(seed, (x, w13, w2, weights, ids), cfg(True, 16), activation="gelu")


def test_strided_inputs_and_float32_default(seed):
    x, w13, w2, weights, ids = make_inputs(seed, 17, 8, 2, 32, 16, torch.float32)
    wide = torch.randn(17, 80, device=DEVICE)
    wide[:, 8:40] = x
    check(seed, (wide[:, 8:40], w13, w2, weights, ids))  # x with row stride 80


def test_dispatch_selects_triton(seed):
    x, w13, w2, weights, ids = make_inputs(seed, 9, 8, 2, 32, 16, torch.float32)
    assert "triton" in moe_kernels.available_backends()
    via_dispatch = moe_kernels.fused_moe(x, w13, w2, weights, ids, backend="triton")
    assert torch.equal(via_dispatch, fused_moe_triton(x, w13, w2, weights, ids)), f"seed={seed}"
    assert moe_kernels.fused_moe(x[:0], w13, w2, weights[:0], ids[:0], backend="triton").shape == (0, 32)


def test_rejects_mismatched_dtypes():
    x, w13, w2, weights, ids = make_inputs(0, 2, 4, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe_triton(x, w13.bfloat16(), w2, weights, ids)
    with pytest.raises(ValueError, match="activation"):
        fused_moe_triton(x, w13, w2, weights, ids, activation="relu")


# --- alignment on its own ------------------------------------------------------------------------


@pytest.mark.parametrize("T,E,k,block_m,one_expert", [
    (1, 8, 2, 16, False), (37, 8, 2, 16, False), (50, 4, 3, 32, False), (6, 128, 8, 16, False),
    (100, 16, 4, 64, False), (9, 8, 1, 16, True),
])
def test_align_slots_invariants(T, E, k, block_m, one_expert, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=gen).argsort(-1)[:, :k].to(torch.int32)  # k distinct experts per token
    if one_expert:
        ids.fill_(5)
    blocks = align_slots(ids.to(DEVICE), E, block_m)
    msg = f"seed={seed}"
    sorted_ids, block_experts = blocks.sorted_slot_ids.cpu(), blocks.block_expert_ids.cpu()
    num_slots, num_padded = T * k, int(blocks.num_padded.cpu()[0])
    assert sorted_ids.dtype == block_experts.dtype == blocks.num_padded.dtype == torch.int32
    assert sorted_ids.numel() == max_padded_slots(num_slots, E, block_m) == blocks.num_blocks * block_m
    assert sorted_ids.numel() <= num_slots + E * (block_m - 1), msg  # never above the general worst case

    real = sorted_ids[sorted_ids < num_slots]
    assert sorted(real.tolist()) == list(range(num_slots)), f"{msg}: every slot exactly once"
    assert (sorted_ids[num_padded:] == num_slots).all(), msg
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
    assert num_padded == sum(math.ceil(c / block_m) * block_m for c in counts.tolist()), msg

    flat = ids.reshape(-1)
    for b in range(blocks.num_blocks):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        if b * block_m >= num_padded:
            assert block_experts[b] == -1, msg
            continue
        e = int(block_experts[b])
        slots = rows[rows < num_slots]
        assert len(slots) > 0 and (flat[slots.long()] == e).all(), f"{msg}: block {b} mixes experts"
        assert (rows[: len(slots)] == slots).all(), f"{msg}: padding only at the end of a run"
    for e in range(E):
        expert_blocks = (block_experts == e).nonzero().flatten()
        assert len(expert_blocks) == math.ceil(counts[e].item() / block_m), msg
        run = sorted_ids[expert_blocks[0] * block_m:] if len(expert_blocks) else sorted_ids[:0]
        run = run[: counts[e]]
        assert (run.diff() > 0).all(), f"{msg}: slots of one expert stay in order"


def test_align_never_reads_device_values_on_the_host(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("host sync in align_slots")

    ids = torch.randint(0, 8, (13, 2), dtype=torch.int32, device=DEVICE)
    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    align_slots(ids, 8, 16)
    unsorted_slots(ids, 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA sync debug mode needs a GPU")
def test_align_and_kernels_do_not_sync_on_cuda():
    x, w13, w2, weights, ids = make_inputs(0, 40, 8, 2, 64, 32, torch.bfloat16)
    fused_moe_triton(x, w13, w2, weights, ids, config=cfg(True, 16))  # compile outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        align_slots(ids, 8, 16)
        fused_moe_triton(x, w13, w2, weights, ids, config=cfg(True, 16))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_unsorted_slots_is_one_block_per_slot():
    ids = torch.tensor([[3, 1], [0, 3]], dtype=torch.int32)
    blocks = unsorted_slots(ids, 16)
    assert not blocks.sorted and blocks.num_blocks == 4 and blocks.block_expert_ids.tolist() == [3, 1, 0, 3]


# --- launch configs ------------------------------------------------------------------------------


def test_nearest_bucket_and_defaults():
    entries = {1: cfg(False, 16), 16: cfg(True, 16), 64: cfg(True, 32), 1024: cfg(True, 64)}
    assert nearest_entry(entries, 1) is entries[1]
    assert nearest_entry(entries, 20) is entries[16]
    assert nearest_entry(entries, 40) is entries[16]  # tie 16/64 goes to the smaller tile
    assert nearest_entry(entries, 50) is entries[64]
    assert nearest_entry(entries, 10**6) is entries[1024]
    # No file for this shape: the shipped defaults, with small tiles for decode sizes.
    decode = get_launch_config(7, 22, 18, torch.bfloat16, "No Such GPU", 1)
    assert not decode.align and decode.BLOCK_M == 16
    assert get_launch_config(7, 22, 18, torch.bfloat16, "No Such GPU", 16).BLOCK_M == 16
    assert get_launch_config(7, 22, 18, torch.float32, "No Such GPU", 4096).w13.BLOCK_K <= 32  # fp32 file


def test_exact_config_file_wins(tmp_path, monkeypatch):
    mine = cfg(True, 128, 64, 128)
    name = config_file_name(8, 64, 32, torch.bfloat16, "Test GPU 80GB")
    assert name == "E=8,N=64,K=32,dtype=bfloat16,device=Test_GPU_80GB.json"
    (tmp_path / name).write_text(json.dumps({"configs": {"256": mine.to_dict()}}))
    monkeypatch.setenv(ENV_CONFIG_DIR, str(tmp_path))
    assert get_launch_config(8, 64, 32, torch.bfloat16, "Test GPU 80GB", 3) == mine
    assert get_launch_config(8, 64, 32, torch.bfloat16, "Other GPU", 3) != mine


def test_bad_config_files_are_value_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"configs": {"1": {"BLOCK_M": 24, "w13": {"BLOCK_N": 32, "BLOCK_K": 32},
                                                 "w2": {"BLOCK_N": 32, "BLOCK_K": 32}}}}))
    with pytest.raises(ValueError, match="BLOCK_M"):
        load_config_file(str(bad))
    with pytest.raises(ValueError, match="BLOCK_K"):
        GemmConfig(32, 8)
    with pytest.raises(ValueError, match="BLOCK_N >= 16"):  # row tiles under 16 are for the gemv kernels only
        cfg(True, block_n=8)


def test_gemv_config_round_trips_and_runs_as_grouped_gemms(seed):
    """PLANES and a gemv row tile under 16 survive to_dict/from_dict (PLANES written only where set, as files tuned
    before it existed read); weights the gemv kernels cannot read (w13 not contiguous along H) fall back to the
    grouped GEMMs with BLOCK_N raised to tl.dot's 16, and the result is right."""
    narrow = cfg(False, block_n=8, block_k=32, gemv=True, planes=True)
    assert LaunchConfig.from_dict(json.loads(json.dumps(narrow.to_dict()))) == narrow
    assert "PLANES" not in cfg(gemv=True).to_dict()["w13"]
    x, w13, w2, weights, ids = make_inputs(seed, 3, 8, 2, 48, 40, torch.float32)
    w13_strided = w13.transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2I, H], stride 2I along H
    assert w13_strided.stride(2) != 1
    out = fused_moe_triton(x, w13_strided, w2, weights, ids, config=narrow)
    ref = moe_float64_loop(x, w13, w2, weights, ids)
    assert rel_err(out, ref) <= TOLERANCE[torch.float32], f"seed {seed}: relative error {rel_err(out, ref)}"


# --- the command-line tools ----------------------------------------------------------------------


def test_tune_refuses_without_gpu_or_interpreter(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("with a GPU, tune runs")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert tune.main(["--E", "8", "--H", "4096", "--I", "14336", "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "CUDA" in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels were compiled for the GPU, not interpreted")
def test_tune_dry_run_writes_a_loadable_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = ["--E", "4", "--H", "32", "--I", "16", "--dtype", "float32", "--tokens", "1,6", "--out", str(tmp_path)]
    assert tune.main(args) == 0
    (path,) = tmp_path.iterdir()
    assert path.name == config_file_name(4, 32, 32, torch.float32, "cpu")
    assert set(load_config_file(str(path))) == {1, 6}


def test_bench_smoke_runs_end_to_end(capsys):
    if torch.cuda.is_available():
        pytest.skip("the smoke profile is for CPU-only machines")
    assert bench.main(["--smoke", "--tokens", "1,5", "--reps", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    backends = {r["backend"] for r in result["records"]}
    assert {"triton", "torch-loop"} <= backends
    assert all(r["rel_err_vs_torch"] < 2e-2 for r in result["records"] if r["backend"] == "triton")
