"""Stopping the batch runner at any moment (mid-claim, mid-write, mid-line) loses no line, runs none twice,
and leaves no lease held: the next runner can take every unfinished line at once."""

import asyncio
import json
import random
from dataclasses import dataclass

from benchmarks.instant_engine import InstantEngine
from gateway.batch.runner import BatchRunner, BatchRunnerConfig
from tenants.batch_store import BatchStore
from tenants.migrate import upgrade
from tenants.quota import QuotaManager
from tenants.store import TenantStore


@dataclass
class Line:
    line_no: int
    custom_id: str
    body_json: str


class JitteryEngine(InstantEngine):
    """Answers after a random few milliseconds, so stops land while lines, writes and claims are in flight."""

    async def generate(self, prompt, sampling_params, request_id=None, policy=None, stream=True):
        await asyncio.sleep(random.uniform(0, 0.004))
        async for delta in super().generate(prompt, sampling_params, request_id, policy, stream):
            yield delta


def test_stopping_the_runner_at_random_moments_loses_no_line_and_runs_none_twice(tmp_path):
    url = f"sqlite:///{tmp_path / 'stop.db'}"
    upgrade(url)

    async def main():
        store = TenantStore.open(url)
        batches = BatchStore(store, QuotaManager(store))
        try:
            tenant = await store.create_tenant("acme")
            n = random.randint(120, 200)
            body = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 3})
            batch = await batches.create_batch(tenant.id, "/v1/completions", "file-x", 3600, "24h", None, "m",
                                               [Line(i + 1, f"c{i}", body) for i in range(n)], None, 0)
            engine = JitteryEngine(num_tokens=3)
            await engine.start()
            stops = 0
            while (await batches.get_batch(tenant.id, batch.id)).status != "completed":
                assert stops < 60, "the batch never completed"
                runner = BatchRunner(batches, engine, lambda: "m", BatchRunnerConfig(
                    max_inflight=random.randint(1, 24), poll_s=0.01, lease_s=30))
                task = asyncio.create_task(runner.run())
                await asyncio.sleep(random.uniform(0.002, 0.03) * (1 + stops / 4))
                task.cancel()
                stopped, _ = await asyncio.wait([task], timeout=10)
                assert stopped, "the runner did not stop when cancelled"
                stops += 1
                # The stopped runner holds nothing: every line not finished can be claimed right now
                # (leases are 30 s, so only a released lease makes a running line claimable).
                counts = await batches.line_counts(batch.id)
                unfinished = counts.get("pending", 0) + counts.get("running", 0)
                probe = await batches.claim("probe", n, 30)
                assert len(probe) == unfinished, (counts, len(probe))
                await batches.release_all("probe")
            assert stops > 1  # the test stopped runners mid-batch, not only once at the end

            done = await batches.get_batch(tenant.id, batch.id)
            assert (done.completed, done.failed) == (n, 0)
            rows = await batches.lines_of(batch.id)
            assert [status for _, _, status, _ in rows] == ["done"] * n
            usage = await store.usage_summary("acme", by="tenant")
            assert sum(r["requests"] for r in usage) == n  # billed exactly once per line
            output = (await batches.read_file(done.output_file_id)).decode()
            custom_ids = [json.loads(line)["custom_id"] for line in output.splitlines()]
            assert sorted(custom_ids) == sorted(f"c{i}" for i in range(n))  # one output line per custom_id
        finally:
            await batches.close()
            await store.close()

    asyncio.run(main())
