"""Objects built whole: a rank's runner, its sampler and rank 0's scheduler get every part the settings ask for in
their constructors (``engine.ranks.rank_builder``), on rank 0 and on a follower alike, and no engine code sets
one of those parts on them afterwards."""

import ast
import pathlib
import random

import pytest
import torch

from engine.core.config import EngineConfig, KernelChoice
from engine.core.lora_residency import LoraResidency
from engine.distributed.collectives import SINGLE
from engine.kv_tiers.rank_mirror import RankMirror
from engine.kv_tiers.store import TieredStore
from engine.llm_engine import LLMEngine
from engine.loading.demo_model import write_demo_model
from engine.ranks.rank_builder import build_rank
from engine.structured_output.matchers import GrammarMatchers
from engine.worker.draft_model import DraftProposer
from engine.worker.lora_setup import LoraAdapters
from engine.worker.model_setup import engine_model_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The parts the builder hands to the constructors (``RunnerParts``, ``Sampler``'s grammars, ``Scheduler``'s lora).
PARTS = {"eplb", "lora", "draft", "tiers", "tier_mirror", "grammars", "decode_graphs", "piecewise_graphs",
         "micro_batches", "stage_zero", "sampler"}
OWNERS = ("runner", "scheduler", "sampler")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("demo"))
    write_demo_model(path, seed=random.randrange(1000))
    return path


def _config(demo: str, **fields) -> EngineConfig:
    return EngineConfig(model=demo, device="cpu", dtype="float32", num_kv_blocks=16, block_size=4,
                        max_num_batched_tokens=32, max_model_len=64, seed=random.randrange(1000), **fields)


@pytest.mark.parametrize("features", ["plain", "lora+tiers", "draft"])
def test_rank_zero_gets_each_part_it_asks_for_and_no_other(demo, features):
    fields = {"plain": {}, "lora+tiers": {"enable_lora": True, "host_cache_gb": 0.001},
              "draft": {"speculative": "draft", "speculative_model": demo, "overlap_scheduling": False}}[features]
    engine = LLMEngine(_config(demo, **fields))
    try:
        runner, scheduler = engine.runner, engine.scheduler
        assert isinstance(runner.sampler.grammars, GrammarMatchers)  # the demo model has a tokenizer
        assert isinstance(runner.lora, LoraAdapters) == (features == "lora+tiers")
        assert isinstance(scheduler.lora, LoraResidency) == (features == "lora+tiers")
        assert scheduler.lora is None or scheduler.lora.host is runner.lora.host
        assert isinstance(runner.tiers, TieredStore) == (features == "lora+tiers")
        assert scheduler.kv.tiers is runner.tiers
        assert isinstance(runner.draft, DraftProposer) == (features == "draft")
        assert (runner.eplb, runner.tier_mirror, runner.stage_zero, runner.decode_graphs) == (None,) * 4
        assert (runner.piecewise_graphs, runner.micro_batches) == (None, engine.config.pipeline_micro_batches)
    finally:
        engine.close()


def test_a_follower_gets_the_tier_mirror_and_no_sampling_parts(demo):
    """Built as a follower (no leader): its slice of the host tier instead of the tiers, no grammar matchers."""
    config = _config(demo, host_cache_gb=0.001, enable_lora=True)
    rank = build_rank(config, engine_model_config(config), KernelChoice(), torch.float32, torch.device("cpu"), SINGLE)
    assert isinstance(rank.runner.tier_mirror, RankMirror) and rank.runner.tiers is None
    assert rank.runner.sampler.grammars is None and isinstance(rank.runner.lora, LoraAdapters)
    assert rank.runner.kv_caches[0][0].shape[0] == rank.cache_config.num_blocks + 1  # the scratch block


def _installs(source: str, name: str) -> list[str]:
    """``owner.part = ...`` assignments (``x.owner.part`` too) in ``source``: a part set on a runner, scheduler or
    sampler by someone other than its constructor."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in (t for whole in targets for t in (whole.elts if isinstance(whole, ast.Tuple) else [whole])):
            if isinstance(target, ast.Attribute) and target.attr in PARTS and \
                    ast.unparse(target.value).split(".")[-1] in OWNERS:
                found.append(f"{name}:{target.lineno} {ast.unparse(target)}")
    return found


def test_no_engine_code_installs_a_part_after_construction():
    installs = [hit for path in sorted((ROOT / "engine").rglob("*.py"))
                for hit in _installs(path.read_text(), str(path.relative_to(ROOT)))]
    assert installs == []
    # The check sees one where there is one (and a layer's own ``lora`` is no runner's part).
    planted = "self.runner.tiers = tiers\nrunner.sampler.grammars, x = g, 1\nscheduler.lora = r\nlayer.lora = s\n"
    assert [hit.split(" ")[1] for hit in _installs(planted, "planted")] == [
        "self.runner.tiers", "runner.sampler.grammars", "scheduler.lora"]
