import asyncio

from tenants.ttl_cache import RefreshingCache


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def test_single_flight_refresh_ahead_and_hard_ttl():
    async def body():
        clock = Clock()
        cache = RefreshingCache(ttl_s=10, refresh_fraction=0.5, clock=clock)
        loads = []
        gate = asyncio.Event()

        async def load():
            loads.append(clock.t)
            await gate.wait()
            return len(loads)

        waiters = [asyncio.create_task(cache.get("k", load)) for _ in range(50)]
        await asyncio.sleep(0)
        gate.set()
        assert await asyncio.gather(*waiters) == [1] * 50 and len(loads) == 1  # one load for 50 callers
        clock.t = 4.9
        assert await cache.get("k", load) == 1 and len(loads) == 1  # fresh
        clock.t = 6
        assert await cache.get("k", load) == 1  # stale: answered from the cache, refreshed behind
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(loads) == 2 and await cache.get("k", load) == 2
        clock.t = 6 + 10  # idle past the TTL: the caller waits for a fresh value
        assert await cache.get("k", load) == 3
        assert cache.peek("k") == 3
        clock.t = 100
        assert cache.peek("k") is None

    asyncio.run(body())


def test_failed_load_is_not_cached():
    async def body():
        cache = RefreshingCache(ttl_s=10)
        calls = 0

        async def load():
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("database down")
            return "ok"

        try:
            await cache.get("k", load)
        except RuntimeError:
            pass
        else:
            raise AssertionError("the failure must reach the caller")
        assert await cache.get("k", load) == "ok" and calls == 2

    asyncio.run(body())
