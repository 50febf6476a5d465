"""Disaggregated serving with real processes on gloo: a prefill engine computes prompts and sends their KV to a
decode engine over torch.distributed, the decode engine generates.

Reference: one aggregated engine (the offline ``LLM``) with the same checkpoint and settings; greedy tokens must
be identical. The decode engine's statistics prove it computed no prompt token but each prompt's last, partial
block; faults (the prefill engine killed, a transfer that never comes, an abort while the KV is awaited) end
with every request answered and every decode block free again.
"""

import asyncio
import dataclasses
import io
import json
import os
import random
import signal
import sqlite3
import time

import pytest

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.request_policy import RequestPolicy
from engine.serving.async_engine import AsyncEngine
from engine.serving.protocol import KVSource
from gateway.disaggregation import DisaggregatedEngines
from tests.hf_models import make_hf_model

VOCAB = 211
BS = 4
CHUNK = BS + 1  # the decode engine's decode_prefill_chunk_tokens: not a multiple of the block size
TENANT_A, TENANT_B = RequestPolicy(tenant="a", cache_salt="tenant-a"), RequestPolicy(tenant="b", cache_salt="tenant-b")


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _settings(path: str, **extra) -> dict:
    return dict(model=path, dtype="float32", device="cpu", block_size=BS, num_kv_blocks=96, max_num_seqs=4,
                cpu_threads=1, **extra)


async def _collect(stream) -> list[int]:
    tokens = []
    async for out in stream:
        tokens.extend(out.token_ids)
    return tokens


def _computed_here(prompt_len: int) -> int:
    """Prompt tokens a decode engine computes as prefill for a transferred prompt: its last partial block (the
    last token of a prompt that is one past a block boundary is a decode step, not prefill)."""
    rest = prompt_len - (prompt_len - 1) // BS * BS
    return rest if rest > 1 else 0


def _computed_locally(prompt_len: int) -> int:
    """Prompt tokens a decode engine counts as prefill for a prompt it computes itself from its first token, in
    chunks of ``CHUNK``: all of them but the last of a prompt one past a chunk boundary. That token is computed
    alone in its step, a one-token part that samples, which the runner computes on the decode path and the
    scheduler counts as decode (as ``_computed_here``'s one past a block boundary)."""
    return prompt_len - 1 if prompt_len % CHUNK == 1 else prompt_len


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "mimo_v2_flash"])
def test_greedy_tokens_equal_one_engine_and_the_decode_engine_computes_only_the_last_block(family, tmp_path):
    rng = random.Random()
    path = str(tmp_path / family)
    make_hf_model(family, path, seed=rng.randrange(2**31), vocab_size=VOCAB)
    shared = [rng.randrange(1, VOCAB - 1) for _ in range(4 * BS)]
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(14, 40))] for _ in range(3)]
    # Two prompts sharing 4 blocks: the second finds them on the decode engine; 2 or more of its blocks still move.
    prompts.append(shared + [rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(3, 9))])
    prompts.append(shared + [rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(10, 14))])
    short = [rng.randrange(1, VOCAB - 1) for _ in range(5)]  # under local_prefill_tokens: computed by the decode engine
    lengths = [rng.randint(3, 8) for _ in range(len(prompts) + 1)]
    # Three long prompts at once while the prefill engine's queue limit is 1 token: the second finds the first
    # queued there and is computed by the decode engine itself (conditional disaggregation).
    # The second (the one computed there) is one token past a chunk boundary: its last token is computed alone.
    busy = [[rng.randrange(1, VOCAB - 1) for _ in range(n)]
            for n in (rng.randint(24, 40), CHUNK * rng.randint(5, 7) + 1, rng.randint(24, 40))]
    llm = LLM(**_settings(path))
    expected = [o.token_ids for o in llm.generate(prompts + [short] + busy, [_greedy(n) for n in lengths + [4] * 3])]
    expected, expected_busy = expected[:len(prompts) + 1], expected[len(prompts) + 1:]
    expected_salted = llm.generate([prompts[0]], _greedy(lengths[0]))[0].token_ids

    async def main():
        # Chunks of 2 blocks: each prompt's blocks leave the prefill engine in pieces, while it computes the rest.
        prefill = AsyncEngine(EngineConfig(**_settings(path, role="prefill", max_num_batched_tokens=2 * BS)))
        # The prompts it computes itself in chunks of 5 tokens (not a block's multiple): each chunk shares its step
        # with the decode steps of the others.
        decode = AsyncEngine(EngineConfig(**_settings(path, role="decode", local_prefill_tokens=2 * BS,
                                                      decode_prefill_chunk_tokens=CHUNK)))
        router = DisaggregatedEngines([prefill], [decode])
        await router.start()
        try:
            # The first and the two sharing a prefix one after another (so the second finds the first's blocks
            # on the decode engine); the rest at once.
            first = await _collect(router.generate(prompts[0], _greedy(lengths[0]), policy=TENANT_A))
            first_bytes = decode.stats.kv_transfer_bytes  # the stats of the step that finished it
            assert first_bytes > 0
            sequential = [await _collect(router.generate(prompts[i], _greedy(lengths[i]), policy=TENANT_A))
                          for i in (3, 4)]
            rest = await asyncio.gather(*(_collect(router.generate(p, _greedy(n), policy=TENANT_A))
                                          for p, n in ((prompts[1], lengths[1]), (prompts[2], lengths[2]),
                                                       (short, lengths[5]))))
            got = [first, rest[0], rest[1], sequential[0], sequential[1], rest[2]]
            assert got == expected
            await asyncio.sleep(1.2)  # an idle engine reports its state every second
            stats = decode.stats
            assert stats.kv_transfers == 5 and stats.kv_transfer_fallbacks == 0
            assert stats.kv_transfer_bytes > 0
            assert stats.kv_transfer_pieces > stats.kv_transfers  # some prompt's blocks came in several pieces
            # Prompt 4 found prompt 3's shared blocks in the decode engine's own cache: only the rest moved.
            assert stats.prefix_hit_tokens >= len(shared)
            computed = sum(_computed_here(len(p)) for p in prompts) + _computed_locally(len(short))
            assert stats.total_prefill_tokens == computed
            assert stats.kv_blocks_used == 0 and prefill.stats.kv_blocks_used == 0

            # Another tenant, the same prompt: no block crosses tenants, every block of it is sent again.
            before = stats.kv_transfer_bytes
            other = await _collect(router.generate(prompts[0], _greedy(lengths[0]), policy=TENANT_B))
            assert other == expected_salted
            await asyncio.sleep(1.2)
            assert decode.stats.kv_transfer_bytes - before == first_bytes  # every block again, none shared
            assert decode.stats.kv_transfers == 6
            computed += _computed_here(len(prompts[0]))
            assert decode.stats.total_prefill_tokens == computed

            # Conditional disaggregation, forced: a queue limit of 1 token; the router records each request's
            # phases, "local" for a prompt the decode engine computed itself.
            router.config = dataclasses.replace(router.config, prefill_queue_tokens=1)
            router.phases = {}
            got = await asyncio.gather(*(_collect(router.generate(p, _greedy(4), f"busy{i}", policy=TENANT_A))
                                         for i, p in enumerate(busy)))
            assert got == expected_busy
            local = [i for i in range(3) if "local" in router.phases[f"busy{i}"]]
            assert 1 in local and 0 not in local and router.local_prefills == len(local)
            assert router.local_prefills_by == {("decode-0", "not_wanted"): 1, ("decode-0", "prefill_busy"): len(local)}
            from gateway.engine_metrics import EngineCollector
            samples = {(s.labels["replica"], s.labels["reason"]): s.value for f in EngineCollector(router).collect()
                       if f.name == "moegate_kv_local_prefills" for s in f.samples if s.name.endswith("_total")}
            assert samples == router.local_prefills_by
            await asyncio.sleep(1.2)
            stats = decode.stats
            assert stats.kv_transfers == 6 + 3 - len(local)
            assert stats.total_prefill_tokens == computed + sum(
                _computed_locally(len(p)) if i in local else _computed_here(len(p)) for i, p in enumerate(busy))
            assert stats.kv_blocks_used == 0 and prefill.stats.kv_blocks_used == 0
        finally:
            await router.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_faults_end_with_every_request_answered_and_every_block_free(tmp_path):
    """A decode engine killed before a request's first output (placed again on the other), the prefill engine
    killed while the decode engine waits for its KV, a transfer that never comes (timeout), a request aborted
    while its KV is awaited and that KV arriving afterwards (drained, never written). On gpt-oss, whose
    transfers carry blocks of two cache groups (the single-group path is the same connector code with one
    group's blocks, and the greedy test above runs it on every other family): no block of either group leaks."""
    rng = random.Random()
    path = str(tmp_path / "model")
    make_hf_model("gpt_oss", path, seed=rng.randrange(2**31), vocab_size=VOCAB)
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(60, 90))] for _ in range(5)]
    llm = LLM(**_settings(path))
    expected = [o.token_ids for o in llm.generate(prompts, _greedy(6))]

    async def main():
        # The prefill engine computes 8 tokens a step, so a prompt takes it many steps: time to kill it.
        prefill = AsyncEngine(EngineConfig(**_settings(path, role="prefill", max_num_batched_tokens=8)))
        decode, spare = (AsyncEngine(EngineConfig(**_settings(path, role="decode", kv_transfer_timeout_s=3.0,
                                                              local_prefill_tokens=8))) for _ in range(2))
        router = DisaggregatedEngines([prefill], [spare, decode])  # equally loaded: the first is picked first
        await router.start()
        try:
            # 0. The decode engine dies after it set blocks aside, before any output: the request runs on the
            # other decode engine, the client sees no error.
            plain_prefill = router._prefill

            async def decode_killed(p, d, *args):
                router._prefill = plain_prefill  # once
                os.kill(d.pid, signal.SIGKILL)
                await plain_prefill(p, d, *args)

            router._prefill = decode_killed
            assert await _collect(router.generate(prompts[4], _greedy(6))) == expected[4]
            assert spare.dead and decode.stats.kv_transfers == 1 and decode.stats.kv_blocks_used == 0

            # 1. The prefill engine dies after the decode engine has set blocks aside for the prompt's KV: the
            # router tells the decode engine, which prefills the prompt itself at once; the client sees no error.

            async def killed_meanwhile(p, *args):
                os.kill(p.pid, signal.SIGKILL)
                while not p.dead:
                    await asyncio.sleep(0.01)
                await plain_prefill(p, *args)

            router._prefill = killed_meanwhile
            started = asyncio.get_running_loop().time()
            assert await _collect(router.generate(prompts[0], _greedy(6))) == expected[0]
            assert asyncio.get_running_loop().time() - started < 3.0  # not the transfer timeout: told at once
            router._prefill = plain_prefill
            assert router.fallbacks == 1
            assert router.local_prefills_by.get(("decode-1", "prefill_failed")) == 1, router.local_prefills_by
            await asyncio.sleep(1.2)
            assert decode.stats.kv_transfer_fallbacks == 1 and decode.stats.kv_blocks_used == 0
            # A fresh prefill engine pairs again and transfers (no hang on the old pair).
            await prefill.restart()
            assert await _collect(router.generate(prompts[1], _greedy(6))) == expected[1]
            assert decode.stats.kv_transfers == 2

            # 2. A transfer that never comes: the decode engine gives up after its timeout and prefills itself.
            pair_id = router._pair(prefill, decode)
            stream = decode.generate(prompts[2], _greedy(6), "orphan", kv_source=KVSource(pair_id, 10_000))
            assert await _collect(stream) == expected[2]
            assert decode.stats.kv_transfer_fallbacks == 2

            # 3. Aborted while its KV is awaited: its blocks are free at once; the KV that still comes later is
            # drained and dropped while another request holds those blocks, whose tokens stay right.
            wanted = decode.kv_wanted("aborted")
            stream = decode.generate(prompts[3], _greedy(6), "aborted", kv_source=KVSource(pair_id, 10_001))
            consumer = asyncio.create_task(_collect(stream))
            hashes = await wanted
            assert hashes
            consumer.cancel()  # the client goes away: the stream's end aborts the request
            with pytest.raises(asyncio.CancelledError):
                await consumer
            await asyncio.sleep(1.2)
            assert decode.stats.kv_blocks_used == 0
            other = asyncio.ensure_future(_collect(decode.generate(prompts[4], _greedy(6))))  # takes those blocks
            from engine.serving.protocol import KVSink

            await _collect(prefill.generate(prompts[3], _greedy(1), "late", kv_sink=KVSink(pair_id, 10_001, hashes)))
            assert await other == expected[4]
            await asyncio.sleep(1.2)
            assert decode.stats.kv_blocks_used == 0 and prefill.stats.kv_blocks_used == 0
            assert decode.stats.kv_transfers == 2  # the late one was not counted as received...
            assert prefill.stats.kv_transfers == 2  # ...though it was sent (and drained by the decode engine)
        finally:
            await router.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_serve_flags_stream_through_the_gateway_with_usage_once_and_transfer_metrics(tmp_path, capsys):
    """`moegate serve --prefill-replicas 1 --decode-replicas 1`'s engines behind the real app, driven by the
    official openai client, live and through the Batch API; reference: the offline engine on the same demo
    checkpoint."""
    import openai
    from aiohttp import ClientSession
    from aiohttp.test_utils import TestServer

    from engine import engine_flags
    from engine.loading.demo_model import write_demo_model
    from engine.serving.engine_server import parse_address
    from gateway.app import METRICS_URL, create_app
    from gateway.cli import build_parser, main
    from gateway.cli.disaggregated import build_disaggregated, disaggregation_layout
    from gateway.config import GatewayConfig
    from tenants.migrate import upgrade
    from tenants.store import TenantStore

    # Bad input: one line, exit 2.
    demo = str(tmp_path / "demo")
    write_demo_model(demo, seed=random.randrange(1000))
    assert main(["serve", "--model", demo, "--prefill-replicas", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "decode engine" in err[0]
    assert main(["serve", "--model", demo, "--prefill-replicas", "1", "--decode-replicas", "1",
                 "--prefill-max-num-batched-tokens", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prefill-max-num-batched-tokens" in err[0]

    rng = random.Random()
    words = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(30, 50))) for _ in range(2)]
    # Both engines with a disk tier under one --disk-cache-dir: each holds a directory of its own below it (one
    # engine per directory, so a shared one stopped the second engine at its start).
    disk = tmp_path / "kv"
    settings = ["--num-kv-blocks", "128", "--block-size", "4", "--local-prefill-tokens", "8", "--cpu-threads", "1",
                "--host-cache-gb", "0.01", "--disk-cache-dir", str(disk), "--disk-cache-gb", "0.01"]
    offline = LLM(model=demo, num_kv_blocks=128, block_size=4).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    # The prefill engine computes the prompts in steps of at most 16 tokens (several pieces each), the decode
    # engine keeps the default.
    args = build_parser().parse_args(["serve", "--model", demo, "--prefill-replicas", "1", "--decode-replicas", "1",
                                      "--prefill-max-num-batched-tokens", "16", *settings])
    layout = disaggregation_layout(args, engine_flags.engine_config(args), parse_address)
    assert layout.prefill.max_num_batched_tokens == 16
    engine_dirs = [c.disk_cache_dir for configs in layout.local_engines() for c in configs]
    assert engine_dirs == [str(disk / "prefill-0"), str(disk / "decode-0")]
    assert layout.decode.max_num_batched_tokens == engine_flags.engine_config(args).max_num_batched_tokens > 16
    url = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url)

    async def main_():
        store = TenantStore.open(url)
        await store.create_tenant("web")
        key = (await store.create_key("web"))[1]
        await store.close()
        engines = build_disaggregated(layout, b"", 60.0)
        app = create_app(GatewayConfig(served_model_name="demo", database_url=url, metrics_port=0,
                                       data_dir=str(tmp_path / "data"), batch_poll_s=0.1), engines)
        async with TestServer(app, host="127.0.0.1") as server:
            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)
            for prompt, ref in zip(prompts, offline):
                stream = await client.completions.create(
                    model="demo", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                chunks = [c async for c in stream]
                assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
                usage = chunks[-1].usage
                assert usage.prompt_tokens == ref.num_prompt_tokens and usage.completion_tokens == 8
            async with ClientSession() as http:
                health = await (await http.get(server.make_url("/health"))).json()
                assert [r["replica"] for r in health["replicas"]] == ["prefill-0", "decode-0"]
                assert health["status"] == "ready"
                assert all(os.path.isfile(os.path.join(d, "lock")) for d in engine_dirs), engine_dirs
                await asyncio.sleep(1.2)  # the idle engines' latest statistics
                metrics = await (await http.get(app[METRICS_URL])).text()
            assert 'moegate_kv_transfers_total{replica="decode-0"} 2.0' in metrics
            assert engines.decode[0].stats.kv_transfer_pieces > 2  # 16-token steps: prompts in several pieces
            assert 'moegate_kv_transfers_total{replica="prefill-0"} 2.0' in metrics
            assert 'moegate_kv_transfer_fallbacks_total{replica="decode-0"} 0.0' in metrics

            # The Batch API through the same pair of engines: the lines' text is the offline engine's, and every
            # request, live or batch, is billed once (one usage row each, its tokens once).
            lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                      "body": {"model": "demo", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}}
                     for i, p in enumerate(prompts)]
            data = "".join(json.dumps(line) + "\n" for line in lines).encode()
            upload = await client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
            batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                                completion_window="24h")
            deadline = time.monotonic() + 90
            while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                batch = await client.batches.retrieve(batch.id)
            assert batch.status == "completed" and batch.request_counts.completed == len(prompts), batch
            out = {o["custom_id"]: o for o in map(json.loads, (await client.files.content(batch.output_file_id)).text.splitlines())}
            for i, ref in enumerate(offline):
                assert out[f"line-{i}"]["response"]["body"]["choices"][0]["text"] == ref.text
            rows = []
            while time.monotonic() < deadline:  # live rows go through the usage ledger's writer
                with sqlite3.connect(tmp_path / "policy.db") as db:
                    rows = db.execute("SELECT batch, completion_tokens FROM usage").fetchall()
                if len(rows) >= 2 * len(prompts):
                    break
                await asyncio.sleep(0.1)
            assert sorted(rows) == [(0, 8)] * len(prompts) + [(1, 8)] * len(prompts), rows

    asyncio.run(main_())


@pytest.mark.timeout(300)
def test_preemption_on_both_sides_keeps_greedy_tokens(tmp_path):
    """A decode pool that holds one request's prompt and output but not two: requests that arrived with their
    KV are preempted while they grow and computed again from the prefix cache. A prefill engine with one slot,
    computing one token a step: a request of a more urgent class preempts the one it is computing. Tokens
    still equal one engine's."""
    rng = random.Random()
    path = str(tmp_path / "model")
    make_hf_model("mixtral", path, seed=rng.randrange(2**31), vocab_size=VOCAB)
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(30, 40))] for _ in range(6)]
    # The batch-class prompt is long: at one token a step its prefill outlasts the engine's statistics
    # interval (50 ms) many times over on any machine, so the urgent request finds it being computed.
    prompts[4] = [rng.randrange(1, VOCAB - 1) for _ in range(240)]
    llm = LLM(**_settings(path))
    expected = [o.token_ids for o in llm.generate(prompts, _greedy(24))]

    async def decode_preempted():
        prefill = AsyncEngine(EngineConfig(**_settings(path, role="prefill")))
        # Each request needs at most (40 + 24) / 4 = 16 blocks: 20 hold one, never two at their ends.
        decode = AsyncEngine(EngineConfig(**{**_settings(path, role="decode", local_prefill_tokens=BS),
                                             "num_kv_blocks": 20}))
        router = DisaggregatedEngines([prefill], [decode])
        await router.start()
        try:
            got = await asyncio.gather(*(_collect(router.generate(p, _greedy(24))) for p in prompts[:4]))
            assert got == expected[:4]
            await asyncio.sleep(1.2)
            assert decode.stats.num_preemptions > 0
            assert decode.stats.kv_transfers >= 1
            await asyncio.sleep(1.2)
            assert decode.stats.kv_blocks_used == 0 and prefill.stats.kv_blocks_used == 0
        finally:
            await router.shutdown()

    async def prefill_preempted():
        prefill = AsyncEngine(EngineConfig(**{**_settings(path, role="prefill", max_num_batched_tokens=1),
                                              "max_num_seqs": 1}))
        decode = AsyncEngine(EngineConfig(**_settings(path, role="decode", local_prefill_tokens=BS)))
        router = DisaggregatedEngines([prefill], [decode])
        await router.start()
        try:
            # A batch-class request's prompt is being computed (240 steps of one token) when an urgent one comes.
            batch, urgent = RequestPolicy(priority=2), RequestPolicy(priority=0)
            slow = asyncio.create_task(_collect(router.generate(prompts[4], _greedy(24), policy=batch)))
            # Until the prefill engine has computed 2 of its tokens (stats come at least every 50 ms while busy):
            # sent is not enough, as an urgent request that finds it still waiting is simply scheduled first.
            while prefill.stats is None or prefill.stats.total_prefill_tokens < 2:
                await asyncio.sleep(0.005)
            assert prefill.stats.total_prefill_tokens < len(prompts[4]), "the batch prompt was computed already"
            assert await _collect(router.generate(prompts[5], _greedy(24), policy=urgent)) == expected[5]
            assert await slow == expected[4]
            await asyncio.sleep(1.2)
            assert prefill.stats.num_preemptions > 0
            assert decode.stats.kv_transfers == 2
            assert decode.stats.kv_blocks_used == 0 and prefill.stats.kv_blocks_used == 0
        finally:
            await router.shutdown()

    asyncio.run(decode_preempted())
    asyncio.run(prefill_preempted())


@pytest.mark.timeout(240)
def test_a_remote_decode_engine_started_with_its_role_receives_a_local_prefill_engines_kv(tmp_path):
    """`moegate engine --listen ... --role decode` (its own process tree, over TCP) paired with a local prefill
    engine: the same tokens as one engine, the KV moved over the pair."""
    from engine.serving.remote_engine import RemoteEngine
    from tests.gateway.serve_process import free_port
    from tests.gateway.test_remote_engine import KEY, start_engine, stop_engine

    rng = random.Random()
    path = str(tmp_path / "model")
    make_hf_model("qwen3_moe", path, seed=rng.randrange(2**31), vocab_size=VOCAB)
    prompt = [rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(30, 60))]
    expected = LLM(**_settings(path)).generate([prompt], _greedy(8))[0].token_ids
    port = free_port()
    flags = ["--dtype", "float32", "--device", "cpu", "--block-size", str(BS), "--num-kv-blocks", "96",
             "--cpu-threads", "1", "--local-prefill-tokens", "8"]
    server = start_engine(path, port, "--role", "decode", *flags)
    try:
        async def main():
            prefill = AsyncEngine(EngineConfig(**_settings(path, role="prefill")))
            decode = RemoteEngine(EngineConfig(**_settings(path, role="decode")), ("127.0.0.1", port), KEY.encode(),
                                  60.0)
            router = DisaggregatedEngines([prefill], [decode])
            await router.start()
            try:
                assert await _collect(router.generate(prompt, _greedy(8))) == expected
                assert decode.stats.kv_transfers == 1 and decode.stats.kv_transfer_fallbacks == 0
            finally:
                await router.shutdown()

        asyncio.run(main())
    finally:
        stop_engine(server)


@pytest.mark.timeout(200)
def test_a_hung_prefill_engine_is_noticed_in_a_second_and_cached_tokens_are_prefix_hits_only(tmp_path):
    """The prefill engine frozen (SIGSTOP) while the decode engine waits for a prompt's KV, with a transfer
    timeout of 20 s: noticed within about a second of silence, the prompt computed by the decode engine (the
    tokens those of one aggregated engine), another tenant's requests served meanwhile, no new request sent to
    it; once it runs again (SIGCONT) it pairs anew and transfers. A transferred prompt's usage counts as cached
    only what the decode engine's prefix cache held before: nothing for a fresh prompt, its leading blocks for a
    prompt sent again."""
    rng = random.Random()
    path = str(tmp_path / "model")
    make_hf_model("qwen3_moe", path, seed=rng.randrange(2**31), vocab_size=VOCAB)
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(40, 70))] for _ in range(4)]
    short = [rng.randrange(1, VOCAB - 1) for _ in range(6)]
    expected = [o.token_ids for o in LLM(**_settings(path)).generate(prompts + [short], _greedy(5))]

    async def main():
        prefill = AsyncEngine(EngineConfig(**_settings(path, role="prefill", max_num_batched_tokens=8)))
        decode = AsyncEngine(EngineConfig(**_settings(path, role="decode", kv_transfer_timeout_s=20.0,
                                                      local_prefill_tokens=8)))
        router = DisaggregatedEngines([prefill], [decode])
        await router.start()

        async def run(prompt, policy=TENANT_A):
            tokens, last = [], None
            async for out in router.generate(prompt, _greedy(5), policy=policy):
                tokens.extend(out.token_ids)
                last = out
            return tokens, last.num_cached_tokens

        try:
            tokens, cached = await run(prompts[0])  # transferred: a fresh prompt has nothing cached
            assert tokens == expected[0] and decode.stats.kv_transfers == 1 and cached == 0
            tokens, cached = await run(prompts[0])  # sent again: the decode engine's own prefix cache holds it
            assert tokens == expected[0] and cached == (len(prompts[0]) - 1) // BS * BS

            os.kill(prefill.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                waiting = asyncio.ensure_future(run(prompts[1]))  # its KV never comes: the prefill engine is frozen
                assert (await run(short, TENANT_B))[0] == expected[4]  # another tenant's request goes on meanwhile
                assert (await waiting)[0] == expected[1]
                assert time.monotonic() - started < 5.0, "waited for the transfer timeout"
                assert router.local_prefills_by.get(("decode-0", "prefill_unresponsive")) == 1
                # While it is silent, a new long prompt is computed by the decode engine without asking it.
                assert (await run(prompts[2]))[0] == expected[2]
                assert router.local_prefills_by.get(("decode-0", "no_prefill_engine")) == 1
            finally:
                os.kill(prefill.pid, signal.SIGCONT)
            deadline = time.monotonic() + 10
            while prefill.silent_s() >= 0.5 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            tokens, cached = await run(prompts[3])  # a fresh pair: transferred again
            assert tokens == expected[3] and decode.stats.kv_transfers == 2 and cached == 0
            await asyncio.sleep(1.2)
            assert decode.stats.kv_blocks_used == 0
        finally:
            os.kill(prefill.pid, signal.SIGCONT)
            await router.shutdown()

    asyncio.run(main())
