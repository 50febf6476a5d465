"""Leases on batch lines, on SQLite and PostgreSQL: claims never overlap, a lapsed lease is taken
over, and a line is finished (and billed) only by the runner that holds it."""

import asyncio
from dataclasses import dataclass

from tenants.batch_store import BatchStore
from tenants.quota import QuotaManager
from tenants.store import UsageRecord

from .helpers import with_store


@dataclass
class Line:
    line_no: int
    custom_id: str
    body_json: str


class Clock:
    t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def test_claims_are_disjoint_lapsed_leases_move_and_finish_is_exactly_once(db_url):
    async def body(store):
        t = await store.create_tenant("acme")
        clock = Clock()
        bs = BatchStore(store, QuotaManager(store), clock=clock)
        lines = [Line(i + 1, f"c{i}", "{}") for i in range(10)]
        b = await bs.create_batch(t.id, "/v1/completions", "file-x", 3600, "24h", None, "m", lines, None, 0)
        a_lines, b_lines = await asyncio.gather(bs.claim("A", 4, 30), bs.claim("B", 4, 30))
        ids_a, ids_b = {l.id for l in a_lines}, {l.id for l in b_lines}
        assert len(ids_a) == len(ids_b) == 4 and not ids_a & ids_b  # never the same line twice
        rest = await bs.claim("C", 10, 30)
        assert len(rest) == 2 and not {l.id for l in rest} & (ids_a | ids_b)
        assert await bs.claim("C", 10, 30) == []  # all held

        usage = UsageRecord(t.id, "r", "m", 10, 6)
        assert await bs.finish("A", a_lines[0], True, {"ok": 1}, usage)
        assert not await bs.finish("A", a_lines[0], True, {"ok": 2}, usage)  # already finished
        clock.t += 31  # A's and B's leases lapse: A crashed
        await bs.renew("B", [l.id for l in b_lines], 30)  # ... but B is alive and renews
        taken = await bs.claim("D", 10, 30)
        assert {l.id for l in taken} == ({l.id for l in a_lines[1:]} | {l.id for l in rest})
        assert not await bs.finish("A", a_lines[1], True, {"late": True}, usage)  # A lost it: nothing written
        assert await bs.finish("D", taken[0], False, {"error": 1}, None)
        for line in taken[1:]:
            assert await bs.finish("D", line, True, {"ok": 3}, usage)
        for line in b_lines:
            assert await bs.finish("B", line, True, {"ok": 4}, usage)
        counts = await bs.line_counts(b.id)
        assert counts == {"done": 9, "failed": 1}
        assert await bs.ready_to_finalize() == [b.id]
        got = await bs.get_batch(t.id, b.id)
        assert (got.completed, got.failed) == (9, 1)
        rows = await store.usage_summary("acme", by="tenant")
        assert rows[0]["kind"] == "batch" and rows[0]["requests"] == 9  # billed once per finished line
        assert rows[0]["billed_tokens"] == 9 * 8  # 16 tokens at the default half price
        assert await bs.get_batch(t.id + 1, b.id) is None  # another tenant does not see it

    with_store(db_url, body)
