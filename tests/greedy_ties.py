"""Greedy tokens compared with a reference up to a near tie: where the reference's two most likely tokens are
within 1e-4 of each other, float sums in another order (another batch composition, another kernel) may break the
tie either way, and every token after it follows from that choice."""

from collections.abc import Callable

import torch

NEAR_TIE = 1e-4  # log-probability gap under which either of the two most likely tokens is a right greedy choice


def assert_greedy_equal_up_to_a_near_tie(last_logits: Callable[[list[int]], torch.Tensor], prompt: list[int],
                                         got: list[int], want: list[int], where: str) -> None:
    """``got`` equals ``want`` (over ``got``'s length), or up to a position where the reference's two most likely
    tokens are ``got``'s and ``want``'s, within ``NEAR_TIE``; nothing after that position is compared.
    ``last_logits(ids)``: the reference's logits [V] for the token after ``ids``."""
    split = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if split is None:
        assert len(got) <= len(want), where
        return
    with torch.no_grad():
        logp = torch.log_softmax(last_logits(prompt + want[:split]).double(), dim=-1)  # [V]
    gap = abs(logp[got[split]].item() - logp[want[split]].item())
    assert gap < NEAR_TIE and logp.topk(2).indices.tolist() in ([got[split], want[split]], [want[split], got[split]]), \
        f"{where}: token {split} differs ({got[split]} vs {want[split]}), not a near tie (gap {gap:.2e}); " \
        f"got {got}, want {want}"
