"""Disaggregated prefill/decode under Ray (``moegate serve --prefill-replicas 1 --decode-replicas 1
--distributed-executor-backend ray``) behind one in-process gateway, on the local Ray cluster of three 1-CPU nodes
(loopback only), a tenant's requests over real HTTP.

The prefill engine and the decode engine are each a placement group of their own (with one CPU a node, on two
nodes); the prompts' KV goes from the prefill engine's actor to the decode engine's over the same torch.distributed
channel as between local processes. Reference: the aggregated offline engine on the same checkpoint; greedy text
must be identical, and the engines' statistics prove where the prompts were computed: every prompt on the prefill
engine, the decode engine received each prompt's KV and computed only each prompt's last, partial block.

Slow (a Ray cluster starts in 15-30 s on two busy cores): marked ``ray``, skipped without Ray installed."""

import asyncio
import random
import time

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from engine import LLM, SamplingParams, engine_flags
from engine.core.config import EngineConfig
from engine.loading.demo_model import write_demo_model
from engine.serving.engine_server import parse_address
from engine.serving.ray_engine import RayEngine  # Ray itself is imported only when an engine starts
from engine.serving.ray_rank import rank_zero_config
from gateway.app import create_app
from gateway.cli import build_parser
from gateway.cli.disaggregated import build_disaggregated, disaggregation_layout
from gateway.config import GatewayConfig
from tenants.migrate import upgrade
from tests.distributed.ray_cluster import WAIT_S, cluster  # noqa: F401 (the fixture)
from tests.gateway.tenant_keys import new_tenant_key
from tests.gateway.test_disaggregation import BS, _computed_here

MAX_TOKENS = 6
CHUNK = 4 * BS  # the prefill engine's step: each prompt leaves it in several pieces


async def _until(check, timeout_s: float, what: str):
    """``check()`` until it returns something true (returned), for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s"
        await asyncio.sleep(0.1)
    return got


def test_a_decode_engines_rank_zero_waits_for_kv_on_its_own_node():
    """Placed by Ray, a decode engine with no kv_transfer_address waits at its node's address (loopback, the
    default, is no address another node's prefill engine reaches); one that names an address keeps it, and a
    prefill engine gets none."""
    host = f"10.{random.randrange(256)}.{random.randrange(256)}.7"
    init = f"tcp://{host}:29500"

    def placed(**fields):
        config = EngineConfig(model="m", distributed_executor_backend="ray", **fields)
        return rank_zero_config(config, init, "cpu", host)

    decode = placed(role="decode")
    assert (decode.kv_transfer_address, decode.distributed_init_method, decode.distributed_executor_backend,
            decode.local_ranks) == (host, init, "mp", 1)
    assert placed(role="decode", kv_transfer_address="10.1.2.3:7000").kv_transfer_address == "10.1.2.3:7000"
    assert placed(role="prefill").kv_transfer_address is None
    assert placed().kv_transfer_address is None


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_prefill_and_decode_engines_under_ray_serve_the_aggregated_engines_text(cluster, tmp_path):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    demo = str(tmp_path / "demo")
    write_demo_model(demo, seed=seed % 1000)
    # Lengths not one past a chunk boundary: the prefill engine then counts every prompt token as prefill.
    lengths = [n for n in rng.sample(range(20, 48), 6) if n % CHUNK != 1][:3]
    prompts = [[rng.randrange(10, 1000) for _ in range(n)] for n in lengths]
    settings = ["--num-kv-blocks", "64", "--block-size", str(BS), "--local-prefill-tokens", str(2 * BS),
                "--cpu-threads", "1", "--max-num-seqs", "4"]
    offline = LLM(model=demo, num_kv_blocks=64, block_size=BS, max_num_seqs=4)
    want = [o.text for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                     ignore_eos=True))]
    offline.engine.close()

    args = build_parser().parse_args(["serve", "--model", demo, "--prefill-replicas", "1", "--decode-replicas", "1",
                                      "--distributed-executor-backend", "ray", "--prefill-max-num-batched-tokens",
                                      str(CHUNK), *settings])
    layout = disaggregation_layout(args, engine_flags.engine_config(args), parse_address)
    engines = build_disaggregated(layout, b"", 30.0)
    (prefill,), (decode,) = engines.prefill, engines.decode
    assert isinstance(prefill, RayEngine) and isinstance(decode, RayEngine)
    url_db = f"sqlite:///{tmp_path / 'policy.db'}"
    upgrade(url_db)
    app = create_app(GatewayConfig(served_model_name="demo", database_url=url_db, data_dir=str(tmp_path / "data")),
                     engines)

    async def scenario():
        key = await new_tenant_key(url_db, "acme")
        async with TestServer(app, host="127.0.0.1") as server, ClientSession() as http:
            url = str(server.make_url("")).rstrip("/")

            async def ready():
                async with http.get(f"{url}/health") as r:
                    return r.status == 200 and (await r.json())["status"] == "ready"

            deadline = time.monotonic() + WAIT_S
            while not await asyncio.wait_for(ready(), WAIT_S):
                assert time.monotonic() < deadline, f"both engines ready within {WAIT_S} s"
                await asyncio.sleep(0.1)
            # Two groups, one engine each: on two nodes, since each node has one CPU.
            nodes = [prefill.group.placement[0][0], decode.group.placement[0][0]]
            assert nodes[0] != nodes[1], nodes

            async def ask(prompt):
                body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                        "ignore_eos": True}
                async with http.post(f"{url}/v1/completions", json=body,
                                     headers={"Authorization": f"Bearer {key}"}) as r:
                    return r.status, await r.json()

            got = []
            for p in prompts:  # one at a time: each transfer is its own
                got.append(await asyncio.wait_for(ask(p), WAIT_S))
            assert [s for s, _ in got] == [200] * len(prompts), got
            assert [b["choices"][0]["text"] for _, b in got] == want, f"seed={seed}"
            assert [b["usage"]["prompt_tokens"] for _, b in got] == lengths

            # The idle engines report their statistics every second.
            stats = await _until(lambda: decode.stats if decode.stats.kv_transfers == len(prompts) else None,
                                 10, "every prompt's KV received")
            assert stats.kv_transfer_fallbacks == 0 and stats.kv_transfer_bytes > 0
            assert stats.kv_transfer_pieces > stats.kv_transfers  # pieces of CHUNK tokens, sent while computing
            assert stats.total_prefill_tokens == sum(_computed_here(n) for n in lengths)
            await _until(lambda: prefill.stats.total_prefill_tokens == sum(lengths), 10,
                         f"the prefill engine's {sum(lengths)} prompt tokens (has {prefill.stats.total_prefill_tokens})")
            assert stats.kv_blocks_used == 0

    asyncio.run(scenario())  # the server's exit stops the app, whose cleanup removes both engines' groups
    assert (prefill.group, decode.group) == (None, None)
