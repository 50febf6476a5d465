"""``ReplicaScaler`` over engine doubles: concurrent calls are serialized, a replica that fails to start leaves the
fleet as it was, a count out of range is refused, a slot freed by a removal is reused; the CLI's refusals (one
line, exit 2) and a fixed fleet's ``/admin/replicas`` (fast: no engine process)."""

import asyncio

import pytest

from engine.core.config import EngineConfig
from engine.serving.async_engine import EngineError
from gateway.engine_supervisor import Supervisors
from gateway.replica_router import REMOVED, SERVING, ReplicaRouter
from gateway.replica_scaling import ReplicaScaler

pytestmark = pytest.mark.timeout(30)


class Replica:
    """An ``EngineClient`` double that is ready ``start_s`` after its start (or fails then)."""

    def __init__(self, start_s: float = 0.05, fails: bool = False) -> None:
        self.config = EngineConfig(model="fake")
        self.info, self.dead, self.stats = None, None, None
        self.start_s, self.fails = start_s, fails
        self.stopped = False

    async def start(self):
        await asyncio.sleep(self.start_s)
        if self.fails:
            raise EngineError("the engine process exited during start-up")
        self.info = object()
        return self.info

    async def shutdown(self) -> None:
        self.stopped, self.dead = True, "stopped"

    def silent_s(self) -> float:
        return 0.0


def _fleet(fails: set[int] = frozenset()):
    built: list[tuple[int, Replica]] = []

    def build(k: int) -> Replica:
        built.append((k, Replica(fails=k in fails)))
        return built[-1][1]

    first = Replica()
    first.info = object()
    router = ReplicaRouter([first], ["0"])
    return router, ReplicaScaler(router, build, 3), built


def test_concurrent_calls_are_serialized():
    async def scenario():
        router, scaler, built = _fleet()
        supervisors = Supervisors(5, 60)
        try:
            # Unserialized, both would see 1 replica serving and start 2 each.
            a, b = await asyncio.gather(scaler.set_count(3, supervisors, 1), scaler.set_count(3, supervisors, 1))
            assert sorted(a["added"] + b["added"]) == ["1", "2"] and [k for k, _ in built] == [1, 2]
            assert [router.names[i] for i in scaler.serving()] == ["0", "1", "2"]
            grow, shrink = await asyncio.gather(scaler.set_count(3, supervisors, 1), scaler.set_count(1, supervisors, 1))
            assert grow["added"] == [] and sorted(shrink["removed"]) == ["1", "2"]
            assert all(r.stopped for _, r in built) and router.states == [SERVING, REMOVED, REMOVED]
            assert [x["replica"] for x in scaler.describe()] == ["0"]
            again = await scaler.set_count(2, supervisors, 1)  # the freed slot is reused under the lowest name
            assert again["added"] == ["1"] and router.states == [SERVING, SERVING, REMOVED]
            assert router.replicas[1] is built[-1][1] and router.live() == [0, 1]
        finally:
            await supervisors.stop_all()

    asyncio.run(scenario())


def test_a_replica_that_fails_to_start_leaves_the_fleet_as_it_was():
    async def scenario():
        router, scaler, built = _fleet(fails={1})
        supervisors = Supervisors(5, 60)
        try:
            with pytest.raises(EngineError):
                await scaler.set_count(2, supervisors, 1)
            assert built[0][1].stopped and [x["replica"] for x in scaler.describe()] == ["0"]
            for bad in (0, 4):
                with pytest.raises(ValueError, match="between 1 and 3"):
                    await scaler.set_count(bad, supervisors, 1)
        finally:
            await supervisors.stop_all()

    asyncio.run(scenario())


@pytest.mark.parametrize("argv, says", [
    (["set", "0"], "the count must be 1 or more, got 0"),
    (["set", "two"], "argument count: invalid int value: 'two'"),
    (["set", "2", "--url", "http://127.0.0.1:9"], "cannot reach the gateway at http://127.0.0.1:9"),
    (["--url", "http://127.0.0.1:9"], "cannot reach the gateway at http://127.0.0.1:9"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, says, capsys, monkeypatch):
    from gateway.cli import main as moegate

    monkeypatch.setenv("MOEGATE_ADMIN_TOKEN", "t" * 20)
    try:
        rc = moegate(["admin", "replicas", *argv])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and says in err and err.count("\n") == 1, err


def test_cli_without_a_token_says_so(capsys, monkeypatch):
    from gateway.cli import main as moegate

    monkeypatch.delenv("MOEGATE_ADMIN_TOKEN", raising=False)
    assert moegate(["admin", "replicas", "set", "2"]) == 2
    assert capsys.readouterr().err == "moegate admin replicas: error: set MOEGATE_ADMIN_TOKEN to the gateway's admin token\n"


def test_a_fixed_fleet_lists_its_replica_and_refuses_to_scale(tmp_path):
    """A server started without room to scale: GET lists its one engine, POST is 409 scaling_disabled (after the
    body is checked: a count that is not an integer is a 400 naming it); the admin token only."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from benchmarks.instant_engine import InstantEngine
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from tenants.migrate import upgrade

    token = "admin-" + "x" * 20
    db = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(db)
    app = create_app(GatewayConfig(database_url=db, data_dir=str(tmp_path / "data"), admin_token=token),
                     InstantEngine())

    async def scenario():
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as http:
            url, auth = str(server.make_url("/admin/replicas")), {"Authorization": f"Bearer {token}"}
            async with http.get(url, headers=auth) as r:
                listing = await r.json()
                assert r.status == 200 and listing["scalable"] is False, listing
                assert [(x["replica"], x["state"]) for x in listing["replicas"]] == [("0", "serving")]
            async with http.post(url, headers=auth, json={"count": "2"}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "count"
            async with http.post(url, headers=auth, json={"count": 2}) as r:
                assert r.status == 409 and (await r.json())["error"]["code"] == "scaling_disabled"
            async with http.post(url, headers={"Authorization": "Bearer not-it"}, json={"count": 2}) as r:
                assert r.status == 401

    asyncio.run(scenario())
