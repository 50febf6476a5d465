"""The expert rebalancing policy against independent references: the best placement found by trying every one
(float64), token-by-token routing through the real placement map, and a replay of the weight copies."""

import itertools
import random

import numpy as np
import pytest
import torch

from engine.eplb.placement import ExpertPlacement
from engine.eplb.policy import EMPTY, imbalance, place_layer, rank_loads
from engine.eplb.transfer import plan_copies


def best_imbalance(load: list[float], num_ranks: int, slots_per_rank: int) -> float:
    """The lowest max/mean rank load of any placement (each rank S distinct experts, every expert somewhere, load
    spread evenly over an expert's replicas), by trying them all, in float64."""
    w = np.asarray(load, dtype=np.float64)
    best = np.inf
    for choice in itertools.product(itertools.combinations(range(len(load)), slots_per_rank), repeat=num_ranks):
        counts = np.bincount(np.concatenate(choice), minlength=len(load)).astype(np.float64)
        if (counts == 0).any():
            continue
        per_rank = np.array([(w[list(c)] / counts[list(c)]).sum() for c in choice])
        best = min(best, per_rank.max() / per_rank.mean())
    return float(best)


def reference_rank_loads(load: list[float], placement: list[int], num_ranks: int) -> np.ndarray:
    """Each rank's load under ``placement`` in float64, computed apart from the policy's own arithmetic."""
    w = np.asarray(load, dtype=np.float64)
    slots = np.asarray(placement)
    counts = np.bincount(slots[slots != EMPTY], minlength=len(load)).astype(np.float64)
    per_slot = np.where(slots != EMPTY, w[np.maximum(slots, 0)] / counts[np.maximum(slots, 0)], 0.0)
    return per_slot.reshape(num_ranks, -1).sum(axis=1)


def check_valid(placement: list[int], current: list[int], num_experts: int, num_ranks: int, slots: int) -> None:
    assert len(placement) == num_ranks * slots and EMPTY not in placement
    assert set(placement) == set(range(num_experts))  # every expert held
    for r in range(num_ranks):
        mine = placement[r * slots:(r + 1) * slots]
        assert len(set(mine)) == slots, f"rank {r} holds an expert twice: {mine}"
        was = current[r * slots:(r + 1) * slots]
        for i, e in enumerate(was):  # an expert that stays on its rank stays in its slot (nothing copied)
            if e != EMPTY and e in mine:
                assert mine[i] == e, (was, mine)


def random_load(rng: random.Random, num_experts: int) -> list[float]:
    return [rng.choice([0.0, 1.0, 5.0, 20.0, 100.0]) * rng.random() for _ in range(num_experts)]


@pytest.mark.timeout(120)
def test_placements_are_within_a_quarter_of_the_best_and_their_predicted_load_is_exact():
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    for _ in range(40):
        num_experts, num_ranks, slots = rng.choice([(6, 2, 4), (8, 2, 5), (6, 3, 3), (6, 2, 3), (8, 2, 4), (4, 2, 3)])
        load = random_load(rng, num_experts)
        if sum(load) == 0:
            continue
        current = list(range(num_experts)) + [EMPTY] * (num_ranks * slots - num_experts)
        rng.shuffle(current)  # any placement holding each expert once
        placement = place_layer(load, num_ranks, slots, current)
        check_valid(placement, current, num_experts, num_ranks, slots)
        predicted = rank_loads(load, placement, num_ranks)
        np.testing.assert_allclose(predicted, reference_rank_loads(load, placement, num_ranks), rtol=1e-12, atol=1e-12)
        ratio = imbalance(predicted) / best_imbalance(load, num_ranks, slots)
        assert ratio >= 1 - 1e-9, (seed, load, placement)  # nothing beats trying every placement
        assert ratio <= 1.25, f"seed={seed} load={load} placement={placement}: {ratio:.3f} x the best"


@pytest.mark.timeout(60)
def test_skewed_routing_is_balanced_and_tokens_spread_over_replicas_as_predicted():
    """16 experts, 2 of them taking 40% of the picks, over 4 ranks with 4 spare slots (the benchmark's shape):
    contiguous experts put them on one rank (imbalance >= 1.5); rebalanced, routing real tokens through the
    placement map gives each rank the load the policy predicted, within 3%, and an imbalance <= 1.15."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    num_experts, num_ranks, slots, top_k, tokens = 16, 4, 5, 2, 20000
    probs = torch.full((num_experts,), 0.6 / 14)
    probs[:2] = 0.2
    hot = torch.multinomial(probs.expand(tokens, -1), top_k, replacement=False, generator=gen)  # [T, k] logical
    load = torch.bincount(hot.flatten(), minlength=num_experts).tolist()
    current = [e for r in range(num_ranks) for e in list(range(4 * r, 4 * r + 4)) + [EMPTY]]
    assert imbalance(rank_loads(load, current, num_ranks)) >= 1.5
    placement = place_layer(load, num_ranks, slots, current)
    check_valid(placement, current, num_experts, num_ranks, slots)
    predicted = np.asarray(rank_loads(load, placement, num_ranks))
    assert imbalance(predicted.tolist()) <= 1.15, (load, placement)
    mapped = ExpertPlacement(placement, num_experts, torch.device("cpu"))
    physical = mapped.to_physical(hot)  # [T, k] slots, as the MoE block dispatches them
    assert torch.equal(torch.tensor(placement)[physical.long()], hot)  # each pick reaches a replica of its expert
    measured = torch.bincount(physical.flatten().long(), minlength=num_ranks * slots).view(num_ranks, slots).sum(1)
    assert torch.equal(mapped.slot_tokens.view(num_ranks, slots).sum(1), measured)
    np.testing.assert_allclose(measured.double().numpy(), predicted, rtol=0.03)


@pytest.mark.timeout(30)
def test_the_planned_copies_turn_the_old_placement_into_the_new():
    rng = random.Random()
    for _ in range(50):
        num_experts, num_ranks = rng.choice([(8, 2), (16, 4), (6, 3)])
        slots = num_experts // num_ranks + rng.randint(0, 2)
        old = [e for r in range(num_ranks) for e in
               list(range(r * num_experts // num_ranks, (r + 1) * num_experts // num_ranks))
               + [EMPTY] * (slots - num_experts // num_ranks)]
        new = place_layer(random_load(rng, num_experts), num_ranks, slots, old)
        held = list(old)  # what each slot holds, replayed: every copy reads the old placement (staged)
        for c in plan_copies(old, new, slots):
            assert old[c.src] == new[c.dst]
            held[c.dst] = old[c.src]
        assert held == new


@pytest.mark.timeout(60)
def test_bad_balancing_settings_are_refused_before_any_process_starts(tmp_path):
    from engine.core.config import EngineConfig
    from engine.loading.split_check import check_split
    from engine.core.model_config import load_model_config
    from tests.hf_models import make_hf_model

    make_hf_model("mixtral", str(tmp_path), seed=random.randrange(2**31), vocab_size=97)  # 8 experts
    model_config = load_model_config(str(tmp_path))
    split = dict(model=str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True)
    check_split(model_config, EngineConfig(**split, num_redundant_experts=2))  # 10 slots: 5 a rank
    for spare in (1, 10):  # 9 slots do not divide by 2; 18 would put 9 slots for 8 experts on a rank
        with pytest.raises(ValueError, match="num_redundant_experts"):
            check_split(model_config, EngineConfig(**split, num_redundant_experts=spare))
    for bad, says in ((dict(enable_expert_parallel=False), "enable_expert_parallel"),
                      (dict(tensor_parallel_size=1), "tensor_parallel_size"),
                      (dict(num_redundant_experts=-1), "num_redundant_experts"),
                      (dict(eplb_interval_steps=0), "eplb_interval_steps"),
                      (dict(enable_eplb=False, num_redundant_experts=2), "enable_eplb")):
        with pytest.raises(ValueError, match=says):
            EngineConfig(**{**split, **bad})


def test_a_layer_moves_only_for_a_real_gain():
    from engine.eplb.policy import rebalance

    rng = random.Random()
    current = [0, 1, 2, 3, EMPTY, 4, 5, 6, 7, EMPTY]  # 8 experts on 2 ranks, a spare slot each
    even = [rng.uniform(99, 101) for _ in range(8)]  # within 2% per expert: no placement gains 0.02
    skewed = [rng.uniform(0, 1) for _ in range(7)] + [100.0]  # expert 7 takes nearly everything
    idle = [0.0] * 8
    kept_even, moved, kept_idle = rebalance([even, skewed, idle], 2, 5, [current] * 3)
    assert kept_even == current and kept_idle == current
    assert moved != current and moved.count(7) == 2  # the hot expert replicated onto both ranks
    assert imbalance(rank_loads(skewed, moved, 2)) < imbalance(rank_loads(skewed, current, 2)) - 0.02


def test_a_new_placement_is_installed_in_the_same_device_tables():
    """A rebalance refills the tables in place: captured CUDA graphs hold their addresses, so a new table object
    would leave every graph replaying the old map (tokens sent to slots that now hold other experts)."""
    rng = random.Random()
    num_experts, num_ranks, slots = 8, 2, 6  # 4 spare slots
    first = [e for r in range(num_ranks) for e in list(range(4 * r, 4 * r + 4)) + [EMPTY, EMPTY]]
    mapped = ExpertPlacement(first, num_experts, torch.device("cpu"))
    tables = [t.data_ptr() for t in (mapped.replicas, mapped.slots, mapped.slot_tokens)]
    mapped.to_physical(torch.randint(0, num_experts, (50, 2)))
    for _ in range(3):  # each: the 4 spare slots given to random experts (one of them up to 5 replicas)
        new = list(range(num_experts)) + [rng.randrange(num_experts) for _ in range(num_ranks * slots - num_experts)]
        rng.shuffle(new)
        mapped.update(new)
        assert [t.data_ptr() for t in (mapped.replicas, mapped.slots, mapped.slot_tokens)] == tables
        assert int(mapped.slot_tokens.sum()) == 0
        hot = torch.randint(0, num_experts, (200, 2))
        physical = mapped.to_physical(hot)
        assert torch.equal(torch.tensor(new)[physical.long()], hot)  # every pick reaches a replica of its expert
        assert torch.equal(mapped.slot_tokens, torch.bincount(physical.flatten().long(), minlength=len(new)))
    with pytest.raises(ValueError, match="keep the 12 slots"):
        mapped.update(new[:-1])
