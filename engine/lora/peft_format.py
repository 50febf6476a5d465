"""Reading one PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

The factors are mapped onto the engine's packed parameters (``engine.models.base.COMMON_WEIGHT_RULES``):
q/k/v share ``qkv_proj`` and gate/up share ``gate_up_proj``, so a packed target holds one low-rank pair per
sub-projection the adapter has, by its index among the packed parts (each pair's delta goes to its own rows,
sum of the sub-projections' deltas in their own rows; ``engine.lora.slots`` places them). Fused expert tensors (PEFT ``target_parameters`` on
``experts.gate_up_proj`` / ``experts.down_proj``) become per-expert pairs. The scaling (alpha / r, or
alpha / sqrt(r) with rsLoRA) is folded into B once, here.

Every factor as the engine applies it (A, and B times the scaling) must be finite and within
``MAX_FACTOR_ABS``: an adapter's NaN or inf (or a value whose products overflow) would make its own requests'
activations non-finite, and those reach the KV cache blocks that later requests reuse.
"""

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import load_file

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"

# Sub-projection -> (packed target suffix, its index among the packed parts).
_PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_PLAIN = {"o_proj": "o_proj", "down_proj": "down_proj"}
_EXPERTS = {"gate_up_proj": "experts.w13", "down_proj": "experts.w2"}
# PEFT initialises lora_A within +-1/sqrt(fan_in) and lora_B at 0, and trained factors stay around 1 or far below
# (scaling included): a factor past 1e4 is a damaged or hostile file, not a fine-tune, and its products overflow
# half precision.
MAX_FACTOR_ABS = 1e4
_KEY = re.compile(r"^base_model\.model\.(.+?)\.(?:base_layer\.)?lora_([AB])\.weight$")


class AdapterFormatError(ValueError):
    """An adapter directory the engine cannot serve; the message is one line saying what is wrong."""


@dataclass(slots=True)
class LinearLora:
    """Low-rank delta of one linear (sub-)projection: delta(x) = x @ a.T @ b.T; ``a`` [r, in], ``b`` [out, r],
    the scaling folded into ``b``."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(slots=True)
class ExpertsLora:
    """Per-expert low-rank deltas of a fused expert tensor [E, out, in]: a [E, r, in], b [E, out, r]."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(slots=True)
class LoraAdapter:
    """One adapter, keyed by the engine's module names (``model.layers.0.self_attn.qkv_proj``,
    ``model.layers.0.mlp.experts.w13``). ``linears[name][part]``: the pair of sub-projection ``part`` of a packed
    target (q, k, v = 0, 1, 2 of ``qkv_proj``; gate, up = 0, 1 of ``gate_up_proj``), part 0 of a plain one."""

    name: str
    rank: int
    linears: dict[str, dict[int, LinearLora]] = field(default_factory=dict)
    experts: dict[str, ExpertsLora] = field(default_factory=dict)


def _fail(path: str, what: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter at {path}: {what}")


def read_config(path: str) -> dict:
    """The adapter's config, checked for what the engine serves; AdapterFormatError (one line) otherwise."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise _fail(path, f"no {CONFIG_FILE} (a PEFT LoRA adapter saved with save_pretrained is expected)")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise _fail(path, f"no {WEIGHTS_FILE} (save the adapter with safe_serialization, the default)")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise _fail(path, f"{CONFIG_FILE} is not readable JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise _fail(path, "peft_type must be LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _fail(path, f"r must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise _fail(path, f"lora_alpha must be a finite number, got {alpha!r}")
    for key, allowed in (("use_dora", (False, None)), ("bias", ("none", None)), ("rank_pattern", ({}, None)),
                         ("alpha_pattern", ({}, None)), ("modules_to_save", (None, [])),
                         ("fan_in_fan_out", (False, None)), ("lora_bias", (False, None))):
        if config.get(key) not in allowed:
            raise _fail(path, f"{key}={config.get(key)!r} is not supported (only plain LoRA)")
    return config


def _scaling(config: dict) -> float:
    alpha, rank = config.get("lora_alpha", 8), config["r"]
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def check_values(path: str, key: str, tensor: torch.Tensor, scaling: float = 1.0) -> None:
    """AdapterFormatError naming tensor ``key`` unless ``tensor`` times ``scaling`` is finite and within
    +-``MAX_FACTOR_ABS`` (the factor as the engine applies it; ``scaling``: lora_B's)."""
    values = tensor.float()
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        raise _fail(path, f"tensor {key!r} holds {values[~finite][0].item()} (LoRA weights must be finite numbers)")
    peak = values.abs().max().item() * abs(scaling) if values.numel() else 0.0
    if peak > MAX_FACTOR_ABS:
        scaled = f" (times the scaling {scaling:g})" if scaling != 1.0 else ""
        raise _fail(path, f"tensor {key!r} holds a value of {peak:.3g}{scaled}, beyond +-{MAX_FACTOR_ABS:g}: "
                          "not the factor of a trained LoRA adapter")


def load_adapter(name: str, path: str, num_experts: int | None = None, hidden_size: int | None = None,
                 expert_size: int | None = None) -> LoraAdapter:
    """Read the adapter at ``path`` (float32, on the CPU); AdapterFormatError (one line) for anything unservable.

    ``num_experts``, ``hidden_size``, ``expert_size`` (the experts' intermediate size): the base model's, to
    unfold fused expert factors and tell which fused tensor they adapt.
    """
    config = read_config(path)
    rank, scaling = config["r"], _scaling(config)
    try:
        tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise _fail(path, f"{WEIGHTS_FILE} cannot be read ({type(e).__name__})") from None
    if not tensors:
        raise _fail(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _fail(path, f"unexpected tensor {key!r} (only lora_A/lora_B weights are served)")
        # ".base_layer." marks PEFT's nesting of two target_parameters on one module: the inner one.
        owner = m.group(1) + ("#inner" if ".base_layer.lora_" in key else "")
        # A copy even when already float32: load_file's tensors are views of a mapping of the file, which a file
        # rewritten in place would change under the host cache (or fault at a later slot write).
        tensor = tensor.to(torch.float32, copy=True)
        check_values(path, key, tensor, scaling if m.group(2) == "B" else 1.0)  # the copy: what the engine serves
        pairs.setdefault(owner, {})[m.group(2)] = tensor
    adapter = LoraAdapter(name, rank)
    for owner, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise _fail(path, f"{owner} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"] * scaling
        if a.shape[0] > rank * max(num_experts or 1, 1) or b.shape[1] != a.shape[0]:
            raise _fail(path, f"{owner}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not match r={rank}")
        base, leaf = owner.rsplit(".", 1)
        if leaf in ("experts", "experts#inner"):
            _add_experts(adapter, base + ".experts", owner, a, b, num_experts, hidden_size, expert_size, path)
        elif leaf in _PACKED:
            target, part = _PACKED[leaf]
            adapter.linears.setdefault(f"{base}.{target}", {})[part] = LinearLora(a, b)
        elif leaf in _PLAIN:
            adapter.linears[f"{base}.{leaf}"] = {0: LinearLora(a, b)}
        else:
            raise _fail(path, f"LoRA on {owner!r} is not supported (attention, MLP and expert projections are)")
    return adapter


def _add_experts(adapter: LoraAdapter, owner: str, key: str, a: torch.Tensor, b: torch.Tensor,
                 num_experts: int | None, hidden_size: int | None, expert_size: int | None, path: str) -> None:
    """PEFT's fused-expert factors: a [E*r, in] (expert-major), b [out, r*E] (rank-major, expert-minor).

    Which fused tensor they belong to is read from the shapes (PEFT nests two wrapped parameters of one module,
    in an order its config does not keep): ``gate_up_proj`` maps H -> 2I, ``down_proj`` I -> H (never both).
    """
    if num_experts is None or hidden_size is None or expert_size is None or a.shape[0] % num_experts:
        raise _fail(path, f"{key!r} does not match the base model's {num_experts} experts")
    fan_in, fan_out = a.shape[1], b.shape[0]
    if (fan_in, fan_out) == (hidden_size, 2 * expert_size):
        leaf = "gate_up_proj"
    elif (fan_in, fan_out) == (expert_size, hidden_size):
        leaf = "down_proj"
    else:
        raise _fail(path, f"{key!r}: factors {fan_in} -> {fan_out} fit neither gate_up_proj ({hidden_size} -> "
                          f"{2 * expert_size}) nor down_proj ({expert_size} -> {hidden_size}) of the base model")
    rank = a.shape[0] // num_experts
    a_e = a.reshape(num_experts, rank, a.shape[1])  # [E, r, in]
    b_e = b.reshape(b.shape[0], rank, num_experts).permute(2, 0, 1).contiguous()  # [E, out, r]
    adapter.experts[owner + "." + _EXPERTS[leaf].split(".", 1)[1]] = ExpertsLora(a_e, b_e)


@dataclass(slots=True, frozen=True)
class AdapterSummary:
    """What an adapter directory holds, read without the base model: its rank, the projections it adapts
    (``q_proj``, ``experts``...) and the base model it was made for (``base_model_name_or_path``; None if unsaid)."""

    rank: int
    target_modules: tuple[str, ...]
    base_model: str | None


_HEADER_LIMIT = 100 << 20  # a safetensors header is JSON; anything near this is not an adapter's


def _safetensors_header(path: str) -> dict:
    """The tensor entries of a safetensors file's header (name -> {"dtype", "shape", ...}), read without its data."""
    file = os.path.join(path, WEIGHTS_FILE)
    try:
        with open(file, "rb") as f:
            prefix = f.read(8)
            size = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 2 <= size <= _HEADER_LIMIT:
                raise ValueError("no safetensors header")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as e:
        raise _fail(path, f"{WEIGHTS_FILE} cannot be read ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(header, dict):
        raise _fail(path, f"{WEIGHTS_FILE} cannot be read (its header is not a JSON object)")
    header.pop("__metadata__", None)
    for key, entry in header.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise _fail(path, f"{WEIGHTS_FILE} cannot be read (tensor {key!r} has no shape)")
    return header


def _check_file_values(path: str, scaling: float) -> None:
    """``check_values`` on every tensor of the adapter's file, one at a time (lora_B with the scaling)."""
    try:
        with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():
                check_values(path, key, f.get_tensor(key), scaling if ".lora_B." in key else 1.0)
    except AdapterFormatError:
        raise
    except Exception as e:  # safetensors' own error types for data that does not match its header
        raise _fail(path, f"{WEIGHTS_FILE} cannot be read ({type(e).__name__})") from None


def check_adapter_dir(path: str) -> AdapterSummary:
    """Check that ``path`` is an adapter the engine serves, from ``adapter_config.json``, the safetensors
    header and then the tensors' values (no base model): what ``load_adapter`` refuses for the adapter itself
    (missing files, bad JSON, not plain LoRA, unexpected or unpaired tensors, factors whose shapes disagree,
    values that are not finite or past ``MAX_FACTOR_ABS``) is an ``AdapterFormatError`` (a ValueError) with one
    line. The values are read one tensor at a time, after every header check has passed. What only the base
    model can tell (a layer it lacks, expert factors that fit none of its tensors, a rank above the engine's
    ``max_lora_rank``) is left to ``load_adapter``."""
    if not os.path.isdir(path):
        raise _fail(path, "not a directory")
    config = read_config(path)
    rank = config["r"]
    header = _safetensors_header(path)
    if not header:
        raise _fail(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    pairs: dict[str, dict[str, list[int]]] = {}
    for key, entry in header.items():
        m = _KEY.match(key)
        if m is None:
            raise _fail(path, f"unexpected tensor {key!r} (only lora_A/lora_B weights are served)")
        owner = m.group(1) + ("#inner" if ".base_layer.lora_" in key else "")
        pairs.setdefault(owner, {})[m.group(2)] = entry["shape"]
    targets: set[str] = set()
    for owner, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise _fail(path, f"{owner} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]
        # Experts stack E pairs along the rank dimension ([E*r, in] and [out, r*E]), so a multiple of r.
        if len(a) != 2 or len(b) != 2 or a[0] == 0 or a[0] % rank or b[1] != a[0]:
            raise _fail(path, f"{owner}: lora_A {tuple(a)} and lora_B {tuple(b)} do not match r={rank}")
        leaf = owner.rsplit(".", 1)[-1]
        if leaf in ("experts", "experts#inner"):
            targets.add("experts")
        elif leaf in _PACKED or leaf in _PLAIN:
            if a[0] != rank:
                raise _fail(path, f"{owner}: lora_A {tuple(a)} and lora_B {tuple(b)} do not match r={rank}")
            targets.add(leaf)
        else:
            raise _fail(path, f"LoRA on {owner!r} is not supported (attention, MLP and expert projections are)")
    _check_file_values(path, _scaling(config))
    base = config.get("base_model_name_or_path")
    return AdapterSummary(rank, tuple(sorted(targets)), base if isinstance(base, str) and base else None)
