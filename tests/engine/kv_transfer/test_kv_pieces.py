"""A transfer in pieces (engine.kv_transfer.p2p over a real gloo pair, both ends in this process): the pieces
arrive bit for bit in the blocks asked for; a load aborted between pieces writes nothing more (the rest is drained
and dropped, the blocks it would have filled keep what was written there since) and the pair carries the next
transfer; a transfer whose sender loses the blocks after a piece ends as failed."""

import random
import time

import pytest
import torch

from engine.kv_transfer.block_io import BlockLayout
from engine.kv_transfer.p2p import P2PConnector


def _caches(num_blocks: int, block_size: int, generator) -> list[tuple[torch.Tensor, ...]]:
    return [(torch.randn(num_blocks + 1, block_size, 2, 8, generator=generator),
             torch.randn(num_blocks + 1, block_size, 2, 8, generator=generator)) for _ in range(2)]


def _poll(connector: P2PConnector, until, timeout_s: float = 20.0) -> list:
    """``done()`` until ``until(results so far)``; the results."""
    results: list = []
    deadline = time.monotonic() + timeout_s
    while not until(results):
        assert time.monotonic() < deadline, results
        results += connector.done()
        time.sleep(0.005)
    return results


def _equal(caches, ids, source, src_ids) -> bool:
    return all(torch.equal(t[d], s[i]) for layer, src in zip(caches, source) for t, s in zip(layer, src)
               for d, i in zip(ids, src_ids))


@pytest.mark.timeout(60)
def test_pieces_arrive_in_place_and_an_abort_between_pieces_writes_nothing_more():
    rng = random.Random()
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    num_blocks, block_size = 40, rng.choice([2, 4])
    source, target = _caches(num_blocks, block_size, g), _caches(num_blocks, block_size, g)
    decode = P2PConnector(BlockLayout(target), "decode", "127.0.0.1", 10.0)
    prefill = P2PConnector(BlockLayout(source), "prefill", None, 10.0)
    try:
        decode.pair("t", 0, decode.address)
        prefill.pair("t", 1, decode.address)

        # 1. Three pieces of random sizes: every block lands where asked, no other block changes.
        n = rng.randint(6, 12)
        src, dst = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
        before = [[t.clone() for t in layer] for layer in target]
        cuts = sorted(rng.sample(range(1, n), 2))
        decode.load_blocks("t", 0, dst)
        for a, b in zip([0] + cuts, cuts + [n]):
            prefill.save_blocks("t", 0, src[a:b], a, last=b == n)
        results = _poll(decode, lambda r: r)
        assert [(r.transfer_id, r.ok, r.pieces) for r in results] == [(0, True, 3)]
        assert _equal(target, dst, source, src)
        untouched = [b for b in range(num_blocks + 1) if b not in dst]
        assert all(torch.equal(t[untouched], o[untouched]) for layer, old in zip(target, before)
                   for t, o in zip(layer, old))
        sent = _poll(prefill, lambda r: r)
        assert [(r.transfer_id, r.ok, r.pieces) for r in sent] == [(0, True, 3)]

        # 2. Aborted after its first piece arrived: the blocks are reused (new contents written), the rest of the
        # transfer still comes and is dropped, and the pair carries the next transfer.
        src, dst = rng.sample(range(num_blocks), 6), rng.sample(range(num_blocks), 6)
        decode.load_blocks("t", 1, dst)
        prefill.save_blocks("t", 1, src[:2], 0, last=False)
        _poll(decode, lambda r: _equal(target, dst[:2], source, src[:2]))
        decode.abort("t", 1)
        reused = [[t[dst].clone().normal_(generator=g) for t in layer] for layer in target]
        for layer, new in zip(target, reused):
            for t, x in zip(layer, new):
                t[dst] = x
        prefill.save_blocks("t", 1, src[2:], 2, last=True)
        src2, dst2 = rng.sample(range(num_blocks), 3), [b for b in range(num_blocks) if b not in dst][:3]
        decode.load_blocks("t", 2, dst2)
        prefill.save_blocks("t", 2, src2, 0, last=True)
        results = _poll(decode, lambda r: r)  # transfer 2 came after transfer 1's rest: that was drained first
        assert [(r.transfer_id, r.ok) for r in results] == [(2, True)]
        assert _equal(target, dst2, source, src2)
        assert all(torch.equal(t[dst], x) for layer, new in zip(target, reused) for t, x in zip(layer, new))

        # 3. The sender loses the blocks after a piece: the load ends failed (the engine then prefills itself).
        decode.load_blocks("t", 3, rng.sample(range(num_blocks), 4))
        prefill.save_blocks("t", 3, src[:1], 0, last=False)
        prefill.save_blocks("t", 3, None)
        results = _poll(decode, lambda r: r)
        assert [(r.transfer_id, r.ok) for r in results] == [(3, False)] and "no longer held" in results[0].error
        assert not decode.pending
    finally:
        prefill.close()
        decode.close()
