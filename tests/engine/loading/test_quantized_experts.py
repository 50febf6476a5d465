"""8-bit experts end to end (float32 activations, CPU): checkpoints written here with a float64 quantizer of
this file, the engine's greedy output against transformers running the dequantized weights, and how far
8-bit experts move a model's logits from the unquantized model.

The references: for a scheme, ``quantize64`` stores each expert weight as 8-bit values and scales; the same
values times their scales, saved as an ordinary float32 checkpoint, are what transformers runs. Weight-only
quantization means the engine must then produce that model's greedy tokens exactly.
"""

import json
import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # before moe_kernels.triton_backend is first imported (see its docstring)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from engine import LLM, KernelChoice, SamplingParams  # noqa: E402
from tests.engine.models.test_vs_transformers import hf_greedy  # noqa: E402
from tests.hf_models import make_hf_model  # noqa: E402

VOCAB = 211
# moe_intermediate_size 32: gate and up rows fill whole 16-row blocks, so the packed gate/up weight has the
# checkpoint's blocks and loading an 8-bit checkpoint keeps its values (see test_prequantized_checkpoint).
SHAPE = dict(moe_intermediate_size=32)
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
DENSE_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")
OPTIONS = {  # --quantization -> (method, block) of the float64 reference quantizer
    "int8": ("int8", None),
    "fp8": ("fp8", None),
    "fp8-block": ("fp8", (128, 128)),
}


def quantize64(w: torch.Tensor, method: str, block) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q, scale): symmetric, each channel's (or block's) largest magnitude onto 448 (fp8) or 127
    (int8), in float64; scale [N], or [ceil(N/bn), ceil(K/bk)] for blocks."""
    w = w.double()
    limit = 448.0 if method == "fp8" else 127.0
    n, k = w.shape
    if block is None:
        scale = w.abs().amax(dim=1) / limit
        full = scale[:, None]
    else:
        bn, bk = block
        scale = torch.empty(-(-n // bn), -(-k // bk), dtype=torch.float64)
        full = torch.empty_like(w)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / limit
                full[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = scale[i, j]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).float()  # the checkpoint stores float32
    full = torch.where(full > 0, full, torch.ones_like(full)).float().double()
    if method == "fp8":
        q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        q = (w / full).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def dequant64(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    if block is None:
        return q.double() * scale.double()[:, None]
    rows = torch.arange(q.shape[0]) // block[0]
    cols = torch.arange(q.shape[1]) // block[1]
    return q.double() * scale.double()[rows[:, None], cols[None, :]]


def write_variants(src: str, dst_8bit: str | None, dst_dequant: str, method: str, block, names) -> dict:
    """From checkpoint ``src``: ``dst_8bit`` with the tensors whose name holds one of ``names`` stored 8-bit
    plus ``<name>_scale_inv`` (blocks) or ``<name>_scale`` (channels) and a quantization_config (fp8 only), and
    ``dst_dequant`` with those tensors replaced by their dequantized float32 values. Returns {name: (q, s)}."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    stored, dequant, quantized = {}, {}, {}
    for name, w in tensors.items():
        if any(f".{part}." in name for part in names) and name.endswith(".weight"):
            q, s = quantize64(w, method, block)
            quantized[name] = (q, s)
            stored[name] = q
            stored[name + ("_scale_inv" if block else "_scale")] = s
            dequant[name] = dequant64(q, s, block).float()
        else:
            stored[name] = dequant[name] = w
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for dst, data, extra in ((dst_8bit, stored, True), (dst_dequant, dequant, False)):
        if dst is None:
            continue
        os.makedirs(dst, exist_ok=True)
        save_file(data, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
        cfg = dict(config)
        if extra:
            cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          **({"weight_block_size": list(block)} if block else {})}
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return quantized


def prompts(rng: random.Random, n: int = 4) -> list[tuple[list[int], int]]:
    return [([rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(5, 60))], 12) for _ in range(n)]


def engine_greedy(path: str, reqs, device: str = "cpu", **kwargs) -> list[list[int]]:
    # 64 blocks of 16 hold every request at once (at most 6 of 72 tokens), where the pool sized from memory (2 GB)
    # takes ~1.5 s to build per engine on the CPU.
    llm = LLM(model=path, dtype="float32", device=device, num_kv_blocks=64, **kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    return [o.token_ids for o in llm.generate([p for p, _ in reqs], params)], llm


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    seed = random.randrange(2**31)
    path = str(tmp_path_factory.mktemp("base"))
    make_hf_model("qwen3_moe", path, seed=seed, vocab_size=VOCAB, **SHAPE)
    return path, seed


@pytest.fixture(scope="module")
def agreement_case(base):
    """Prompts and the unquantized model's teacher-forced logits and engine greedy tokens on them."""
    path, seed = base
    reqs = prompts(random.Random(seed + 1), n=6)
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return reqs, logits(full, reqs), engine_greedy(path, reqs)[0]


@pytest.mark.parametrize("block", [(16, 32), None], ids=["block", "channel"])
def test_prequantized_checkpoint(base, tmp_path, block):
    """An FP8 checkpoint (experts and attention projections in float8_e4m3fn with their scales) loads: the
    experts keep the checkpoint's 8-bit values and scales, and greedy output is transformers' on the
    dequantized weights."""
    path, seed = base
    fp8_dir, ref_dir = str(tmp_path / "fp8"), str(tmp_path / "ref")
    quantized = write_variants(path, fp8_dir, ref_dir, "fp8", block, EXPERT_NAMES + DENSE_NAMES)
    reqs = prompts(random.Random(seed))
    got, llm = engine_greedy(fp8_dir, reqs)
    experts = llm.engine.model.model.layers[1].mlp.experts
    assert experts.scheme.method == "fp8" and experts.scheme.block == block
    q_gate, s_gate = quantized["model.layers.1.mlp.experts.3.gate_proj.weight"]
    q_up, s_up = quantized["model.layers.1.mlp.experts.3.up_proj.weight"]
    q_down, s_down = quantized["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert torch.equal(experts.w13[3].view(torch.uint8), torch.cat([q_gate, q_up]).view(torch.uint8))
    assert torch.equal(experts.w2[3].view(torch.uint8), q_down.view(torch.uint8))
    assert torch.allclose(experts.w13_scale[3], torch.cat([s_gate, s_up]), rtol=1e-6, atol=0)
    assert torch.allclose(experts.w2_scale[3], s_down, rtol=1e-6, atol=0)
    hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, m) for p, m in reqs]
    assert got == expected, f"seed={seed}"


def logits(model, reqs) -> torch.Tensor:
    """Teacher-forced next-token logits at every prompt position -> [positions, V] float64."""
    with torch.no_grad():
        return torch.cat([model(torch.tensor([p])).logits[0].double() for p, _ in reqs])


@pytest.mark.parametrize("option", OPTIONS)
def test_load_time_quantization_agreement(base, agreement_case, tmp_path, option):
    """--quantization on a float32 checkpoint: greedy output is transformers' on the dequantized experts; the
    logit error against the unquantized model is small against the logits' spread, and the top-1 tokens
    mostly agree (printed: pytest -s)."""
    path, seed = base
    method, block = OPTIONS[option]
    ref_dir = str(tmp_path / "ref")
    write_variants(path, None, ref_dir, method, block, EXPERT_NAMES)
    reqs, exact, unquantized = agreement_case
    got, llm = engine_greedy(path, reqs, quantization=option)
    assert llm.engine.model.model.layers[0].mlp.experts.w13.dtype == (torch.int8 if method == "int8" else torch.float8_e4m3fn)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    assert got == [hf_greedy(ref, p, m) for p, m in reqs], f"seed={seed}"

    approx = logits(ref, reqs)
    err = (approx - exact).abs()
    spread = exact.std().item()
    top1 = (approx.argmax(-1) == exact.argmax(-1)).double().mean().item()
    matched = sum(a == b for x, y in zip(got, unquantized) for a, b in zip(x, y))
    print(f"\n{option}: logit error max {err.max().item():.4f} mean {err.mean().item():.5f} (logit std {spread:.3f}); "
          f"teacher-forced top-1 agreement {top1:.3f} over {exact.shape[0]} positions; greedy tokens equal to "
          f"the unquantized engine's {matched}/{sum(len(x) for x in got)}")
    # Each weight moves by at most half a step: 1/254 of its channel's largest value (int8), 1/16 of itself
    # (fp8, 3 mantissa bits). Measured mean logit errors were 0.2% (int8) and 1% (fp8) of the logits' spread;
    # the bounds leave 3-5x. The max is not bounded: where two experts' router logits nearly tie, the
    # quantized model may route a token differently, a jump that says nothing about the weights' precision.
    assert err.mean().item() < (0.01 if method == "int8" else 0.03) * spread, f"seed={seed}"
    assert top1 >= 0.9, f"seed={seed}"


def test_bad_settings_name_the_field(base, tmp_path):
    from engine.core.config import EngineConfig
    from engine.core.model_config import CheckpointError
    from engine.loading.quantization import check_supported
    from moe_kernels.quant import QuantScheme

    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="int4")
    with pytest.raises(ValueError, match="blocks"):
        check_supported(QuantScheme("fp8", (8, 8)), torch.device("cpu"), torch.float32, "triton")
    path, _ = base
    other = tmp_path / "gptq"
    write_variants(path, str(other), str(tmp_path / "unused"), "int8", None, EXPERT_NAMES)
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "gptq"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method 'gptq'"):
        LLM(model=str(other), dtype="float32", device="cpu")
    del config["quantization_config"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="I8 but config.json has no quantization_config"):
        LLM(model=str(other), dtype="float32", device="cpu")


def test_triton_experts_match_torch_experts(base, option="fp8-block"):
    """The same 8-bit engine with the Triton MoE kernels (interpreted on a CPU) and with torch's: greedy equal."""
    path, seed = base
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = random.Random(seed + 2)
    reqs = [([rng.randrange(1, VOCAB - 1) for _ in range(n)], 3) for n in (1, 17)]  # decode- and prefill-sized
    tokens = {backend: engine_greedy(path, reqs, device, quantization=option, kernel_choice=KernelChoice(moe=backend))[0]
              for backend in ("torch", "triton")}
    assert tokens["triton"] == tokens["torch"], f"seed={seed}"


@pytest.mark.timeout(120)
def test_expert_parallel_8bit_matches_one_process(tmp_path):
    """Experts divided whole between 2 ranks (gloo, 1 thread each) keep each expert's own scales: greedy tokens
    equal one process's with the same --quantization."""
    from tests.distributed.ranks import run_ranks
    from tests.distributed.test_engine_ranks import _generate_each_way
    from tests.distributed.test_tensor_parallel import OVERRIDES, VOCAB as TP_VOCAB

    seed = random.randrange(2**31)
    make_hf_model("qwen3_moe", str(tmp_path), seed=seed, vocab_size=TP_VOCAB, num_layers=2, **OVERRIDES["qwen3_moe"])
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, TP_VOCAB - 1) for _ in range(n)] for n in (23, 5)]
    modes = {"single": dict(quantization="int8"),
             "ep": dict(tensor_parallel_size=2, enable_expert_parallel=True, quantization="int8")}
    results = run_ranks(_generate_each_way, 1, str(tmp_path), prompts, [6, 6], modes, timeout_s=100)
    status, value = results.get(0, ("missing", None))
    assert status == "ok", value
    assert value["ep"] == value["single"], f"seed={seed}"


def test_serve_flag_reaches_the_engine_config():
    from engine.engine_flags import engine_config
    from gateway.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "m", "--quantization", "fp8-block"])
    assert engine_config(args).quantization == "fp8-block"
    assert engine_config(build_parser().parse_args(["serve", "--model", "m"])).quantization is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int4"])
