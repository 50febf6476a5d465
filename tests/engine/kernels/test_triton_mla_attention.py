"""The Triton MLA decode kernel against a float64 reference, on random latent paged caches.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 is
set here at collection, before anything imports triton), so shapes stay tiny: the
DeepSeek-V3 row of 512 latent + 64 rotary values scaled down to 32 + 16 (and a
48 + 8 case, neither a power of two). Every run draws fresh inputs; the seed is in
each assertion message and ATTN_TEST_SEED=<n> replays one. Outputs are pre-filled
with NaN, so a row the kernels forget to write fails the test.
"""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.core.request import Request  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.core.scheduler import ScheduledRequest  # noqa: E402
from engine.kernels.mla_attention import (  # noqa: E402
    DEFAULT_MLA_LAUNCH, MlaDecodeLaunch, mla_decode_from_metadata, mla_decode_splits, mla_decode_triton)
from engine.worker.batch_builder import build_triton_batch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# 16-row key tiles, so the short test contexts still spread over several splits.
SMALL_TILES = MlaDecodeLaunch(block_n=16)


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("ATTN_TEST_SEED") or random.SystemRandom().randrange(2**31))


def random_tables(rng: random.Random, seq_lens: list[int], block_size: int, num_blocks: int, width: int) -> list[list[int]]:
    """Each request's blocks drawn without replacement from a shuffled pool; the unused tail of a row is
    filled with block ids past the pool, which a kernel reading past a request's blocks would fault on."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for n in seq_lens:
        used = [free.pop() for _ in range(-(-n // block_size))]
        tables.append(used + [num_blocks + 10**6] * (width - len(used)))
    return tables


def reference_float64(q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], seq_lens: list[int],
                      scale: float, rank: int) -> torch.Tensor:
    """Absorbed MLA in float64: each request's rows gathered through its table, keys = whole rows,
    values = their first `rank` values; a padding row (no keys) is zeros."""
    num_decodes, num_heads, _ = q.shape
    bs = cache.shape[1]
    out = torch.zeros(num_decodes, num_heads, rank, dtype=torch.float64)
    for i, n in enumerate(seq_lens):
        if n == 0:
            continue
        rows = torch.stack([cache[tables[i][p // bs], p % bs] for p in range(n)]).double().cpu()  # [n, R + P]
        probs = torch.softmax(scale * q[i].double().cpu() @ rows.T, dim=-1)  # [h, n]
        out[i] = probs @ rows[:, :rank]
    return out


def run_case(seed: int, seq_lens: list[int], *, heads: int, rank: int, rope: int, block_size: int,
             dtype: torch.dtype, splits: int | None, launch: MlaDecodeLaunch = SMALL_TILES) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in seq_lens) + 1
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    tables = random_tables(rng, seq_lens, block_size, num_blocks, width)
    # Random values in every slot, used or not: a read through a wrong block changes the result. The
    # extra block is the pool's reserved one (the contract's N_blocks + 1).
    cache = torch.randn(num_blocks + 1, block_size, rank + rope, generator=gen).to(DEVICE, dtype)
    q = torch.randn(len(seq_lens), heads, rank + rope, generator=gen).to(DEVICE, dtype)
    scale = (rank + rope) ** -0.5 * 2.0  # sharper than 1/sqrt(d) so the softmax is far from uniform
    out = torch.full((len(seq_lens), heads, rank), float("nan"), dtype=dtype, device=DEVICE)
    got = mla_decode_triton(q, cache, torch.tensor(tables, device=DEVICE), torch.tensor(seq_lens, device=DEVICE),
                            scale, rank, launch, num_splits=splits, out=out)
    assert got is out and got.dtype == dtype
    assert not out.isnan().any(), f"seed={seed}: rows left unwritten"
    ref = reference_float64(q, cache, tables, seq_lens, scale, rank)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol,
                               msg=lambda m: f"seed={seed} seq_lens={seq_lens} splits={splits}: {m}")


# Lengths 1, one ending mid-block, a padding row, one exactly on a block edge, the longest over many tiles.
SEQ_LENS = [1, 13, 0, 16, 61, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_matches_float64(seed, dtype, splits):
    # R + P = 32 + 16 (DeepSeek's 512 + 64, scaled down), 4 heads in one 16-head tile.
    run_case(seed, SEQ_LENS, heads=4, rank=32, rope=16, block_size=4, dtype=dtype, splits=splits)


def test_widths_and_heads_not_powers_of_two(seed):
    # R = 48, P = 8, 3 heads: every tile dimension padded and masked; 7 splits, most of them empty for
    # the short rows (the merge must skip them).
    run_case(seed, [29, 1, 0, 40], heads=3, rank=48, rope=8, block_size=8, dtype=torch.float32, splits=7)


def test_several_head_tiles(seed):
    # 20 heads over two 16-head tiles (the second one mostly padding), blocks of 16 rows with 16-row key tiles.
    run_case(seed, [21, 5, 34], heads=20, rank=32, rope=16, block_size=16, dtype=torch.bfloat16, splits=2,
             launch=MlaDecodeLaunch(block_n=16, max_block_h=16))


def test_default_launch_and_split_choice(seed):
    # The launch a GPU would use (32-row tiles) with the split count picked by the launcher.
    run_case(seed, [70, 3], heads=4, rank=32, rope=16, block_size=4, dtype=torch.float32, splits=None,
             launch=DEFAULT_MLA_LAUNCH)


def test_from_metadata_reads_the_step_batch(seed):
    # The decodes of a real step's metadata (build_triton_batch), a prefill chunk after them whose rows
    # must not be read: q holds NaN there.
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    block_size, rank, rope, heads = 4, 32, 16, 2
    specs = [(9, 1), (0, 1), (22, 1), (0, 5)]  # (cached, new)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in specs) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    scheduled = []
    for n, (cached, new) in enumerate(specs):
        request = Request(f"r{n}", [rng.randrange(100) for _ in range(cached + new)], SamplingParams(), max_tokens=1)
        request.num_computed_tokens = cached
        table = [free.pop() for _ in range(-(-(cached + new) // block_size))]
        scheduled.append(ScheduledRequest.of(request, new, table, sample=True))
    meta = build_triton_batch(scheduled, block_size, None, 1, DEVICE).meta
    cache = torch.randn(num_blocks + 1, block_size, rank + rope, generator=gen).to(DEVICE)
    q = torch.randn(meta.num_decodes + 5, heads, rank + rope, generator=gen).to(DEVICE)
    q[meta.num_decodes:] = float("nan")
    out = mla_decode_from_metadata(q, cache, meta, 0.3, rank)
    assert out.shape == (3, heads, rank)
    decodes = scheduled[:3]
    ref = reference_float64(q[:3], cache, [s.block_ids for s in decodes], [s.start + 1 for s in decodes], 0.3, rank)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-5, rtol=2e-5, msg=lambda m: f"seed={seed}: {m}")


def test_split_choice():
    # DeepSeek-V3's bf16 rows on an H100 (132 SMs): about 2 programs per SM, at most max_splits.
    row, sms = 576 * 2, 132

    def splits(batch, heads, max_seq_len=None):
        return mla_decode_splits(batch, heads, 512, row, sms, DEFAULT_MLA_LAUNCH, max_seq_len)

    assert [splits(b, 16) for b in (1, 32, 128, 300)] == [64, 9, 3, 1]
    assert splits(1, 128) == 64  # 4 tiles of 32 heads: capped
    # With the context known, a split reads at least twice what its [h, R] float32 partial costs:
    # ~115 keys at 16 heads, ~915 at 128.
    assert [splits(1, 16, n) for n in (1, 100, 1024, 16384)] == [1, 1, 9, 64]
    assert [splits(1, 128, n) for n in (1024, 16384)] == [2, 18]


def test_bad_shapes_name_the_problem():
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels need device tensors
    q = torch.zeros(2, 4, 48, device=dev)
    cache = torch.zeros(5, 4, 40, device=dev)
    table = torch.zeros(2, 3, dtype=torch.int64, device=dev)
    lens = torch.ones(2, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="row width"):
        mla_decode_triton(q, cache, table, lens, 1.0, 32)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_decode_triton(q, torch.zeros(5, 4, 48, device=dev), table, lens, 1.0, 48)
    with pytest.raises(ValueError, match="one row per decode request"):
        mla_decode_triton(q, torch.zeros(5, 4, 48, device=dev), table[:1], lens, 1.0, 32)
    with pytest.raises(ValueError, match="out must be"):
        mla_decode_triton(q, torch.zeros(5, 4, 48, device=dev), table, lens, 1.0, 32,
                          out=torch.zeros(2, 4, 48, device=dev))


def test_benchmark_refuses_without_cuda_in_one_line(monkeypatch, capsys):
    from benchmarks import mla_decode

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mla_decode.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run; a GPU runs the real one")
def test_benchmark_smoke_run_checks_every_shape(tmp_path, capsys):
    from benchmarks import mla_decode

    path = tmp_path / "mla.json"
    assert mla_decode.main(["--smoke", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    shapes = {(r["heads"], r["batch"], r["context"]) for r in report["records"]}
    smoke = mla_decode.SMOKE
    assert shapes == {(h, d, n) for h in smoke.heads for d in smoke.batches for n in smoke.contexts}
    for r in report["records"]:
        assert "error" not in r and r["ms"] > 0 and r["gbps"] > 0 and r["max_abs_err"] < 1e-4, r
    assert "GB/s" in capsys.readouterr().out


def test_default_launch_compiles_for_h100_without_spilling():
    # The interpreter runs the kernel's logic; this compiles it for sm_90 (no GPU needed) in a process
    # without TRITON_INTERPRET, as a GPU run would, at both DeepSeek-V3 head counts, and reads the cubin.
    # First: importing the launcher (and the benchmark) leaves triton unimported, so TRITON_INTERPRET set later works.
    code = ("import json, sys; from benchmarks.mla_decode import sm90_resources, DEFAULT_MLA_LAUNCH; "
            "assert 'triton' not in sys.modules, 'importing the MLA launcher imported triton'; "
            "print(json.dumps([sm90_resources(h, DEFAULT_MLA_LAUNCH) for h in (16, 128)]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    for row in rows:
        # At most a few bytes: the default sits at the register limit, and Triton 3.6's ptxas spilled 8 bytes at
        # 16 heads (255 registers; 3.9 fits it in 254) where that launch still measured the fastest on an H100
        # (0.963 ms against 1.099 for the next, 16 heads, batch 128, 16k context). A tile change that spills
        # in earnest (hundreds of bytes) fails here.
        assert row["spill_bytes"] <= 16 and 0 < row["registers"] <= 255, row
        assert row["shared_bytes"] <= 227 * 1024, row  # an H100 block's shared memory
