"""The image-text models split over 2 tensor-parallel ranks (gloo, 1 thread each): Qwen3-VL-MoE (M-RoPE, deepstack
taps on both tower blocks, 4 experts split by intermediate slices, one KV head on both ranks), Qwen3.5-MoE with
images (a Gated DeltaNet layer's heads split, M-RoPE over a quarter of each head) and Kimi-K2.5 (MLA heads split as
DeepSeek-V3's) generate transformers' greedy tokens for a prompt with one image, one with two and a text-only one,
on tiny random checkpoints (every parameter random). Rank 0 alone encodes (the tower and the encoder cache are its
own) and hands each step's image rows to rank 1: steps of 16 tokens cut through images and the per-step encoder
budget lets one image in at a time; the first image under other text is not encoded again (rank 0's encoder
cache), and the first prompt again hits the prefix cache past its image (Qwen3.5-MoE through its state
checkpoints, each rank's heads). Qwen3-VL-MoE runs again with layer-chunked encoding (``max_num_encoder_token_blocks``:
two thirds of one block of the smaller of the two images a step, so each image's tower runs over several steps on
rank 0, its blocks split over its rows, its part-way state rank 0's alone), with the same checks: an image finished piece by piece enters rank 0's encoder cache.
Every run is made in one set of rank processes, on cases built once. (One process, the same checks:
tests/engine/vision/*_vs_transformers.py.)"""

import random

import pytest
import torch

from engine.vision.kimi_image_processing import process_kimi_image
from engine.vision.qwen_image_processing import process_image
from tests.distributed.ranks import run_ranks_each
from tests.engine.vision import kimi_k25_checkpoint as kimi
from tests.engine.vision import qwen3_vl_checkpoint as qwen
from tests.engine.vision.qwen3_5_vl_checkpoint import make_qwen3_5_moe_vl
from tests.engine.vision.test_kimi_k25_vs_transformers import _greedy, _reference, _text, _with_images
from tests.greedy_ties import assert_greedy_equal_up_to_a_near_tie

MAX_NEW = 8
FAMILIES = ("qwen3_vl_moe", "qwen3_5_moe", "kimi_k25")
CHUNKED = "qwen3_vl_moe_layer_chunked"  # Qwen3-VL-MoE's cases again, its tower run a few blocks a step
# Two key heads (one per rank) of two value heads each; its attention's one KV head on both ranks.
QWEN3_5_HEADS = dict(linear_num_key_heads=2, linear_num_value_heads=4)
# The attribute holding each family's tower on rank 0.
TOWER = {"qwen3_vl_moe": "visual", "qwen3_5_moe": "visual", "kimi_k25": "vision_tower"}
IMAGE_TOKEN = {"qwen3_vl_moe": qwen.IMAGE_TOKEN, "qwen3_5_moe": qwen.IMAGE_TOKEN, "kimi_k25": kimi.IMAGE_TOKEN}


def _generate(rank: int, world: int, address: str, path: str, prompts: list[list[int]], images: list[list],
              budget: int, tower: str, token_blocks: int | None = None) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(path, dtype="float32", device="cpu", cpu_threads=1, tensor_parallel_size=2, block_size=4,
              num_kv_blocks=96, max_num_batched_tokens=16, max_num_seqs=4, max_num_encoder_tokens=budget,
              max_num_encoder_token_blocks=token_blocks, encoder_cache_gb=0.001)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate(prompts, params, images=images)
        hits_before = llm.engine.scheduler.kv.prefix_hit_tokens
        again = llm.generate(prompts[:1], params, images=images[:1])[0].token_ids  # the first prompt again
        return {"tokens": [o.token_ids for o in outs] + [again], "cache_hits": llm.engine.stats().encoder_cache_hits,
                "again_hits": llm.engine.scheduler.kv.prefix_hit_tokens - hits_before,
                "tower": getattr(llm.engine.model, tower) is not None}
    finally:
        llm.engine.close()


def _qwen_last_logits(model, processed: list):
    """transformers' logits after ``ids`` (a whole forward, no cache) with ``processed``'s pixels."""
    pixels = {}
    if processed:
        pixels = dict(pixel_values=torch.cat([p.pixel_values for p in processed]),
                      image_grid_thw=torch.tensor([p.grid_thw for p in processed]))

    def last_logits(ids: list[int]) -> torch.Tensor:
        t = torch.tensor([ids])
        kwargs = dict(pixels, mm_token_type_ids=(t == qwen.IMAGE_TOKEN).int()) if pixels else {}
        with torch.no_grad():
            return model(t, use_cache=False, **kwargs).logits[0, -1]
    return last_logits


def _qwen_cases(model, seed: int) -> tuple[list, list, list, list, int]:
    """(prompts, engine images, expected tokens, reference logits functions, the largest image's tokens)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    pics = [qwen.random_image(gen, rng.randint(12, 40), rng.randint(12, 40)) for _ in range(3)]
    processed = [process_image(p, qwen.IMAGE_CONFIG) for p in pics]
    groups = [processed[:1], processed[1:3], [], processed[:1]]
    prompts = [qwen.with_images(rng, groups[0]), qwen.with_images(rng, groups[1]), qwen.text_ids(rng, 12)]
    prompts.append(_other_text(prompts[0], lambda: qwen.with_images(rng, groups[0]), qwen.IMAGE_TOKEN))
    expected = [qwen.hf_greedy(model, p, g, MAX_NEW) for p, g in zip(prompts, groups)]
    refs = [_qwen_last_logits(model, g) for g in groups]
    # a PIL image (preprocessed by the engine), pixel tensors, none; then the first picture under other text
    images = [[pics[0]], groups[1], [], [pics[0]]]
    budget = max(p.num_tokens(qwen.IMAGE_CONFIG.merge_size) for p in processed)
    return prompts, images, expected, refs, budget


def _other_text(prompt: list[int], draw, image_token: int) -> list[int]:
    """A prompt ``draw`` gives whose text before its image differs from ``prompt``'s: the prefix cache holds none
    of its image blocks, so its image is encoded, or read from the encoder cache."""
    while True:
        other = draw()
        if other[:other.index(image_token)] != prompt[:prompt.index(image_token)]:
            return other


def _kimi_cases(model, seed: int) -> tuple[list, list, list, list, int]:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed + 2)
    pics = [kimi.random_image(gen, rng.randint(12, 60), rng.randint(12, 60)) for _ in range(3)]
    grids = [kimi.IMAGE_CONFIG.grid(p.size[1], p.size[0]) for p in pics]
    first = lambda: _with_images(rng, [(1, *grids[0])])  # noqa: E731
    draws = [first, lambda: _with_images(rng, [(1, *g) for g in grids[1:3]]), lambda: _text(rng, 12),
             lambda: _other_text(prompts[0], first, kimi.IMAGE_TOKEN)]
    prompts, expected, refs = [], [], []
    for draw, pictures in zip(draws, (pics[:1], pics[1:3], [], pics[:1])):
        ref = _reference(model, pictures)
        for _ in range(10):  # another text around the images while the reference samples a placeholder
            prompt = draw()
            if (want := _greedy(ref, prompt)) is not None:
                break
        assert want is not None, f"seed={seed}"
        prompts.append(prompt)
        expected.append(want)
        refs.append(ref)
    images = [[pics[0]], [process_kimi_image(p, kimi.IMAGE_CONFIG) for p in pics[1:3]], [], [pics[0]]]
    budget = max(h * w // 4 for h, w in grids)
    return prompts, images, expected, refs, budget


@pytest.fixture(scope="module")
def runs(qwen3_vl_checkpoint, tmp_path_factory):
    """Each run's cases and what the split engine generated: {family or CHUNKED: (seed, cases, (status, value))}.
    One set of rank processes makes every run (their start-up paid once), and the layer-chunked run reads
    Qwen3-VL-MoE's checkpoint and cases (its transformers references computed once)."""
    path, model, seed = qwen3_vl_checkpoint
    built = {"qwen3_vl_moe": (path, seed, _qwen_cases(model, seed))}
    seed = random.randrange(2**31)
    path = str(tmp_path_factory.mktemp("tp-qwen3_5_moe"))
    model, _ = make_qwen3_5_moe_vl(path, seed, **QWEN3_5_HEADS)
    built["qwen3_5_moe"] = (path, seed, _qwen_cases(model, seed))
    seed = random.randrange(2**31)
    path = str(tmp_path_factory.mktemp("tp-kimi_k25"))
    built["kimi_k25"] = (path, seed, _kimi_cases(kimi.make_kimi_k25(path, seed), seed))
    args = {family: (path, cases[0], cases[1], cases[4], TOWER[family])
            for family, (path, _, cases) in built.items()}
    built[CHUNKED] = built["qwen3_vl_moe"]
    merge = qwen.IMAGE_CONFIG.merge_size
    images = built[CHUNKED][2][1]
    # two thirds of one block of the smaller of the two: every block of either split over its rows
    token_blocks = min(p.num_tokens(merge) for p in images[1]) * merge ** 2 * 2 // 3
    args[CHUNKED] = (*args["qwen3_vl_moe"], token_blocks)
    results = run_ranks_each(_generate, 1, args, timeout_s=300)
    return {name: (seed, cases, results[name].get(0, ("missing", None))) for name, (_, seed, cases) in built.items()}


def _check_split_run(name: str, seed: int, cases: tuple, result: tuple) -> dict:
    """The checks every split run passes: its tokens are transformers' greedy ones (up to a near tie) for each
    prompt and for the first prompt again, rank 0 holds the tower and the first image under other text is an
    encoder cache hit. ``cases``: ``_qwen_cases``' or ``_kimi_cases``'; ``result``: (status, value) of rank 0.
    Returns the value, for a run's own checks."""
    prompts, _, expected, refs, _ = cases
    status, value = result
    assert status == "ok", f"{name} seed={seed}: {value}"
    rows = zip(prompts + prompts[:1], value["tokens"], expected + expected[:1], refs + refs[:1])
    for i, (prompt, got, want, ref) in enumerate(rows):
        assert len(got) == MAX_NEW
        assert_greedy_equal_up_to_a_near_tie(ref, prompt, got, want, f"{name} seed={seed} case {i}")
    assert value["tower"], "rank 0 holds the vision tower"
    assert value["cache_hits"] >= 1, f"the first image was encoded again, or not cached ({name} seed={seed})"
    return value


@pytest.mark.timeout(400)  # the first of this module's split tests makes every run (module fixture)
@pytest.mark.parametrize("family", FAMILIES)
def test_split_image_models_generate_transformers_tokens(family, runs):
    seed, cases, result = runs[family]
    value = _check_split_run(f"family={family}", seed, cases, result)
    image_start = cases[0][0].index(IMAGE_TOKEN[family])
    assert value["again_hits"] > image_start // 4 * 4, f"no prefix hit past the image (family={family} seed={seed})"


@pytest.mark.timeout(400)  # the first of this module's split tests makes every run (module fixture)
def test_split_qwen3_vl_with_layer_chunked_encoding_generates_transformers_tokens(runs):
    """Each image's tower run over several steps on rank 0 (its part-way state rank 0's alone): the same tokens,
    and an image finished piece by piece enters rank 0's encoder cache (the first picture under other text hits)."""
    _check_split_run("layer-chunked", *runs[CHUNKED])


def test_follower_ranks_build_no_tower(qwen3_vl_checkpoint):
    """Rank 1's modules (built on meta, as split_check builds rank 0's): the text model split, no tower, and the
    tower's checkpoint tensors are not its to read; rank 0 reads them."""
    from engine.core.model_config import load_model_config
    from engine.distributed.collectives import TensorParallel
    from engine.models import model_class

    path, _, _ = qwen3_vl_checkpoint
    config = load_model_config(path)
    ranks = []
    for rank in (0, 1):
        tp = TensorParallel.shape_only(2)
        tp.rank = rank
        with torch.device("meta"):
            ranks.append(model_class(config)(config, moe_backend="torch", max_positions=1, tp=tp))
    leader, follower = ranks
    assert leader.visual is not None and follower.visual is None
    name = "model.visual.blocks.0.attn.qkv.weight"
    assert follower.on_other_stage(name) and not leader.on_other_stage(name)
    assert not follower.on_other_stage("model.language_model.layers.0.self_attn.q_proj.weight")
    assert not any(n.startswith("visual.") for n, _ in follower.named_parameters())


def test_expert_parallel_build_is_refused(qwen3_vl_checkpoint):
    """The model itself refuses a split its image rows are not carried through (start-up refuses it first, one
    line naming the flag: tests/engine/vision/test_encoder_cache_shares.py -k refused)."""
    from engine.core.model_config import load_model_config
    from engine.distributed.collectives import TensorParallel
    from engine.models import model_class

    config = load_model_config(qwen3_vl_checkpoint[0])
    tp = TensorParallel.shape_only(2)
    tp.expert_parallel = object()  # any expert-parallel layout
    with torch.device("meta"), pytest.raises(ValueError, match="not served with pipeline or expert parallelism"):
        model_class(config)(config, moe_backend="torch", max_positions=1, tp=tp)
