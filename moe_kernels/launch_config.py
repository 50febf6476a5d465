"""Launch parameters of the Triton MoE kernels, looked up from JSON data.

A file covers one layer shape on one device: ``E`` experts, the first GEMM's
``N`` (= 2I, rows of w13) and ``K`` (= H), a dtype (the activations'), for
quantized weights with their own tuned files a quantization (``mxfp4``, ``int4``:
its tiles decode in registers, so its best tiles are not bf16's) and a device
name. Inside, entries are keyed by token count; a call takes the entry nearest
to its own token count. Lookup order, first hit wins:

1. with a quantization, ``$MOEGATE_MOE_CONFIG_DIR`` then ``moe_kernels/configs/``
   for the exact name with the quantization in it,
2. ``$MOEGATE_MOE_CONFIG_DIR/<exact name>`` (where ``benchmarks.tune_moe`` output
   can live outside the package),
3. ``moe_kernels/configs/<exact name>`` (shipped, tuned files),
4. the same from 1 to 3 for a sibling device (``SAME_CHIP``: another card built on the same die with the same SM
   count, whose tuned tiles fit this one far better than the untuned defaults),
5. ``moe_kernels/configs/default,dtype=<dtype>.json``, then ``default.json``.
"""

import dataclasses
import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
ENV_CONFIG_DIR = "MOEGATE_MOE_CONFIG_DIR"
# Cards on one die with the same SM count (the H100 SXM and the H200: GH100, 132 SMs; the H200's HBM is faster):
# where a layer shape has no file for this card, a sibling's tuned file is read before the untuned defaults.
SAME_CHIP = (("NVIDIA H100 80GB HBM3", "NVIDIA H200"),)


DOT_MIN = 16  # tl.dot's least tile dimension
GEMV_MIN_BLOCK_N = 4  # the matrix-vector kernels' least row tile (no tl.dot)


def _is_pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """Tile and launch shape of one grouped GEMM (the row tile BLOCK_M is shared, see LaunchConfig).

    ``PLANES`` True: in the matrix-vector kernels, 4-bit weights (MXFP4, INT4) are read as int32 words and decoded
    as eight nibble planes (``moe_kernels.planes_triton``) instead of as [BLOCK_N, BLOCK_K] tiles in K order; it
    changes nothing for other weights or the grouped GEMMs.

    ``SWAP`` True: in the grouped GEMMs, MXFP4 weights take the swapped-operand kernels (``moe_kernels.swapped_triton``):
    the decoded weight tile is the dot's first operand (BLOCK_N weight rows as M) and the block's BLOCK_M slots are
    its N, and ``SPLIT_K`` > 1 (only with SWAP) cuts K into that many ranges, one program each, whose float32
    partial sums a second pass adds in a fixed order (deterministic). Both change nothing for other weights or the
    matrix-vector kernels.
    """

    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 1
    num_warps: int = 4
    num_stages: int = 3
    PLANES: bool = False
    SWAP: bool = False
    SPLIT_K: int = 1

    def __post_init__(self) -> None:
        # tl.dot needs every tile dimension >= 16 (LaunchConfig holds the grouped GEMMs' BLOCK_N to it; the
        # matrix-vector kernels take narrower row tiles); arange needs powers of two.
        for name, least in (("BLOCK_N", GEMV_MIN_BLOCK_N), ("BLOCK_K", DOT_MIN)):
            value = getattr(self, name)
            if not (_is_pow2(value) and value >= least):
                raise ValueError(f"{name} must be a power of two >= {least}, got {value}")
        if self.GROUP_M < 1 or not _is_pow2(self.num_warps) or self.num_stages < 1:
            raise ValueError(f"bad GROUP_M/num_warps/num_stages in {self}")
        if self.SPLIT_K < 1 or (self.SPLIT_K > 1 and not self.SWAP):
            raise ValueError(f"SPLIT_K must be >= 1, and > 1 only with SWAP, got {self}")


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Everything one ``fused_moe_triton`` call needs to launch.

    ``align`` False selects the path without sorting (one slot per block),
    for token counts so small that sorting costs more than it saves.
    ``gemv`` True selects the matrix-vector kernels (``gemv_kernels``): no
    row tiles at all, the sum over k inside kernel 2; BLOCK_M is then unused,
    and of each GemmConfig only BLOCK_N (any power of two from 4), BLOCK_K,
    num_warps and (4-bit weights) PLANES count.
    """

    align: bool
    BLOCK_M: int
    w13: GemmConfig
    w2: GemmConfig
    gemv: bool = False

    def __post_init__(self) -> None:
        if not (_is_pow2(self.BLOCK_M) and self.BLOCK_M >= DOT_MIN):
            raise ValueError(f"BLOCK_M must be a power of two >= {DOT_MIN}, got {self.BLOCK_M}")
        if not self.gemv and min(self.w13.BLOCK_N, self.w2.BLOCK_N) < DOT_MIN:
            raise ValueError(f"the grouped GEMMs need BLOCK_N >= {DOT_MIN} (tl.dot); narrower row tiles are for "
                             f"gemv configs, got {self.w13.BLOCK_N} and {self.w2.BLOCK_N}")

    @classmethod
    def from_dict(cls, d: dict) -> "LaunchConfig":
        return cls(bool(d.get("align", True)), int(d["BLOCK_M"]), GemmConfig(**d["w13"]), GemmConfig(**d["w2"]),
                   bool(d.get("gemv", False)))

    def to_dict(self) -> dict:
        d = {"align": self.align, "BLOCK_M": self.BLOCK_M, "w13": _gemm_dict(self.w13), "w2": _gemm_dict(self.w2)}
        return {**d, "gemv": True} if self.gemv else d


def _gemm_dict(gemm: GemmConfig) -> dict:
    # PLANES, SWAP and SPLIT_K only where set, as "gemv": files written before they existed read the same.
    d = asdict(gemm)
    for name, unset in (("PLANES", False), ("SWAP", False), ("SPLIT_K", 1)):
        if d[name] == unset:
            del d[name]
    return d


def device_name(device: torch.device) -> str:
    """The name a config file is keyed by: the CUDA device name, or "cpu" (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def quantization_name(weight_dtype: torch.dtype) -> str | None:
    """The quantization that keys its own config files for expert weights of this dtype: "mxfp4" for packed uint8
    (MXFP4) weights, "int4" for packed int32 (INT4) ones, None otherwise (8-bit weights take the activation dtype's
    files, as float weights do)."""
    return {torch.uint8: "mxfp4", torch.int32: "int4"}.get(weight_dtype)


def config_file_name(num_experts: int, n: int, k: int, dtype: torch.dtype | str, device: str,
                     quantization: str | None = None) -> str:
    """File name for (E, N=2I, K=H, dtype, quantization, device); spaces and slashes become underscores."""
    dtype = dtype if isinstance(dtype, str) else dtype_name(dtype)
    safe_device = device.replace(" ", "_").replace("/", "_")
    quant = f",quantization={quantization}" if quantization else ""
    return f"E={num_experts},N={n},K={k},dtype={dtype}{quant},device={safe_device}.json"


@functools.lru_cache(maxsize=None)
def load_config_file(path: str) -> dict[int, LaunchConfig]:
    """Parse one JSON file into {token count: LaunchConfig}. Cached: files are read once per process."""
    with open(path) as f:
        data = json.load(f)
    entries = data["configs"]
    if not entries:
        raise ValueError(f"{path}: no entries under 'configs'")
    try:
        return {int(tokens): LaunchConfig.from_dict(entry) for tokens, entry in entries.items()}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: bad launch config: {e}") from e


def nearest_entry(configs: dict[int, LaunchConfig], num_tokens: int) -> LaunchConfig:
    """The entry whose token count is nearest to ``num_tokens`` (ties go to the smaller bucket)."""
    best = min(configs, key=lambda tokens: (abs(tokens - num_tokens), tokens))
    return configs[best]


@functools.lru_cache(maxsize=256)
def _find_file(num_experts: int, n: int, k: int, dtype: str, device: str, env_dir: str | None,
               quantization: str | None) -> str:
    # A quantization's own files first; without one, the dtype's tuned files beat the defaults; this card's, then
    # its siblings'.
    devices = [device] + [d for group in SAME_CHIP if device in group for d in group if d != device]
    names = [config_file_name(num_experts, n, k, dtype, d, q) for d in devices
             for q in dict.fromkeys((quantization, None))]
    candidates = [folder / name for name in names for folder in ([Path(env_dir)] if env_dir else []) + [CONFIG_DIR]]
    candidates += [CONFIG_DIR / f"default,dtype={dtype}.json", CONFIG_DIR / "default.json"]
    for path in candidates:
        if path.is_file():
            return str(path)
    raise FileNotFoundError(f"no launch config among {[str(p) for p in candidates]}")


def config_path(num_experts: int, n: int, k: int, dtype: torch.dtype, device: str,
                quantization: str | None = None) -> str:
    """The file ``get_launch_config`` reads for this key (exact match, else a default)."""
    return _find_file(num_experts, n, k, dtype_name(dtype), device, os.environ.get(ENV_CONFIG_DIR) or None,
                      quantization)


def get_launch_config(num_experts: int, n: int, k: int, dtype: torch.dtype, device: str, num_tokens: int,
                      quantization: str | None = None) -> LaunchConfig:
    """Launch parameters for a call with ``num_tokens`` tokens on a layer of this shape.

    Args:
        num_experts: E.
        n: rows of each expert's w13, 2I.
        k: hidden size H.
        dtype: activation dtype (and the weights', unless quantized).
        device: ``device_name(x.device)``.
        num_tokens: T of this call.
        quantization: ``quantization_name(w13.dtype)``: files tuned for those weights first, then the dtype's.
    """
    return nearest_entry(load_config_file(config_path(num_experts, n, k, dtype, device, quantization)), num_tokens)


def as_grouped(config: LaunchConfig) -> LaunchConfig:
    """A matrix-vector ``config`` for the grouped GEMMs (weights the gemv kernels cannot read): each BLOCK_N raised to
    tl.dot's least. Any other config as it is."""
    def fit(gemm: GemmConfig) -> GemmConfig:
        return gemm if gemm.BLOCK_N >= DOT_MIN else dataclasses.replace(gemm, BLOCK_N=DOT_MIN)

    return dataclasses.replace(config, w13=fit(config.w13), w2=fit(config.w2), gemv=False) if config.gemv else config


def with_min_block_k(config: LaunchConfig, block_k: int) -> LaunchConfig:
    """``config`` with each GEMM's BLOCK_K raised to at least ``block_k`` (a power of two). Tiles are powers of two,
    so raising BLOCK_K to 32 makes it a multiple of 32: what MXFP4 weights need (one scale per 32 values along K)."""
    def fit(gemm: GemmConfig) -> GemmConfig:
        return gemm if gemm.BLOCK_K >= block_k else dataclasses.replace(gemm, BLOCK_K=block_k)

    return dataclasses.replace(config, w13=fit(config.w13), w2=fit(config.w2))
