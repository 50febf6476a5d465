"""The engine series in /metrics come from the engine's own statistics: per expert, and per rank when the
experts are divided among ranks."""

import random

from engine.core.stats import SchedulerStats
from gateway.engine_metrics import EngineCollector


class _Engine:
    def __init__(self, stats):
        self.info, self.dead, self.stats = object(), None, stats


def test_expert_tokens_per_expert_and_per_rank():
    rng = random.Random()
    layers, experts = rng.randint(1, 4), rng.randint(2, 9)
    load = [[rng.randrange(100) for _ in range(experts)] for _ in range(layers)]
    split = rng.randint(1, experts - 1)  # rank 0 holds experts [0, split), rank 1 the rest
    by_rank = [sum(sum(layer[:split]) for layer in load), sum(sum(layer[split:]) for layer in load)]
    stats = SchedulerStats(0, {}, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, expert_load=load, expert_load_by_rank=by_rank)
    families = {f.name: f for f in EngineCollector(_Engine(stats)).collect()}
    per_expert = {(s.labels["layer"], s.labels["expert"]): s.value for s in families["moegate_expert_tokens"].samples
                  if s.name.endswith("_total")}
    assert per_expert == {(str(l), str(e)): load[l][e] for l in range(layers) for e in range(experts)}
    per_rank = [s.value for s in families["moegate_expert_rank_tokens"].samples if s.name.endswith("_total")]
    assert per_rank == by_rank and sum(per_rank) == sum(map(sum, load))


def test_speculative_decoding_counters():
    rng = random.Random()
    drafts, accepted, steps = rng.randint(10, 1000), rng.randint(0, 9), rng.randint(1, 9)
    stats = SchedulerStats(0, {}, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, spec_draft_tokens=drafts,
                           spec_accepted_tokens=accepted, spec_steps=steps)
    families = {f.name: f for f in EngineCollector(_Engine(stats)).collect()}
    totals = {name: [s.value for s in families[name].samples if s.name == name + "_total"]
              for name in ("moegate_spec_draft_tokens", "moegate_spec_accepted_tokens", "moegate_spec_steps")}
    assert totals == {"moegate_spec_draft_tokens": [drafts], "moegate_spec_accepted_tokens": [accepted],
                      "moegate_spec_steps": [steps]}
    assert stats.spec_acceptance_rate == accepted / drafts
    assert stats.spec_tokens_per_step == (steps + accepted) / steps


def test_prefix_tier_counters_per_tier_and_tenant():
    """Per tier and tenant, as the engine sends them over its pipe (msgpack) and the collector exports them."""
    import msgspec

    from engine.core.stats import TierStats

    rng = random.Random()
    rows = [TierStats(tier, tenant, *(rng.randrange(10**6) for _ in range(6)))
            for tier in ("host", "disk") for tenant in ("1", "2", "17")]
    stats = SchedulerStats(0, {}, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, cache_tiers=rows)
    stats = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=SchedulerStats)
    families = {f.name: f for f in EngineCollector(_Engine(stats)).collect()}
    for field in ("hits", "misses", "bytes_in", "bytes_out", "evictions", "write_errors"):
        name = f"moegate_prefix_tier_{field}"
        got = {(s.labels["tier"], s.labels["tenant"]): s.value for s in families[name].samples
               if s.name == name + "_total"}
        assert got == {(r.tier, r.tenant): getattr(r, field) for r in rows}

def test_expert_balance_series():
    rng = random.Random()
    ranks = rng.randint(2, 8)
    before = [rng.randrange(1000) for _ in range(ranks)]
    after = [rng.uniform(0, 1000) for _ in range(ranks)]
    values = dict(expert_imbalance=rng.uniform(1, 3), eplb_rebalances=rng.randint(1, 50),
                  eplb_bytes_moved=rng.randrange(1, 10**12), eplb_last_rebalance_ms=rng.uniform(0, 900),
                  eplb_replicated_experts=rng.randint(0, 64), eplb_rank_load_before=before, eplb_rank_load_after=after,
                  eplb_imbalance_before=rng.uniform(1, 3), eplb_imbalance_after=rng.uniform(1, 3))
    stats = SchedulerStats(0, {}, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, **values)
    families = {f.name: f for f in EngineCollector(_Engine(stats)).collect()}

    def one(name, suffix=""):
        [sample] = [s for s in families[name].samples if s.name == name + suffix]
        return sample.value

    assert one("moegate_expert_imbalance") == values["expert_imbalance"]
    assert one("moegate_eplb_rebalances", "_total") == values["eplb_rebalances"]
    assert one("moegate_eplb_moved_bytes", "_total") == values["eplb_bytes_moved"]
    assert one("moegate_eplb_last_rebalance_seconds") == values["eplb_last_rebalance_ms"] / 1e3
    assert one("moegate_eplb_replicated_experts") == values["eplb_replicated_experts"]
    loads = {(s.labels["when"], int(s.labels["rank"])): s.value for s in families["moegate_eplb_rank_tokens"].samples}
    assert loads == {**{("before", r): v for r, v in enumerate(before)}, **{("after", r): v for r, v in enumerate(after)}}
    ratios = {s.labels["when"]: s.value for s in families["moegate_eplb_imbalance"].samples}
    assert ratios == {"before": values["eplb_imbalance_before"], "after": values["eplb_imbalance_after"]}


def test_no_balance_series_without_divided_experts():
    stats = SchedulerStats(0, {}, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0)
    names = {f.name for f in EngineCollector(_Engine(stats)).collect()}
    assert not any(n.startswith(("moegate_eplb", "moegate_expert_imbalance")) for n in names), names
