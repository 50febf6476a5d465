import json
import random

import pytest

from tenants import migrate
from tenants.models import DEFAULT_MAX_STORED_FILE_BYTES
from tenants.store import UsageRecord

from .helpers import cli, with_store


def test_tenant_commands(db_url, capsys):
    code, out, _ = cli(capsys, db_url, "admin", "tenant", "create", "acme", "--class", "realtime", as_json=True)
    assert code == 0 and out["name"] == "acme" and out["priority_class"] == "realtime"
    code, out, err = cli(capsys, db_url, "admin", "tenant", "list")
    assert code == 0 and "acme" in out and err == ""
    code, out, _ = cli(capsys, db_url, "admin", "tenant", "update", "acme", "--weight", "3", as_json=True)
    assert out["weight"] == 3.0
    assert cli(capsys, db_url, "admin", "tenant", "disable", "acme", as_json=True)[1]["status"] == "disabled"
    assert cli(capsys, db_url, "admin", "tenant", "enable", "acme", as_json=True)[1]["status"] == "active"
    code, out, _ = cli(capsys, db_url, "admin", "tenant", "show", "acme", as_json=True)
    assert code == 0 and out["tenant"]["name"] == "acme" and out["quota"]["batch_discount"] == 0.5
    assert cli(capsys, db_url, "admin", "tenant", "show", "acme")[0] == 0


@pytest.mark.parametrize("argv, message", [
    (["admin", "tenant", "create", "acme"], "already exists"),
    (["admin", "tenant", "show", "nobody"], "unknown tenant"),
    (["admin", "tenant", "create", "x", "--class", "nope"], "unknown priority class"),
    (["admin", "quota", "set", "acme", "--rpm", "-5"], "must be >= 0"),
    (["admin", "quota", "set", "acme", "--batch-discount", "1.5"], "between 0 and 1"),
    (["admin", "quota", "set", "acme", "--cache-share", "0"], "greater than 0 and at most 1"),
    (["admin", "quota", "set", "acme", "--cache-share", "lots"], "greater than 0 and at most 1"),
    (["admin", "quota", "set", "acme"], "nothing to set"),
    (["admin", "key", "revoke", "mg-nope0"], "unknown api key"),
    (["admin", "usage", "--by", "week"], "invalid choice"),
    (["admin", "class", "create", "premium"], "--priority"),
    (["admin", "key", "create", "acme", "--expires-in", "soon"], "--expires-in"),
    (["admin", "key", "create", "acme", "--expires-in", "0d"], "--expires-in"),
    # Names and labels: the same rule on SQLite (which does not enforce String(n)) and PostgreSQL.
    (["admin", "tenant", "create", "evil\x1b[2J\x1b[31m"], "control character U+001B"),
    (["admin", "tenant", "create", "a\u202eb"], "control character U+202E"),
    (["admin", "tenant", "create", "x" * 5000], "at most 128 characters"),
    (["admin", "tenant", "update", "acme", "--name", "bell\x07"], "control character U+0007"),
    (["admin", "tenant", "update", "acme", "--name", "y" * 129], "at most 128 characters"),
    (["admin", "class", "create", "c\nlass", "--priority", "3"], "control character U+000A"),
    (["admin", "class", "create", "c" * 65, "--priority", "3"], "at most 64 characters"),
    (["admin", "key", "create", "acme", "--label", "l\x1b]0;pwned\x07"], "control character U+001B"),
    (["admin", "key", "create", "acme", "--label", "l" * 129], "at most 128 characters"),
    # Numbers past what the database's columns hold (64-bit quotas, 32-bit priorities, objectives and key ids),
    # and weights that are no number: refused by name, never a driver's traceback.
    (["admin", "quota", "set", "acme", "--max-images-per-request", str(random.randrange(2**63, 2**80))],
     "--max-images-per-request: must be at most 9223372036854775807"),
    (["admin", "quota", "set", "acme", "--rpm", "9" * random.randint(20, 40)], "--rpm: must be at most"),
    (["admin", "class", "create", "premium", "--priority", str(random.randrange(2**31, 2**70))],
     "--priority/--rank: must be at most 2147483647"),
    (["admin", "class", "set", "standard", "--ttft-slo-ms", str(random.randrange(2**31, 2**70))],
     "--ttft-slo-ms: must be at most 2147483647"),
    (["admin", "tenant", "update", "acme", "--weight", "inf"], "--weight: must be a finite number > 0"),
    (["admin", "tenant", "update", "acme", "--weight", "1e400"], "--weight: must be a finite number > 0"),
    (["admin", "key", "revoke", str(random.randrange(2**31, 2**80))], "unknown api key"),
    (["admin", "key", "create", "acme", "--expires-in", f"{random.randrange(10**8, 10**20)}d"], "--expires-in"),
])
def test_bad_input_exits_2_with_one_line_and_changes_nothing(db_url, capsys, argv, message):
    cli(capsys, db_url, "admin", "tenant", "create", "acme")
    before = cli(capsys, db_url, "admin", "tenant", "show", "acme", as_json=True)[1]
    code, out, err = cli(capsys, db_url, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err
    assert cli(capsys, db_url, "admin", "tenant", "show", "acme", as_json=True)[1] == before
    assert len(cli(capsys, db_url, "admin", "tenant", "list", as_json=True)[1]) == 1


@pytest.mark.parametrize("argv, message", [
    (["admin", "key", "revoke"], "key: unknown api key: key ids are at most 2147483647"),
    (["admin", "class", "create", "premium", "--priority"], "--priority/--rank: must be at most 2147483647"),
    (["admin", "quota", "set", "acme", "--rpm"], "--rpm: must be at most 9223372036854775807"),
    (["admin", "class", "set", "standard", "--ttft-slo-ms"], "--ttft-slo-ms: must be at most 2147483647"),
])
def test_numbers_past_pythons_digit_limit_exit_2_with_one_short_line(db_url, capsys, argv, message):
    """A whole number of more digits than Python converts (4300) is refused by its bound like any number past it,
    in one short line that counts its digits, and nothing changes."""
    cli(capsys, db_url, "admin", "tenant", "create", "acme")
    before = cli(capsys, db_url, "admin", "tenant", "show", "acme", as_json=True)[1]
    digits = random.randint(4301, 20000)
    # ASCII digits, or another script's (fullwidth, Arabic-Indic), which int() reads as well
    zero = ord(random.choice(["0", "\uff10", "\u0660"])) if "revoke" not in argv else ord("0")
    number = str(random.randint(1, 9)) + "7" * (digits - 1)
    code, out, err = cli(capsys, db_url, *argv, "".join(chr(zero + int(d)) for d in number))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err and f"{digits} digits" in err, err[:400]
    assert len(err) < 300 and "sys.set_int_max_str_digits" not in err
    assert cli(capsys, db_url, "admin", "tenant", "show", "acme", as_json=True)[1] == before


def test_key_commands(db_url, capsys):
    cli(capsys, db_url, "admin", "tenant", "create", "acme")
    code, out, _ = cli(capsys, db_url, "admin", "key", "create", "acme", "--label", "ci", as_json=True)
    assert code == 0 and out["key"].startswith("mg-") and out["prefix"] == out["key"][:8]
    code, text, err = cli(capsys, db_url, "admin", "key", "create", "acme")
    assert code == 0 and "key: mg-" in text and "only this once" in err
    listed = cli(capsys, db_url, "admin", "key", "list", "acme", as_json=True)[1]
    assert len(listed) == 2 and all("key" not in k for k in listed)  # never shown again
    assert cli(capsys, db_url, "admin", "key", "revoke", str(out["id"]), as_json=True)[1]["revoked_at"]
    assert cli(capsys, db_url, "admin", "key", "list")[0] == 0


def test_an_expired_key_stops_working(db_url, capsys):
    import asyncio
    from datetime import datetime

    cli(capsys, db_url, "admin", "tenant", "create", "acme")
    code, made, _ = cli(capsys, db_url, "admin", "key", "create", "acme", "--label", "temp", "--expires-in", "2h",
                        as_json=True)
    assert code == 0 and made["label"] == "temp"
    hours = (datetime.fromisoformat(made["expires_at"]) - datetime.fromisoformat(made["created_at"])).total_seconds() / 3600
    assert 1.99 < hours <= 2.0

    async def check(store):
        from tenants.models import ApiKey

        assert await store.authenticate(made["key"]) is not None
        async with store.sessions.begin() as s:  # two hours later
            key = await s.get(ApiKey, made["id"])
            key.expires_at = key.created_at
        assert await store.authenticate(made["key"]) is None

    with_store(db_url, check)


def test_quota_commands(db_url, capsys):
    cli(capsys, db_url, "admin", "tenant", "create", "acme")
    code, out, _ = cli(capsys, db_url, "admin", "quota", "set", "acme", "--rpm", "60", "--tpm", "1000",
                       "--max-concurrency", "4", "--max-tokens", "512", "--daily-tokens", "10000",
                       "--monthly-tokens", "100000", "--max-batch-queue-tokens", "5000",
                       "--batch-discount", "0.4", "--cache-share", "0.2", "--stored-response-bytes", "7000",
                       as_json=True)
    assert code == 0 and out == {
        "requests_per_minute": 60, "tokens_per_minute": 1000, "max_concurrency": 4, "max_tokens_per_request": 512,
        "daily_tokens": 10000, "monthly_tokens": 100000, "max_batch_queue_tokens": 5000, "batch_discount": 0.4,
        "cache_share": 0.2, "stored_response_bytes": 7000, "max_stored_file_bytes": DEFAULT_MAX_STORED_FILE_BYTES,  # not set: the default cap
        "max_images_per_request": None, "max_image_pixels": None}  # not set: the server's limits
    cli(capsys, db_url, "admin", "quota", "set", "acme", "--max-stored-file-bytes", "12345")
    assert cli(capsys, db_url, "admin", "quota", "show", "acme", as_json=True)[1]["max_stored_file_bytes"] == 12345
    cli(capsys, db_url, "admin", "quota", "set", "acme", "--tpm", "none", "--batch-discount", "none")
    out = cli(capsys, db_url, "admin", "quota", "show", "acme", as_json=True)[1]
    assert out["tokens_per_minute"] is None and out["requests_per_minute"] == 60 and out["batch_discount"] == 0.5
    assert out["cache_share"] == 0.2
    cli(capsys, db_url, "admin", "quota", "set", "acme", "--cache-share", "none")
    assert cli(capsys, db_url, "admin", "quota", "show", "acme", as_json=True)[1]["cache_share"] is None
    assert cli(capsys, db_url, "admin", "quota", "show", "acme")[0] == 0


def test_numbers_at_the_columns_edges_are_stored(db_url, capsys):
    """The largest numbers the flags take are the largest the database holds, stored and read back exactly."""
    cli(capsys, db_url, "admin", "tenant", "create", "acme")
    pixels = random.choice([2**63 - 1, random.randrange(2**62, 2**63)])
    code, out, _ = cli(capsys, db_url, "admin", "quota", "set", "acme", "--max-image-pixels", str(pixels),
                       "--rpm", str(2**63 - 1), as_json=True)
    assert code == 0 and (out["max_image_pixels"], out["requests_per_minute"]) == (pixels, 2**63 - 1)
    code, out, _ = cli(capsys, db_url, "admin", "class", "create", "edge", "--priority", str(2**31 - 1), as_json=True)
    assert code == 0 and out["priority"] == 2**31 - 1
    code, out, _ = cli(capsys, db_url, "admin", "class", "set", "edge", "--itl-slo-ms", str(2**31 - 1), as_json=True)
    assert code == 0 and out["itl_slo_ms"] == 2**31 - 1


def test_class_commands(db_url, capsys):
    code, out, _ = cli(capsys, db_url, "admin", "class", "create", "premium", "--rank", "1", "--weight", "2",
                       "--no-preemptible", "--may-preempt", as_json=True)
    assert code == 0 and out == {"name": "premium", "priority": 1, "default_weight": 2.0, "preemptible": False,
                                 "may_preempt": True, "ttft_slo_ms": None, "itl_slo_ms": None, "slo_action": "queue"}
    out = cli(capsys, db_url, "admin", "class", "update", "premium", "--preemptible", as_json=True)[1]
    assert out["preemptible"] is True and out["may_preempt"] is True
    names = [c["name"] for c in cli(capsys, db_url, "admin", "class", "list", as_json=True)[1]]
    assert names == ["realtime", "premium", "standard", "batch"]
    assert cli(capsys, db_url, "admin", "class", "list")[0] == 0


def test_usage_command(db_url, capsys):
    cli(capsys, db_url, "admin", "tenant", "create", "acme")
    from datetime import datetime

    async def body(store):
        t = await store.get_tenant("acme")
        await store.record_usage([UsageRecord(t.id, "r", "m", 3, 4, finished_at=datetime(2025, 1, 2, 3))])

    with_store(db_url, body)
    code, out, _ = cli(capsys, db_url, "admin", "usage", "acme", "--since", "2025-01-01", "--until", "2025-01-31",
                       as_json=True)
    assert code == 0 and out == [{"day": "2025-01-02", "kind": "live", "requests": 1, "prompt_tokens": 3, "cached_prompt_tokens": 0,
                                  "completion_tokens": 4, "billed_tokens": 7, "slo_requests": 0, "slo_met": 0,
                                  "goodput_tokens": 4, "attainment": None}]
    assert cli(capsys, db_url, "admin", "usage", "--by", "model", as_json=True)[1][0]["model"] == "m"
    assert cli(capsys, db_url, "admin", "usage", "--since", "2025-02-01", as_json=True)[1] == []
    assert cli(capsys, db_url, "admin", "usage", "--by", "key")[0] == 0


def test_db_upgrade_and_downgrade(tmp_path, capsys, monkeypatch):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    assert cli(capsys, url, "db", "upgrade", as_json=True)[1] == {"revision": migrate.head_revision()}
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(migrate.alembic_config(url))
    one_down = script.get_revision(migrate.head_revision()).down_revision
    assert cli(capsys, url, "db", "downgrade", as_json=True)[1] == {"revision": one_down}  # one step down
    monkeypatch.setenv("MOEGATE_DATABASE_URL", url)  # the environment picks the database too
    code, out, _ = cli(capsys, None, "db", "upgrade")
    assert code == 0 and "revision" in out


def test_admin_refuses_an_old_schema(tmp_path, capsys):
    code, out, err = cli(capsys, f"sqlite:///{tmp_path / 'old.db'}", "admin", "tenant", "list")
    assert code == 2 and "moegate db upgrade" in err and len(err.strip().splitlines()) == 1


def test_unreachable_database_exits_2(capsys):
    code, _, err = cli(capsys, "postgresql://postgres@127.0.0.1:1/none", "admin", "tenant", "list")
    assert code == 2 and "cannot use the database" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli(capsys, "mysql://x@localhost/db", "db", "upgrade")
    assert code == 2 and "unsupported database URL" in err


def test_wired_into_the_moegate_command(tmp_path, capsys):
    from gateway.cli import main

    assert main(["db", "upgrade", "--database-url", f"sqlite:///{tmp_path / 'g.db'}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["revision"] == migrate.head_revision()
