"""The settings that need or exclude others, as a table (``engine.core.config_rules``): each refused with the one
line the engine gave before the checks were data (the expected lines below are those, word for word), by the
first rule broken; the user's table (docs/configuration.md, ``moegate features``) is the rule table's."""

import pathlib
import re

import pytest

from engine.core.config import EngineConfig
from engine.core.config_rules import EXCLUDES, REQUIRES, RULES, feature_table
from gateway.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[3]
LORA = "lora_adapters are served with {} for now"
TIERS = "the prefix-cache tiers (host_cache_gb) "
# Settings breaking one needs/excludes rule each -> the whole refusal.
REFUSED = [
    ({"enable_lora": True, "pipeline_parallel_size": 2}, LORA.format("pipeline_parallel_size 1")),
    ({"enable_lora": True, "data_parallel_size": 2, "enable_expert_parallel": True,
      "distributed_init_method": "tcp://h:1"}, LORA.format("data_parallel_size 1")),
    ({"lora_adapters": "a=/x", "role": "decode"}, LORA.format("role 'both' (no disaggregated prefill/decode)")),
    ({"enable_lora": True, "enable_eplb": True, "enable_expert_parallel": True, "tensor_parallel_size": 2},
     LORA.format("enable_eplb off")),
    ({"speculative": "ngram", "overlap_scheduling": True},
     "speculative decoding runs with overlap_scheduling off (--no-overlap-scheduling): a step's verified tokens "
     "decide the next step's drafts"),
    ({"speculative": "draft", "speculative_model": "/d", "tensor_parallel_size": 2},
     "speculative='draft' runs on a single-process engine (tensor_parallel_size and data_parallel_size 1)"),
    ({"data_parallel_size": 2, "distributed_init_method": "tcp://h:1"},
     "data-parallel engines share work only through divided experts: set enable_expert_parallel (independent "
     "replicas need no engine setting)"),
    ({"data_parallel_size": 2, "enable_expert_parallel": True},
     "data-parallel engines meet at distributed_init_method (tcp://HOST:PORT)"),
    ({"num_redundant_experts": 2}, "num_redundant_experts needs enable_eplb (--enable-eplb): the spare slots hold "
     "replicas that only the rebalancing fills"),
    ({"enable_eplb": True, "tensor_parallel_size": 2}, "enable_eplb balances experts divided among ranks: set "
     "enable_expert_parallel and tensor_parallel_size or data_parallel_size >= 2"),
    ({"enable_eplb": True, "enable_expert_parallel": True, "tensor_parallel_size": 2, "pipeline_parallel_size": 2},
     "enable_eplb balances the experts of one stage's ranks; with pipeline_parallel_size > 1 it is not supported "
     "yet: leave one of them off"),
    ({"pipeline_parallel_size": 2, "speculative": "ngram"}, "pipeline_parallel_size > 1 runs one engine without "
     "speculative decoding (data_parallel_size 1, speculative off)"),
    ({"tensor_parallel_size": 4, "local_ranks": 2},
     "ranks on other nodes need distributed_init_method (tcp://HOST:PORT reachable from them)"),
    ({"distributed_executor_backend": "ray", "local_ranks": 1},
     "distributed_executor_backend='ray' places every rank itself: leave local_ranks and distributed_init_method "
     "unset; replicas sharing experts (data_parallel_size > 1) run on local processes for now"),
    ({"ray_address": "h:6379"}, "ray_address is the Ray cluster of distributed_executor_backend='ray' "
     "(--distributed-executor-backend ray)"),
    ({"host_cache_gb": 1.0, "disk_cache_dir": "/d"}, "disk_cache_dir and disk_cache_gb go together: set both "
     "(--disk-cache-dir DIR --disk-cache-gb N) or neither"),
    ({"disk_cache_dir": "/d", "disk_cache_gb": 1.0},
     "the disk cache tier loads through the host tier: set host_cache_gb > 0 too"),
    ({"host_cache_gb": 1.0, "enable_prefix_caching": False},
     "host_cache_gb needs enable_prefix_caching: the tiers hold prefix-cache blocks"),
    ({"host_cache_gb": 1.0, "pipeline_parallel_size": 2}, TIERS + "are not served with pipeline or data "
     "parallelism yet (tensor parallelism is): set their sizes to 1"),
    ({"host_cache_gb": 1.0, "disk_cache_dir": "/d", "disk_cache_gb": 1.0, "tensor_parallel_size": 2},
     "the disk cache tier is served by single-process engines for now: with tensor parallelism use the host tier "
     "alone (no disk_cache_dir)"),
    ({"host_cache_gb": 1.0, "speculative": "draft", "speculative_model": "/d"},
     TIERS + "do not hold the draft model's cache: use speculative='ngram' or no speculation with them"),
    ({"role": "prefill", "enable_prefix_caching": False},
     "role prefill finds the blocks it hands over by their prefix hashes: keep enable_prefix_caching on"),
    ({"role": "decode", "tensor_parallel_size": 2},
     "role decode runs in one process for now: tensor_parallel_size must be 1, got 2"),
    ({"role": "decode", "pipeline_parallel_size": 3},
     "role decode runs in one process for now: pipeline_parallel_size must be 1, got 3"),
    ({"role": "prefill", "data_parallel_size": 2, "enable_expert_parallel": True,
      "distributed_init_method": "tcp://h:1"},
     "role prefill runs in one process for now: data_parallel_size must be 1, got 2"),
]


def test_every_needs_and_excludes_rule_is_covered_once_in_table_order():
    """One case a rule, in the table's order: each case below trips the rule at its own position."""
    compat = [r for r in RULES if r.relation in (REQUIRES, EXCLUDES)]
    assert len(compat) == len(REFUSED)
    for rule, (_, message) in zip(compat, REFUSED):
        template = re.escape(re.sub(r"\{[^}]*\}", "\0", rule.message)).replace("\0", ".+")
        assert re.fullmatch(template, message), (rule.message, message)


@pytest.mark.parametrize("fields, message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_a_combination_a_rule_forbids_is_refused_with_its_line(fields, message):
    with pytest.raises(ValueError) as refused:
        EngineConfig(model="m", **fields)
    assert str(refused.value) == message


def test_values_are_still_refused_naming_the_field():
    for fields, message in [({"block_size": 12}, "block_size must be a power of two, got 12"),
                            ({"dtype": "int4"}, "dtype must be one of ('auto', 'float32', 'bfloat16', 'float16'), "
                                                "got 'int4'"),
                            ({"cuda_graph_token_sizes": (4, 9000)}, "cuda_graph_token_sizes must be token counts "
                             "between 1 and max_num_batched_tokens (2048), got (4, 9000)"),
                            ({"max_cpu_loras": 1, "max_loras": 2}, "max_cpu_loras (1) must be >= max_loras (2)"),
                            ({"distributed_init_method": "h:1"}, "--distributed-init-method must be tcp://HOST:PORT "
                             "(a port from 1 to 65535), got 'h:1'")]:
        with pytest.raises(ValueError) as refused:
            EngineConfig(model="m", **fields)
        assert str(refused.value) == message
    assert EngineConfig(model="m", cuda_graph_batch_sizes=(8, 2, 8)).cuda_graph_batch_sizes == (2, 8)


def test_the_docs_table_is_the_rule_table():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    generated = re.search(r"<!-- generated from [^\n]*-->\n(.*)<!-- end of generated table -->", doc, re.S)
    assert generated and generated.group(1) == feature_table(), \
        "docs/configuration.md is out of date: paste `moegate features --markdown` between its markers"


def test_features_command_and_the_pointer_in_engine_help(capsys):
    assert main(["features", "--markdown"]) == 0
    assert capsys.readouterr().out == feature_table()
    assert main(["features"]) == 0
    assert "host_cache_gb needs enable_prefix_caching\n    host_cache_gb needs" in capsys.readouterr().out
    for command in ("serve", "engine"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "`moegate features`" in " ".join(capsys.readouterr().out.split())
