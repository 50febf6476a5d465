"""``moegate admin adapter``: add (the directory checked first), list, grant, revoke, remove on SQLite and
PostgreSQL; bad input exits 2 with one line and writes nothing; who may use which adapter (``usable``)."""

from tenants.adapters import AdapterStore
from tests.engine.lora.adapter_dirs import MALFORMED, write_adapter, write_malformed

from .helpers import cli, with_store


def _names(capsys, url, *tenant):
    code, out, _ = cli(capsys, url, "admin", "adapter", "list", *tenant, as_json=True)
    assert code == 0
    return {a["name"]: a for a in out}


def test_adapter_commands(db_url, capsys, tmp_path):
    for t in ("acme", "beta", "gamma"):
        assert cli(capsys, db_url, "admin", "tenant", "create", t)[0] == 0
    good = write_adapter(str(tmp_path / "good"), rank=3)
    code, out, _ = cli(capsys, db_url, "admin", "adapter", "add", "acme/support-v1", "--path", good, "--tenant", "acme",
                       as_json=True)
    assert code == 0 and out["owner"] == "acme" and out["rank"] == 3 and out["base_model"] == "tiny-moe"
    assert out["target_modules"] == "experts,o_proj,q_proj" and out["path"] == good
    assert cli(capsys, db_url, "admin", "adapter", "add", "shared", "--path", good, "--public", as_json=True)[0] == 0
    assert set(_names(capsys, db_url)) == {"acme/support-v1", "shared"}
    assert set(_names(capsys, db_url, "beta")) == {"shared"}
    assert cli(capsys, db_url, "admin", "adapter", "grant", "acme/support-v1", "beta", as_json=True)[0] == 0
    assert cli(capsys, db_url, "admin", "adapter", "grant", "acme/support-v1", "beta", as_json=True)[0] == 0  # again
    assert set(_names(capsys, db_url, "beta")) == {"acme/support-v1", "shared"}
    assert _names(capsys, db_url)["acme/support-v1"]["granted"] == "beta"
    assert cli(capsys, db_url, "admin", "adapter", "list")[0] == 0  # the table

    async def usable(store):
        adapters, ids = AdapterStore(store), {t.name: t.id for t in await store.list_tenants()}
        return {t: set(await adapters.usable(ids[t])) for t in ids}
    assert with_store(db_url, usable) == {"acme": {"acme/support-v1", "shared"}, "beta": {"acme/support-v1", "shared"},
                                          "gamma": {"shared"}}
    assert cli(capsys, db_url, "admin", "adapter", "revoke", "acme/support-v1", "beta", as_json=True)[0] == 0
    assert set(_names(capsys, db_url, "beta")) == {"shared"}
    assert cli(capsys, db_url, "admin", "adapter", "grant", "acme/support-v1", "gamma", as_json=True)[0] == 0
    assert cli(capsys, db_url, "admin", "adapter", "remove", "acme/support-v1", as_json=True)[0] == 0  # grants go too
    assert set(_names(capsys, db_url)) == {"shared"} and set(_names(capsys, db_url, "gamma")) == {"shared"}


BAD = [
    (["add", "x", "--path", "GOOD", "--tenant", "nobody"], "unknown tenant"),
    (["add", "taken", "--path", "GOOD", "--tenant", "acme"], "already exists"),
    (["add", "x", "--path", "GOOD"], "--tenant NAME, or --public"),
    (["add", "x", "--path", "GOOD", "--tenant", "acme", "--public"], "--tenant NAME, or --public"),
    (["add", "a,b", "--path", "GOOD", "--public"], "must not hold ','"),
    (["add", "a=b", "--path", "GOOD", "--public"], "must not hold '='"),
    (["add", "bell\x07", "--path", "GOOD", "--public"], "control character U+0007"),
    # Named like the base model the adapter was saved for ("tiny-moe"), or a lookalike of it: case, Cyrillic
    # letters, fullwidth forms, a zero-width space; and any other letter outside ASCII.
    (["add", "tiny-moe", "--path", "GOOD", "--public"], "reads as the model 'tiny-moe'"),
    (["add", "Tiny-MoE", "--path", "GOOD", "--public"], "reads as the model 'tiny-moe'"),
    (["add", "t\u0456ny-m\u043ee", "--path", "GOOD", "--public"], "must not hold 'U+0456'"),
    (["add", "\uff54\uff49\uff4e\uff59-moe", "--path", "GOOD", "--public"], "must not hold 'U+FF54'"),
    (["add", "tiny\u200b-moe", "--path", "GOOD", "--public"], "U+200B"),
    (["add", "caf\u00e9", "--path", "GOOD", "--public"], "must not hold 'U+00E9'"),
    (["add", "x", "--path", "NOWHERE", "--public"], "not a directory"),
    (["grant", "taken", "acme"], "owns adapter"),
    (["grant", "nope", "acme"], "unknown adapter"),
    (["revoke", "taken", "beta"], "not granted"),
    (["remove", "nope"], "unknown adapter"),
] + [(["add", "x", "--path", f"MALFORMED:{case}", "--public"], words) for case, (*_, words) in sorted(MALFORMED.items())
     if case in ("no_config", "bad_json", "dora", "modules_to_save", "missing_b", "damaged_weights", "nan_weights",
                 "huge_weights")]


def test_bad_input_exits_2_with_one_line_and_writes_nothing(db_url, capsys, tmp_path):
    for t in ("acme", "beta"):
        cli(capsys, db_url, "admin", "tenant", "create", t)
    good = write_adapter(str(tmp_path / "good"))
    cli(capsys, db_url, "admin", "adapter", "add", "taken", "--path", good, "--tenant", "acme")
    before = _names(capsys, db_url)

    def path(arg):
        if arg == "GOOD":
            return good
        if arg == "NOWHERE":
            return str(tmp_path / "nowhere")
        if arg.startswith("MALFORMED:"):
            case = arg.split(":", 1)[1]
            return write_malformed(str(tmp_path / case), case)
        return arg
    for argv, message in BAD:  # one database for every case: each must leave it as it was
        code, out, err = cli(capsys, db_url, "admin", "adapter", *[path(a) for a in argv])
        assert code == 2 and out == "", argv
        assert len(err.strip().splitlines()) == 1 and message in err, (argv, err)
        assert _names(capsys, db_url) == before, argv
