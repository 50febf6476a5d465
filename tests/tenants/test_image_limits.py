"""A tenant's image limits in the policy database, on SQLite and PostgreSQL (one database each):
``moegate admin quota set --max-images-per-request / --max-image-pixels``, its bad input (exit 2, one line, nothing
changed) and the columns' checks, and the limits the gateway reads through the quota manager, against a plain min()
over random server and tenant limits (a tenant's limit only ever tightens the server's). The 0012 migration runs up
and down on both backends in ``test_migrations.py``, and its columns match the models there."""

import random

import pytest
from sqlalchemy import create_engine, pool, text

from gateway.chat_images import ImageLimits
from gateway.image_policy import tenant_image_limits
from tenants.db import sync_url
from tenants.quota import QuotaManager

from .helpers import cli, with_store


BAD_INPUT = [
    (["--max-images-per-request", "-1"], "must be >= 0"),
    (["--max-images-per-request", "many"], "expected an integer >= 0"),
    # From 1, as the server's own --max-image-pixels: no image has 0 pixels (--max-images-per-request 0 refuses
    # a tenant's images, and the message says so).
    (["--max-image-pixels", "-5"], "--max-image-pixels: must be >= 1"),
    (["--max-image-pixels", "0"], "--max-image-pixels: must be >= 1 or 'none', got 0 (pixels of one decoded image); "
                                  "to refuse the tenant's images, set --max-images-per-request 0"),
    (["--max-image-pixels", "1.5e6"], "expected an integer >= 1"),
]


def _rows(url: str, sql: str) -> None:
    engine = create_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(text(sql))
    finally:
        engine.dispose()


def _expected(server: ImageLimits, images: int | None, pixels: int | None) -> tuple[int, int, bool, bool]:
    """The limits that apply, by a plain min, and whether each is the tenant's (strictly lower than the server's)."""
    eff_images = server.max_images if images is None else min(images, server.max_images)
    eff_pixels = server.max_image_pixels if pixels is None else min(pixels, server.max_image_pixels)
    return eff_images, eff_pixels, eff_images < server.max_images, eff_pixels < server.max_image_pixels


def test_image_limits_set_read_and_refused(db_url, capsys):
    rng = random.Random()
    assert cli(capsys, db_url, "admin", "tenant", "create", "acme")[0] == 0
    code, out, _ = cli(capsys, db_url, "admin", "quota", "set", "acme", "--rpm", "60",
                       "--max-images-per-request", "3", "--max-image-pixels", "4096", as_json=True)
    assert code == 0 and (out["max_images_per_request"], out["max_image_pixels"], out["requests_per_minute"]) == (
        3, 4096, 60)
    shown = cli(capsys, db_url, "admin", "tenant", "show", "acme", as_json=True)[1]["quota"]
    assert (shown["max_images_per_request"], shown["max_image_pixels"]) == (3, 4096)
    out = cli(capsys, db_url, "admin", "quota", "set", "acme", "--max-image-pixels", "none", as_json=True)[1]
    assert (out["max_images_per_request"], out["max_image_pixels"], out["requests_per_minute"]) == (3, None, 60)

    cases = []
    for _ in range(2):
        server = ImageLimits(max_images=rng.randint(1, 20), max_image_pixels=rng.randint(100, 10**7))
        images = rng.choice([None, 0, rng.randint(0, 25)])
        pixels = rng.choice([None, rng.randint(1, 2 * 10**7)])
        argv = ["--max-images-per-request", "none" if images is None else str(images),
                "--max-image-pixels", "none" if pixels is None else str(pixels)]
        assert cli(capsys, db_url, "admin", "quota", "set", "acme", *argv)[0] == 0
        cases.append((server, images, pixels, with_store(db_url, lambda store, server=server: _read(store, server))))
    for server, images, pixels, got in cases:
        want = _expected(server, images, pixels)
        assert (got.max_images, got.max_image_pixels, got.tenant_images, got.tenant_pixels) == want, (
            server, images, pixels, got)
        assert (got.max_image_bytes, got.max_request_image_bytes) == (server.max_image_bytes,
                                                                      server.max_request_image_bytes)

    cli(capsys, db_url, "admin", "quota", "set", "acme", "--max-images-per-request", "2")
    before = cli(capsys, db_url, "admin", "quota", "show", "acme", as_json=True)[1]
    for argv, message in BAD_INPUT:  # each must change nothing
        code, out, err = cli(capsys, db_url, "admin", "quota", "set", "acme", *argv)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err, (argv, err)
    code, out, err = cli(capsys, db_url, "admin", "quota", "set", "nobody", "--max-image-pixels", "10")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "unknown tenant" in err
    # the store's own check, for a caller that is not the command line, and the database's
    with pytest.raises(Exception, match="max_image_pixels must be a non-negative integer"):
        with_store(db_url, lambda store: store.set_quota("acme", max_image_pixels=-3))
    with pytest.raises(Exception, match="max_image_pixels must be at least 1"):
        with_store(db_url, lambda store: store.set_quota("acme", max_image_pixels=0))
    for column in ("max_images_per_request", "max_image_pixels"):
        with pytest.raises(Exception, match=f"ck_quotas_{column}|CHECK constraint"):
            _rows(db_url, f"UPDATE quotas SET {column} = -1")
    assert cli(capsys, db_url, "admin", "quota", "show", "acme", as_json=True)[1] == before


def test_image_limits_at_the_server_flags_lower_bounds(db_url, capsys):
    """The least each image limit takes is the least the server's own flag takes: 1 pixel, 0 images."""
    cli(capsys, db_url, "admin", "tenant", "create", "acme")
    code, out, _ = cli(capsys, db_url, "admin", "quota", "set", "acme", "--max-image-pixels", "1",
                       "--max-images-per-request", "0", as_json=True)
    assert code == 0 and (out["max_image_pixels"], out["max_images_per_request"]) == (1, 0)


async def _read(store, server: ImageLimits) -> ImageLimits:
    tenant = await store.get_tenant("acme")
    return await tenant_image_limits(QuotaManager(store), server, tenant.id)


