"""Two uploads (or two stored responses) of one tenant at once, from two gateways sharing the database (two
stores, their own connections), on SQLite and PostgreSQL: the stored-files cap (the stored-responses cap) holds,
exactly one of them is stored.

Each one's read of the tenant's stored bytes waits (up to ``MEET_S``) until the other has read them too. Where
the check and the insert are not one atomic step, both read the same sum, both pass, and the tenant ends past its
cap; where they are, the second upload cannot read the sum until the first has committed, so its wait at the
meeting point ends by the timeout and it then sees the first file and is refused."""

import asyncio
import random

import pytest

from tenants.batch_store import BatchStore, StorageFull
from tenants.response_store import ResponseStore, StoredResponsesFull
from tenants.quota import QuotaManager
from tenants.store import TenantStore

MEET_S = 1.0  # below PostgreSQL's lock wait limit (tenants.db.DatabaseTimeouts.lock_s, 2 s)


@pytest.mark.timeout(60)
def test_concurrent_uploads_never_pass_the_stored_files_cap(db_url, tmp_path, monkeypatch):
    rng = random.Random()
    size = rng.randrange(1000, 5000)
    cap = size + rng.randrange(size)  # room for one file, not two
    files = []
    for i in range(2):
        path = tmp_path / f"upload-{i}.jsonl"
        path.write_bytes(bytes(rng.randrange(256) for _ in range(size)))
        files.append(path)

    meet = _meet_after_reading(monkeypatch, BatchStore)

    async def main():
        stores = [TenantStore.open(db_url) for _ in range(2)]
        try:
            tenant = await stores[0].create_tenant("acme")
            gateways = [BatchStore(store, QuotaManager(store)) for store in stores]
            for g in gateways:  # connections open before the race, so both reach the meeting point quickly
                assert await g.stored_bytes(tenant.id) == 0
            meet.arm()
            results = await asyncio.gather(
                *(g.add_file(tenant.id, f"f{i}.jsonl", "batch", files[i], max_stored_bytes=cap)
                  for i, g in enumerate(gateways)), return_exceptions=True)
            meet.disarm()
            return results, await gateways[0].stored_bytes(tenant.id)
        finally:
            for store in stores:
                await store.close()

    results, stored = asyncio.run(main())
    refused = [r for r in results if isinstance(r, StorageFull)]
    assert len(refused) == 1 and len([r for r in results if not isinstance(r, BaseException)]) == 1, results
    assert (refused[0].used, refused[0].size, refused[0].limit) == (size, size, cap)
    assert stored == size <= cap


@pytest.mark.timeout(60)
def test_concurrent_stored_responses_never_pass_the_cap(db_url, monkeypatch):
    rng = random.Random()
    length = rng.randrange(500, 900)  # both the same size, other text
    responses = [{"id": f"resp_{i}", "object": "response", "output": [{"type": "message", "content": [
        {"type": "output_text", "text": "".join(rng.choice("abcdef ") for _ in range(length))}]}]} for i in range(2)]
    meet = _meet_after_reading(monkeypatch, ResponseStore)

    async def main():
        stores = [TenantStore.open(db_url) for _ in range(2)]
        try:
            tenant = await stores[0].create_tenant("acme")
            gateways = [ResponseStore(store, 3600) for store in stores]
            for g in gateways:
                assert await g.stored_bytes(tenant.id) == 0
            probe = await gateways[0].put(tenant.id, {**responses[0], "id": "resp_p"}, [])  # their size
            size = await gateways[0].stored_bytes(tenant.id)
            assert await gateways[0].delete(tenant.id, probe.id)
            cap = size + rng.randrange(size // 2)  # room for one of them, not two
            meet.arm()
            results = await asyncio.gather(*(g.put(tenant.id, responses[i], [], max_stored_bytes=cap)
                                             for i, g in enumerate(gateways)), return_exceptions=True)
            meet.disarm()
            return results, await gateways[0].stored_bytes(tenant.id), cap
        finally:
            for store in stores:
                await store.close()

    results, stored, cap = asyncio.run(main())
    refused = [r for r in results if isinstance(r, StoredResponsesFull)]
    assert len(refused) == 1 and len([r for r in results if not isinstance(r, BaseException)]) == 1, results
    assert refused[0].used == stored and stored <= cap < refused[0].used + refused[0].size


class _Meeting:
    """While armed, each read of a tenant's stored bytes waits (up to MEET_S) for the other one to have read."""

    def __init__(self) -> None:
        self.barrier: asyncio.Barrier | None = None

    def arm(self) -> None:
        self.barrier = asyncio.Barrier(2)

    def disarm(self) -> None:
        self.barrier = None

    async def wait(self) -> None:
        if self.barrier is not None:
            try:
                await asyncio.wait_for(self.barrier.wait(), MEET_S)
            except (TimeoutError, asyncio.BrokenBarrierError):
                pass  # the other one could not read yet (or gave up meeting): go on


def _meet_after_reading(monkeypatch, cls) -> _Meeting:
    meeting, read = _Meeting(), cls._stored_bytes

    async def read_then_meet(s, tenant_id: int) -> int:
        used = await read(s, tenant_id)
        await meeting.wait()
        return used

    monkeypatch.setattr(cls, "_stored_bytes", staticmethod(read_then_meet))
    return meeting
