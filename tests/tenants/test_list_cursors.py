"""List cursors (``after``) are the caller's own: another tenant's file or batch id, given as ``after``, pages
exactly as an id that does not exist, so a tenant learns nothing of another's rows (not even when one was made),
on SQLite and PostgreSQL."""

import asyncio
import random

from tenants.batch_store import BatchStore
from tenants.quota import QuotaManager

from .helpers import with_store


def test_another_tenants_id_as_a_cursor_pages_like_an_unknown_one(db_url, tmp_path):
    async def body(store):
        mine, theirs = await store.create_tenant("mine"), await store.create_tenant("theirs")
        batches = BatchStore(store, QuotaManager(store))
        content = tmp_path / "in.jsonl"
        content.write_bytes(b"{}\n")
        # Mine, theirs, mine: the other tenant's file and batch fall between the caller's own (random counts).
        before, after = random.randint(1, 3), random.randint(1, 3)
        for n in range(before):
            await batches.add_file(mine.id, f"early{n}", "batch", content)
            await batches.create_batch(mine.id, "/v1/completions", "file-x", 3600, "24h", None, "m", [], None, 0)
            await asyncio.sleep(0.002)  # distinct created_at stamps
        other_file = await batches.add_file(theirs.id, "secret", "batch", content)
        other_batch = await batches.create_batch(theirs.id, "/v1/completions", other_file.id, 3600, "24h", None, "m",
                                                 [], None, 0)
        for n in range(after):
            await asyncio.sleep(0.002)
            await batches.add_file(mine.id, f"late{n}", "batch", content)
            await batches.create_batch(mine.id, "/v1/completions", "file-x", 3600, "24h", None, "m", [], None, 0)
        unknown_file, unknown_batch = "file-" + "0" * 24, "batch_" + "0" * 24
        for newest_first in (True, False):
            files = [f.id for f in (await batches.list_files(mine.id, None, other_file.id, 100, newest_first))[0]]
            assert files == [f.id for f in (await batches.list_files(mine.id, None, unknown_file, 100,
                                                                     newest_first))[0]]
            assert len(files) == before + after
        listed = [b.id for b in (await batches.list_batches(mine.id, other_batch.id, 100))[0]]
        assert listed == [b.id for b in (await batches.list_batches(mine.id, unknown_batch, 100))[0]]
        assert len(listed) == before + after
        # The caller's own ids still page.
        own = (await batches.list_files(mine.id, None, None, 1))[0][0]
        assert len((await batches.list_files(mine.id, None, own.id, 100))[0]) == before + after - 1
        await batches.close()

    with_store(db_url, body)
