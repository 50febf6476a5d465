"""The lengths the API checks names against are what the database holds: a name of the bound's length (in
characters, not bytes) is stored whole, and on PostgreSQL one character more is refused by the database itself, so
the API's check is neither looser (a refused write) nor stricter than the columns the migrations made."""

from dataclasses import dataclass

import pytest
from sqlalchemy.exc import DBAPIError

from tenants.batch_store import BatchStore
from tenants.models import MAX_CUSTOM_ID_CHARS, MAX_FILENAME_CHARS
from tenants.quota import QuotaManager

from .helpers import with_store


@dataclass
class Line:
    line_no: int
    custom_id: str
    body_json: str


def test_names_of_the_bound_fit_and_one_more_does_not_on_postgresql(db_url, tmp_path):
    content = tmp_path / "in.jsonl"
    content.write_bytes(b"{}\n")

    async def body(store):
        t = await store.create_tenant("t")
        batches = BatchStore(store, QuotaManager(store))
        try:
            name = "é" * MAX_FILENAME_CHARS
            assert (await batches.add_file(t.id, name, "batch", content)).filename == name
            listed = (await batches.list_files(t.id, None, None, 10))[0]
            assert [f.filename for f in listed] == [name]
            custom_id = "ü" * MAX_CUSTOM_ID_CHARS
            b = await batches.create_batch(t.id, "/v1/completions", "file-x", 3600, "24h", None, "m",
                                           [Line(1, custom_id, "{}")], None, 0)
            assert [row[1] for row in await batches.lines_of(b.id)] == [custom_id]
            if store.backend == "postgresql":
                with pytest.raises(DBAPIError):
                    await batches.add_file(t.id, name + "x", "batch", content)
                with pytest.raises(DBAPIError):
                    await batches.create_batch(t.id, "/v1/completions", "file-x", 3600, "24h", None, "m",
                                               [Line(1, custom_id + "x", "{}")], None, 0)
        finally:
            await batches.close()

    with_store(db_url, body)
