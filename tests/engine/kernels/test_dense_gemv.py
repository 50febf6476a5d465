"""The dense matrix-vector kernel, the Linear wrapper, the measured selection and the engine with it.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 is
set here at collection, before any kernel module is imported). Inputs are fresh
random draws each run; outputs are poisoned with NaN first, so an element the
kernel leaves unwritten fails.
"""

import json
import os
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, KernelChoice, SamplingParams  # noqa: E402
from engine.core.config import EngineConfig  # noqa: E402
from engine.transforms.gemv_select import (  # noqa: E402
    MARGIN, ROW_BUCKETS, apply_dense_gemv, candidates, format_choices, group_by_shape, occupancy_split,
)
from engine.layers import gemv_linear  # noqa: E402
from engine.kernels.dense_gemv import MAX_GEMV_ROWS, GemvConfig, dense_gemv  # noqa: E402
from engine.layers.gemv_linear import GemvLinear, LinearShape  # noqa: E402
from tests.hf_models import make_hf_model  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# The GPU tests: every part in Triton, with the gemv off, forced on, or measured.
GPU_KERNELS = {mode: KernelChoice("triton", "triton", "triton", mode) for mode in ("off", "on", "measure")}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}

# FMA at 1, 4 and 8 rows, tensor-core tiles, K-splits that divide K's tiles evenly and not.
CONFIGS = [
    GemvConfig(1, 16, 32),
    GemvConfig(1, 8, 64, split_k=2),
    GemvConfig(4, 16, 32, split_k=3),
    GemvConfig(8, 8, 16),
    GemvConfig(16, 16, 32, dot=True),
    GemvConfig(16, 32, 16, dot=True, split_k=4),
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "an output element was left unwritten (NaN poison) or overflowed"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.short().replace(" ", "-"))
@pytest.mark.parametrize("bias", [False, True])
def test_dense_gemv_matches_float64(dtype, cfg, bias):
    rng = random.Random()
    k, n = rng.choice([64, 72, 83, 96]), rng.randint(40, 130)
    for rows in sorted({1, rng.randint(1, min(cfg.block_m, 4)), min(cfg.block_m, MAX_GEMV_ROWS)}):
        x = torch.randn(rows, k, device=DEVICE, dtype=dtype)  # [M, K]
        weight = torch.randn(n, k, device=DEVICE, dtype=dtype) / k**0.5  # [N, K]
        b = torch.randn(n, device=DEVICE, dtype=dtype) if bias else None
        out = torch.full((rows, n), float("nan"), device=DEVICE, dtype=dtype)  # [M, N]
        dense_gemv(x, weight, b, cfg, out=out)
        ref = x.double() @ weight.double().t() + (b.double() if bias else 0.0)
        assert rel_err(out, ref) < TOLERANCE[dtype], (cfg, rows, k, n)


def test_dense_gemv_float16_row_strided_input_and_its_own_output():
    # x a column slice of a wider buffer (rows strided, columns contiguous), as a projection of a split may be.
    wide = torch.randn(3, 150, device=DEVICE, dtype=torch.float16)
    x = wide[:, 10:87]  # [3, 77]
    weight = torch.randn(53, 77, device=DEVICE, dtype=torch.float16) / 77**0.5
    out = dense_gemv(x, weight, None, GemvConfig(4, 16, 32, split_k=2))
    assert out.shape == (3, 53) and out.dtype == torch.float16
    assert rel_err(out, x.double() @ weight.double().t()) < TOLERANCE[torch.float16]


def test_dense_gemv_rejects_more_rows_than_its_tile_and_mixed_dtypes():
    x = torch.randn(5, 64, device=DEVICE)
    with pytest.raises(AssertionError, match="rows"):
        dense_gemv(x, torch.randn(40, 64, device=DEVICE), None, GemvConfig(4, 16, 32))
    with pytest.raises(ValueError, match="share"):
        dense_gemv(x[:1], torch.randn(40, 64, device=DEVICE, dtype=torch.bfloat16), None, GemvConfig(1, 16, 32))
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(3, 16, 32)
    with pytest.raises(ValueError, match="dot"):
        GemvConfig(4, 16, 32, dot=True)


_SM90_BUILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels.dense_gemv_kernels import dense_gemv_kernel

out = {}
for name, m, n, k, warps, stages, dot in json.loads(sys.argv[1]):
    sig = {p: "*bf16" for p in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")} | {"part_ptr": "*fp32"}
    sig |= {p: "i32" for p in ("num_rows", "n_size", "k_size", "split_k", "split_tiles", "stride_xm", "stride_wn", "stride_om")}
    consts = dict(HAS_BIAS=False, USE_DOT=dot, PRECISION="tf32", UPCAST=False, EVEN_K=True, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k)
    sig |= {p: "constexpr" for p in consts}
    # What Triton specializes at a launch on such shapes: aligned pointers; N, K and strides divisible by 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 6, 7, 10, 11, 12)}
    src = ASTSource(fn=dense_gemv_kernel, signature=sig, constexprs=consts, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}).asm["ptx"]
    out[name] = {"v4_loads": ptx.count("ld.global.v4"), "cp_async": ptx.count("cp.async")}
print(json.dumps(out))
"""


def test_sm90_build_reads_the_weights_with_16_byte_loads():
    # A bandwidth-bound kernel must not read bf16 W two bytes at a time: a split offset the compiler could
    # not prove aligned (a runtime column count) once turned every W load into ld.global.b16. Built for an
    # H100 (no GPU needed: Triton's own ptxas), in a fresh process, since this one runs the interpreter.
    pytest.importorskip("triton.backends.nvidia.compiler")
    import subprocess
    import sys

    builds = [("fma", 1, 32, 256, 4, 2, False), ("dot", 16, 64, 128, 4, 4, True)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", _SM90_BUILD, json.dumps(builds)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ptx = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ptx["fma"]["v4_loads"] >= 8  # 32 x 256 bf16 over 128 threads: eight 16-byte loads each per step
    assert ptx["dot"]["cp_async"] > 0  # the tensor-core path streams W through shared memory, pipelined


def _launches(rows_with: set[int], cfg: GemvConfig) -> tuple:
    return tuple(cfg if r in rows_with else None for r in range(MAX_GEMV_ROWS + 1))


def test_gemv_linear_dispatches_by_row_count_and_keeps_parameters(monkeypatch):
    calls = []
    real = gemv_linear.dense_gemv
    monkeypatch.setattr(gemv_linear, "dense_gemv", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 48)
            self.proj = nn.Linear(48, 70, bias=True)
            self.head = nn.Linear(48, 10, bias=False)
            self.head.weight = self.embed.weight  # tied, as lm_head to embed_tokens

    model = Tiny().to(DEVICE)
    names = sorted(model.state_dict())
    launches = _launches({1, 2, 3, 4}, GemvConfig(4, 16, 32, split_k=2))
    swapped = gemv_linear.enable_dense_gemv(model, {LinearShape.of(model.proj): launches, LinearShape.of(model.head): launches})
    assert swapped == 2 and isinstance(model.proj, GemvLinear) and isinstance(model.head, GemvLinear)
    assert model.head.weight is model.embed.weight and sorted(model.state_dict()) == names
    with torch.no_grad():
        for rows in (1, 3, 4, 5, 9):
            x = torch.randn(rows, 48, device=DEVICE)
            ref = F.linear(x.double(), model.proj.weight.double(), model.proj.bias.double())
            assert rel_err(model.proj(x), ref) < 1e-5
    assert calls == [1, 3, 4], "the gemv must run exactly for the row counts the launches cover"


class FakeTimer:
    """F.linear takes 10 us; a gemv launch takes what ``gemv_us`` says for its (N, rows), or raises."""

    def __init__(self, gemv_us):
        self.gemv_us = gemv_us
        self.seen = []

    def __call__(self, weight, bias, rows, cfg):
        self.seen.append((weight.shape[0], rows, cfg))
        if cfg is None:
            return 10e-3
        us = self.gemv_us(weight.shape[0], rows, cfg)
        if us is None:
            raise RuntimeError("out of resources")
        return us * 1e-3


def test_selection_uses_the_gemv_only_where_measured_faster():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a1, self.a2 = nn.Linear(64, 96), nn.Linear(64, 96)  # one shape, two modules
            self.b = nn.Linear(64, 40, bias=False)
            self.c = nn.Linear(80, 48, bias=False)

    def gemv_us(n, rows, cfg):
        if n == 96:  # faster at one row only; tensor-core launches fail to run
            return None if cfg.dot else (5.0 if rows == 1 else 20.0)
        if n == 40:  # within the margin at every bucket: a tie keeps F.linear
            return 10.0 * (1 - MARGIN / 2)
        return 4.0 if cfg.dot else 7.0  # the tensor-core launch is the best measured where it exists

    model = Model().to(DEVICE)
    timer = FakeTimer(gemv_us)
    choices = apply_dense_gemv(model, DEVICE, "measure", timer=timer)
    by_n = {c.shape.n: c for c in choices}
    assert set(by_n) == {96, 40, 48} and by_n[96].count == 2
    assert [b.use_gemv for b in by_n[96].buckets] == [True, False, False]
    assert not any(b.config.dot for b in by_n[96].buckets)
    assert not any(b.use_gemv for b in by_n[40].buckets)
    assert all(b.use_gemv for b in by_n[48].buckets)
    assert [b.config.dot for b in by_n[48].buckets] == [False, True, True]
    # Every bucket of every shape timed F.linear once and each candidate once, at the bucket's row count.
    for n, shape in ((96, by_n[96].shape), (48, by_n[48].shape)):
        for bucket in ROW_BUCKETS:
            timed = [cfg for seen_n, rows, cfg in timer.seen if seen_n == n and rows == bucket]
            assert timed.count(None) == 1 and len(timed) == 1 + len(candidates(shape, bucket, 2))
    # The swap follows the launches: rows 1 only for N=96; every row count up to 8 for N=48; none for N=40.
    assert isinstance(model.a1, GemvLinear) and isinstance(model.a2, GemvLinear) and not isinstance(model.b, GemvLinear)
    assert [r for r, c in enumerate(model.a1.launches) if c] == [1]
    assert [r for r, c in enumerate(model.c.launches) if c] == list(range(1, MAX_GEMV_ROWS + 1))
    assert model.c.launches[2] is model.c.launches[4] and model.c.launches[5] is model.c.launches[8], "rows share their bucket's launch"
    table = format_choices(choices)
    assert "F.linear" in table and "gemv" in table and "64->96 float32 +bias" in table


def test_candidates_split_tall_skinny_shapes_only():
    # o_proj 4096 -> 2048 and the router 2048 -> 128 get K-splits on 132 SMs; lm_head 2048 -> 151936 none.
    assert occupancy_split(2048, 4096, 32, 256, 132) > 1
    assert occupancy_split(128, 2048, 16, 512, 132) == 4  # capped at one K tile per split
    assert occupancy_split(151936, 2048, 32, 256, 132) == 1
    for bucket in ROW_BUCKETS:
        cands = candidates(LinearShape(2048, 4096, torch.bfloat16, False), bucket, 132)
        assert any(c.split_k > 1 for c in cands) and any(c.split_k == 1 for c in cands)
        assert all(c.block_m >= bucket for c in cands)


def test_one_kernels_option_resolves_every_part_and_is_validated():
    with pytest.raises(ValueError, match="kernels"):
        EngineConfig(model="x", kernels="cuda")
    with pytest.raises(ValueError, match="dense_gemv"):
        KernelChoice(dense_gemv="yes")
    assert EngineConfig(model="x").kernels == "auto"
    assert KernelChoice.resolve("auto", "cpu") == KernelChoice() and not KernelChoice().uses_triton
    assert KernelChoice.resolve("auto", "cuda") == KernelChoice("triton", "triton", "triton", "measure")
    assert KernelChoice.resolve("triton", "cpu") == KernelChoice("triton", "triton", "triton", "off")
    assert KernelChoice.resolve("torch", "cuda") == KernelChoice()


@pytest.fixture
def one_torch_thread():
    # The interpreter is single-threaded Python; torch's OpenMP pool spinning beside it on a shared
    # 2-core box made the tiny torch ops between launches (the MoE's index_add_) 100x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])  # qwen2_moe: qkv bias, a shared expert and its N=1 gate
def test_engine_greedy_tokens_same_with_dense_gemv_on_and_off(family, tmp_path, monkeypatch, one_torch_thread):
    calls = []
    real = gemv_linear.dense_gemv
    monkeypatch.setattr(gemv_linear, "dense_gemv", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    seed = random.randrange(2**31)
    vocab = 97
    # qwen2_moe's mlp_only_layers=[1] makes its second layer a dense MLP: more Linear shapes.
    make_hf_model(family, str(tmp_path), seed=seed, vocab_size=vocab, num_layers=2 if family == "qwen2_moe" else 1)
    rng = random.Random(seed)
    # One request alone (1-row decode steps), then six together (6-row decode steps: the 8-row tile).
    batches = [[[rng.randrange(1, vocab - 1) for _ in range(5)]],
               [[rng.randrange(1, vocab - 1) for _ in range(n)] for n in (1, 2, 4, 7, 9, 3)]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for mode in ("off", "on"):
        llm = LLM(model=str(tmp_path), dtype="float32", device=DEVICE.type, kernel_choice=KernelChoice(dense_gemv=mode),
                  num_kv_blocks=64, enforce_eager=True)
        tokens[mode] = [[out.token_ids for out in llm.generate(prompts, params)] for prompts in batches]
        swapped = [m for m in llm.engine.model.modules() if isinstance(m, GemvLinear)]
        assert bool(swapped) == (mode == "on")
        if mode == "on":
            assert len(swapped) == sum(len(v) for v in group_by_shape(llm.engine.model).values())
    assert tokens["on"] == tokens["off"], f"seed={seed} family={family}"
    assert {1, 6} <= set(calls), f"the gemv did not run at 1 and 6 rows: {sorted(set(calls))}"


def test_micro_bench_smoke_run_and_refusal_without_cuda(tmp_path, monkeypatch, capsys):
    from benchmarks import dense_gemv as dense_gemv_bench
    from engine.transforms import gemv_select as dense_gemv_select

    gpu = torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dense_gemv_bench.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    if gpu:  # --smoke would set TRITON_INTERPRET=1 in a process whose other tests run the compiled kernels
        pytest.skip("the smoke run is for machines without CUDA")
    # Two candidates per bucket keep the interpreted run short; the code path is the real one.
    real = dense_gemv_select.candidates
    monkeypatch.setattr(dense_gemv_select, "candidates", lambda *a: real(*a)[:2])
    path = tmp_path / "gemv.json"
    assert dense_gemv_bench.main(["--smoke", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    # The tiny Qwen3-MoE preset: qkv, o_proj, router and lm_head, each at 1, 4 and 8 rows.
    assert len(report["shapes"]) == 4 and all(len(s["buckets"]) == len(ROW_BUCKETS) for s in report["shapes"])
    assert all(len(b["tried"]) == 2 and b["linear_us"] > 0 for s in report["shapes"] for b in s["buckets"])
    assert "F.linear us" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_graphs_with_the_gemv_give_the_eager_cublas_tokens_without_host_syncs(tmp_path):
    make_hf_model("qwen3_moe", str(tmp_path), seed=0, vocab_size=97, num_layers=2)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 96) for _ in range(n)] for n in (3, 17, 40, 5, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for eager, mode in ((True, "off"), (False, "on"), (False, "measure")):
        llm = LLM(model=str(tmp_path), dtype="float32", device="cuda", enforce_eager=eager, num_kv_blocks=64,
                  max_num_seqs=8, cuda_graph_batch_sizes=(1, 2, 4, 8), kernel_choice=GPU_KERNELS[mode])
        tokens[mode] = [o.token_ids for o in llm.generate(prompts, params)]
        if mode != "off":
            assert llm.engine.runner.decode_graphs.replays > 0
            shapes = group_by_shape(llm.engine.model)
            assert {c.shape for c in llm.engine.dense_gemv_choices} == set(shapes)
    assert tokens["on"] == tokens["off"] and tokens["measure"] == tokens["off"]

    llm = LLM(model=str(tmp_path), dtype="bfloat16", device="cuda", enforce_eager=True, num_kv_blocks=64,
              kernel_choice=GPU_KERNELS["on"])
    engine = llm.engine
    engine.add_request(list(range(1, 6)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    for _ in range(3):  # prefill (F.linear), then 1-row decodes (the gemv)
        plan = engine.scheduler.schedule()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                engine.runner.forward(engine.runner.prepare(plan.scheduled))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        engine.scheduler.update(plan, [1 if s.sample else None for s in plan.scheduled])
