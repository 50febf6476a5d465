"""Service-level objectives per priority class: the 0011 migration on both backends, ``admin class set``, and the
ledger's goodput and attainment against a plain loop over the same random rows."""

import random
from datetime import datetime

import pytest
from sqlalchemy import create_engine, pool, text

from tenants import migrate
from tenants.db import sync_url
from tenants.store import UsageRecord

from .helpers import cli, with_store


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
    return request.getfixturevalue("pg_server").create_database()


def _rows(url: str, sql: str) -> list[tuple]:
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            result = conn.execute(text(sql))
            return [tuple(r) for r in result] if result.returns_rows else []
    finally:
        engine.dispose()


def test_0011_keeps_classes_and_usage_rows_up_and_down(empty_url):
    migrate.upgrade(empty_url, "0010")
    _rows(empty_url, "INSERT INTO tenants (name, priority_class, weight, status, created_at, updated_at, cache_salt) "
                     "VALUES ('acme', 'realtime', 1.0, 'active', '2026-01-01', '2026-01-01', 'salt')")
    _rows(empty_url, "INSERT INTO usage (tenant_id, request_id, model, prompt_tokens, cached_prompt_tokens, "
                     "completion_tokens, billed_tokens, batch, http_status, started_at, finished_at, day) "
                     "VALUES (1, 'r1', 'm', 3, 0, 4, 7, false, 200, '2026-01-01', '2026-01-01', '2026-01-01')")
    migrate.upgrade(empty_url, "0011")
    # Existing classes: no objectives, queue; an existing usage row: no class, no verdict.
    assert _rows(empty_url, "SELECT name, ttft_slo_ms, itl_slo_ms, slo_action FROM priority_classes ORDER BY rank") == [
        ("realtime", None, None, "queue"), ("standard", None, None, "queue"), ("batch", None, None, "queue")]
    assert _rows(empty_url, "SELECT request_id, priority_class, slo_met FROM usage") == [("r1", None, None)]
    with pytest.raises(Exception, match="ck_priority_classes_slo_action|CHECK constraint"):
        _rows(empty_url, "UPDATE priority_classes SET slo_action = 'drop'")
    migrate.downgrade(empty_url, "0010")
    assert _rows(empty_url, "SELECT request_id, completion_tokens FROM usage") == [("r1", 4)]
    assert len(_rows(empty_url, "SELECT name FROM priority_classes")) == 3
    migrate.upgrade(empty_url)
    assert migrate.current_revision(empty_url) == migrate.head_revision()


def test_class_set_and_list(db_url, capsys):
    code, out, _ = cli(capsys, db_url, "admin", "class", "set", "realtime", "--ttft-slo-ms", "500",
                       "--itl-slo-ms", "60", "--slo-action", "refuse", as_json=True)
    assert code == 0 and (out["ttft_slo_ms"], out["itl_slo_ms"], out["slo_action"]) == (500, 60, "refuse")
    out = cli(capsys, db_url, "admin", "class", "set", "realtime", "--itl-slo-ms", "none", as_json=True)[1]
    assert (out["ttft_slo_ms"], out["itl_slo_ms"], out["slo_action"]) == (500, None, "refuse")  # the rest stays
    listed = {c["name"]: c for c in cli(capsys, db_url, "admin", "class", "list", as_json=True)[1]}
    assert (listed["realtime"]["ttft_slo_ms"], listed["realtime"]["slo_action"]) == (500, "refuse")
    assert listed["batch"]["ttft_slo_ms"] is None and listed["batch"]["slo_action"] == "queue"
    code, table, _ = cli(capsys, db_url, "admin", "class", "list")
    assert code == 0 and "500" in table
    # update keeps the objectives
    out = cli(capsys, db_url, "admin", "class", "update", "realtime", "--weight", "2", as_json=True)[1]
    assert out["ttft_slo_ms"] == 500


BAD_INPUT = [
    (["--ttft-slo-ms", "-5"], "must be > 0"),
    (["--ttft-slo-ms", "0"], "must be > 0"),
    (["--itl-slo-ms", "fast"], "positive number of milliseconds"),
    (["--slo-action", "drop"], "invalid choice"),
    ([], "nothing to set"),
]


def test_class_set_bad_input_exits_2_with_one_line(db_url, capsys):
    before = cli(capsys, db_url, "admin", "class", "list", as_json=True)[1]
    for argv, message in BAD_INPUT:  # one database for all: each must change nothing
        code, out, err = cli(capsys, db_url, "admin", "class", "set", "realtime", *argv)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err, (argv, err)
    code, _, err = cli(capsys, db_url, "admin", "class", "set", "nope", "--ttft-slo-ms", "5")
    assert code == 2 and "unknown priority class" in err
    assert cli(capsys, db_url, "admin", "class", "list", as_json=True)[1] == before


def test_usage_goodput_and_attainment_by_tenant_and_class(db_url, capsys):
    rng = random.Random()
    for name in ("acme", "zeta"):
        cli(capsys, db_url, "admin", "tenant", "create", name)
    records = []

    async def body(store):
        ids = {t: (await store.get_tenant(t)).id for t in ("acme", "zeta")}
        for i in range(40):
            tenant = rng.choice(["acme", "zeta"])
            records.append(UsageRecord(
                ids[tenant], f"r{i}", "m", rng.randrange(1, 50), rng.randrange(0, 80),
                http_status=rng.choice([200, 200, 200, 503]), priority_class=rng.choice(["realtime", "batch"]),
                slo_met=rng.choice([True, False, None]), finished_at=datetime(2026, 1, 2, 3)))
        await store.record_usage(records)
        return {v: k for k, v in ids.items()}

    names = with_store(db_url, body)
    for by, key in (("tenant", lambda r: names[r.tenant_id]), ("class", lambda r: r.priority_class)):
        rows = {row[by]: row for row in cli(capsys, db_url, "admin", "usage", "--by", by, as_json=True)[1]}
        for group in {key(r) for r in records}:
            mine = [r for r in records if key(r) == group]
            judged = [r for r in mine if r.slo_met is not None]
            met = sum(1 for r in judged if r.slo_met)
            good = sum(r.completion_tokens for r in mine if r.http_status == 200 and r.slo_met is not False)
            row = rows[group]
            assert (row["slo_requests"], row["slo_met"], row["goodput_tokens"]) == (len(judged), met, good)
            assert row["attainment"] == (round(met / len(judged), 4) if judged else None)
    assert cli(capsys, db_url, "admin", "usage", "--by", "class")[0] == 0
