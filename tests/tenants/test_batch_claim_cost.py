"""The batch runner's hot path on SQLite costs the lines it touches, not the lines waiting in the table.

SQLite has no statistics by default, so its planner can pick a status index over a list of ids, or
sort every pending line to take the first few. Neither shows in a small test's timings, so this
counts SQLite's virtual-machine steps (``set_progress_handler``) for the same claim, lease renewal
and result write with a few hundred lines waiting and with many thousands: the plans this replaced
did 10-40x more steps on the big table.
"""

import asyncio
import random
from dataclasses import dataclass

from tenants.batch_store import BatchStore, FinishedLine
from tenants.migrate import upgrade
from tenants.quota import QuotaManager
from tenants.store import TenantStore, UsageRecord
from tenants.sync_transactions import SyncTransactions

STEPS_PER_TICK = 100


@dataclass
class Line:
    line_no: int
    custom_id: str
    body_json: str


def _count_vm_steps(monkeypatch) -> dict[str, int]:
    """Counts SQLite VM steps per hot-path transaction kind (the body's name)."""
    steps: dict[str, int] = {}

    def in_transaction(self, body, args):
        name = body.__name__
        with self._engine_for_thread().begin() as connection:
            raw = connection.connection.driver_connection

            def tick() -> int:
                steps[name] = steps.get(name, 0) + STEPS_PER_TICK
                return 0  # 0: go on

            raw.set_progress_handler(tick, STEPS_PER_TICK)
            try:
                return body(connection, *args)
            finally:
                raw.set_progress_handler(None, STEPS_PER_TICK)

    monkeypatch.setattr(SyncTransactions, "_in_transaction", in_transaction)
    return steps


def _hot_path_steps(tmp_path, monkeypatch, waiting: int, name: str) -> dict[str, int]:
    url = f"sqlite:///{tmp_path / name}"
    upgrade(url)
    steps = _count_vm_steps(monkeypatch)

    async def main():
        store = TenantStore.open(url)
        batches = BatchStore(store, QuotaManager(store))
        try:
            tenant = await store.create_tenant("acme")
            for b in range(2):  # an older batch and a newer one, both open
                await batches.create_batch(tenant.id, "/v1/completions", "file-x", 3600, "24h", None, "m",
                                           [Line(i + 1, f"c{i}", "{}") for i in range(waiting)], None, 0)
            # Another gateway has lines in flight (the same number either way: looking for lapsed leases
            # walks the running lines, which are bounded by the gateways' in-flight limits).
            await batches.claim("other", 128, 60)
            steps.clear()
            mine = await batches.claim("me", 32, 60)
            assert len(mine) == 32
            await batches.renew("me", [line.id for line in mine], 60)
            written = await batches.finish_many("me", [
                FinishedLine(line, True, {"custom_id": line.custom_id}, UsageRecord(tenant.id, f"r{line.id}", "m", 3, 5))
                for line in mine])
            assert all(written)
            return dict(steps)
        finally:
            await batches.close()
            await store.close()

    return asyncio.run(main())


def test_claim_renew_and_finish_do_not_walk_the_waiting_lines(tmp_path, monkeypatch):
    small_n, big_n = random.randint(200, 300), random.randint(12_000, 14_000)
    small = _hot_path_steps(tmp_path, monkeypatch, small_n, "small.db")
    big = _hot_path_steps(tmp_path, monkeypatch, big_n, "big.db")
    assert set(small) == set(big) == {"_claim", "_renew", "_finish_many"}, (small, big)
    for kind in small:
        # The same 32 lines either way; a B-tree a few levels deeper may cost a little more per lookup.
        assert big[kind] < 2 * small[kind] + 5 * STEPS_PER_TICK, (kind, small, big, small_n, big_n)
