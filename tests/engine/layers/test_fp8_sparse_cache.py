"""The FP8 cache of sparse MLA attention (``--kv-cache-dtype fp8``): the byte layout against a float64 reading of
DeepSeek-V3.2's published format (e4m3 values decoded from their bits, float32 tile scales, bf16 rotary part);
the layer over that cache against the float64 loop of ``test_sparse_mla_attention`` with its cached rows
quantized the same way; greedy tokens of a tiny DeepSeek-V3.2 engine against transformers' model whose cache
passes its latents and indexer keys through the same quantize-dequantize; the flag refused for other families."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.layers import fp8_cache
from tests.engine.layers import test_sparse_mla_attention as sparse

E4M3_MAX = 448.0


def _tile_scales(x: torch.Tensor) -> torch.Tensor:
    """x [w] float64 -> the float32 scale of each 128-value tile (absmax / 448, 1e-4 / 448 for a zero tile)."""
    scales = [max(float(x[i:i + 128].abs().max()), 1e-4) / E4M3_MAX for i in range(0, len(x), 128)]
    return torch.tensor(scales, dtype=torch.float64).float().double()


def _e4m3(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v float64 within +-448 -> (v rounded to the nearest e4m3 value, ties to even; whether v lies within 1e-6 of
    a tie, where rounding its float32 quotient may go the other way)."""
    a = v.abs()
    exponent = torch.floor(torch.log2(a.clamp(min=2.0 ** -6))).clamp(min=-6)  # subnormals share 2^-6's step
    step = 2.0 ** (exponent - 3)  # three mantissa bits
    units = a / step
    near_tie = ((units - units.floor()) - 0.5).abs() < 1e-6
    return torch.sign(v) * torch.round(units) * step, near_tie


def _reference_qdq(x: torch.Tensor) -> torch.Tensor:
    """x [w] float64 -> what the FP8 cache gives back for it, computed in float64."""
    scales = _tile_scales(x).repeat_interleave(128)[:len(x)]
    return _e4m3(x / scales)[0] * scales


def _decode_e4m3(codes: np.ndarray) -> torch.Tensor:
    """uint8 e4m3 codes -> float64 values, read from their bits (sign, 4 exponent bits of bias 7, 3 mantissa)."""
    c = torch.from_numpy(codes.astype(np.int64))
    sign = 1.0 - 2.0 * (c >> 7)
    exponent, mantissa = (c >> 3) & 15, (c & 7).double()
    normal = 2.0 ** (exponent - 7).double() * (1 + mantissa / 8)
    return sign * torch.where(exponent > 0, normal, 2.0 ** -6 * mantissa / 8)


def _check_values(x: torch.Tensor, codes: np.ndarray, scales: np.ndarray) -> None:
    """The fp8 codes and float32 scales stored for x [T, w] against the float64 reading of the format."""
    for row, values in enumerate(x.double()):
        want_scales = _tile_scales(values)
        assert np.array_equal(scales[row], want_scales.float().numpy()), f"row {row}: scales"
        per_value = want_scales.repeat_interleave(128)[:len(values)]
        want, near_tie = _e4m3(values / per_value)
        got = _decode_e4m3(codes[row])
        assert torch.equal(got[~near_tie], want[~near_tie]), f"row {row}: fp8 values"


def _inputs(gen: torch.Generator, tokens: int, width: int) -> torch.Tensor:
    """[tokens, width] float32: each tile of its own magnitude (1e-3 to 3e4), one tile all zeros, one holding a
    single large value among small ones."""
    x = torch.randn(tokens, width, generator=gen)
    for t in range(tokens):
        for lo in range(0, width, 128):
            x[t, lo:lo + 128] *= 10 ** (torch.rand((), generator=gen) * 7 - 3)
    x[0, :128] = 0
    x[1, :128] *= 1e-3
    x[1, 5] = 3e4
    return x


@pytest.mark.parametrize("latent_dim,rope_dim", [(512, 64), (200, 8)], ids=["published", "partial-tile"])
def test_latent_rows_match_the_format(latent_dim, rope_dim):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    latent, k_pe = _inputs(gen, 5, latent_dim), torch.randn(5, rope_dim, generator=gen) * 50
    rows = fp8_cache.pack_latent_rows(latent, k_pe)
    tiles = -(-latent_dim // 128)
    assert rows.dtype == torch.uint8 and rows.shape == (5, latent_dim + 4 * tiles + 2 * rope_dim)
    raw = rows.numpy()
    scales = raw[:, latent_dim:latent_dim + 4 * tiles].copy().view("<f4")
    _check_values(latent, raw[:, :latent_dim], scales)
    bf16_bits = raw[:, latent_dim + 4 * tiles:].copy().view("<u2").astype(np.uint32) << 16
    assert torch.equal(torch.from_numpy(bf16_bits.view("<f4")), k_pe.to(torch.bfloat16).float()), f"seed={seed}"
    # Reading back: each value times its tile's scale (exact in float32: 4 significant bits times 24).
    want = torch.stack([_reference_qdq(row) for row in latent.double()]).float()
    got = fp8_cache.unpack_latent_rows(rows, latent_dim, torch.float32)
    near_tie = torch.stack([_e4m3(row / _tile_scales(row).repeat_interleave(128)[:latent_dim])[1]
                            for row in latent.double()])
    assert torch.equal(got[:, :latent_dim][~near_tie], want[~near_tie]), f"seed={seed}"
    assert torch.equal(got[:, latent_dim:], k_pe.to(torch.bfloat16).float())
    assert torch.equal(got[0, :128], torch.zeros(128)), "an all-zero tile reads back as zeros"
    assert torch.equal(fp8_cache.unpack_latent_rows(torch.zeros_like(rows), latent_dim, torch.float32),
                       torch.zeros(5, latent_dim + rope_dim)), "a zeroed (padding) row reads as zeros"


def test_key_rows_match_the_format():
    seed = random.randrange(2**31)
    keys = _inputs(torch.Generator().manual_seed(seed), 4, 128)
    rows = fp8_cache.pack_key_rows(keys)
    assert rows.shape == (4, 132) and fp8_cache.key_row_bytes(128) == 132
    raw = rows.numpy()
    _check_values(keys, raw[:, :128], raw[:, 128:].copy().view("<f4"))
    want = torch.stack([_reference_qdq(row) for row in keys.double()])
    torch.testing.assert_close(fp8_cache.unpack_key_rows(rows, 128).double(), want, rtol=0.07, atol=0,
                               msg=lambda m: f"seed={seed}: {m}")  # one e4m3 step where a quotient sat on a tie


@pytest.mark.parametrize("interleave", [False, True], ids=["v32-rope-sliced", "glm5-rope"])
def test_sparse_attention_over_the_fp8_cache_matches_float64_loop(interleave):
    """Fresh prefills, a chunk over a cached prefix and decodes (one group sharing a prefix block), as the bf16
    test runs them, with every cached row read back from the FP8 layout."""
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    layer = sparse._layer(interleave, seed)
    layer.fp8_cache = True
    spec = layer.cache_spec()
    assert spec.per_token == ((sparse.KV_LORA + 4 + 2 * sparse.ROPE,), (sparse.INDEX_DIM + 4,))
    layer.kv_cache = tuple(torch.zeros(17, sparse.BLOCK, *shape, dtype=torch.uint8) for shape in spec.per_token)
    lengths = (13, 12, 6)
    xs = [torch.randn(n, sparse.HIDDEN) for n in lengths]
    xs[1][:sparse.BLOCK] = xs[0][:sparse.BLOCK]
    tables = [[0, 1, 2, 3], [0, 4, 5], [6, 7]]

    def part(r: int, start: int, n: int) -> sparse.ScheduledRequest:
        return sparse.ScheduledRequest(None, n, tables[r], True, start, [100 * r + p for p in range(start, start + n)])

    got, _ = sparse._run(layer, xs, [part(0, 0, 12), part(1, 0, 11), part(2, 0, 2)])
    more, meta = sparse._run(layer, xs, [part(0, 12, 1), part(1, 11, 1), part(2, 2, 4)])
    got |= more
    assert [g.shared_blocks.tolist() for g in meta.decode_groups] == [[0]]

    def cached_latent(latent, k_pe):
        return _reference_qdq(latent), k_pe.to(torch.bfloat16).double()

    for r, n in enumerate(lengths):
        want, _ = sparse._reference(layer, xs[r], interleave, cached_latent, _reference_qdq)
        for t in range(n):
            torch.testing.assert_close(got[r, t].double(), want[t], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"seed={seed} request {r} position {t}: {m}")


def test_the_flag_is_refused_for_other_families():
    from engine.core.config import EngineConfig
    from engine.core.family_support import check_family_support

    model = SimpleNamespace(architecture="DeepseekV3ForCausalLM", is_hybrid=False, multimodal_config=None)
    with pytest.raises(ValueError) as caught:
        check_family_support(EngineConfig(model="m", kv_cache_dtype="fp8"), model)
    text = str(caught.value)
    assert "\n" not in text and text.startswith("--kv-cache-dtype") and "DeepseekV3ForCausalLM" in text, text
    check_family_support(EngineConfig(model="m", kv_cache_dtype="fp8"),
                         SimpleNamespace(architecture="GlmMoeDsaForCausalLM", is_hybrid=False, multimodal_config=None))
