"""``--distributed-executor-backend ray`` on a local Ray cluster of three 1-CPU nodes (loopback only): an engine
split over 2 ranks, each a Ray actor of one placement group, lands on two nodes (no node has room for both) and
generates exactly the single-process engine's greedy tokens; then a node holding one of its ranks is removed while
requests run: every request admitted is answered (its tokens, or the 503 a failed engine gets today), none hangs,
and the restarted engine is placed again on the nodes left and serves the same tokens.

Slow (a Ray cluster starts in 15-30 s on two busy cores): marked ``ray``, skipped without Ray installed
(``pip install -e '.[ray]'``)."""

import asyncio
import random
import socket
import threading
import time

import pytest

pytestmark = pytest.mark.ray

LOOPBACK = "127.0.0.1"  # every node, the driver and the ranks' groups on loopback only
VOCAB = 97
ENGINE = dict(device="cpu", cpu_threads=1, block_size=16, num_kv_blocks=48, max_num_batched_tokens=64,
              max_num_seqs=8, distributed_timeout_s=5)
WAIT_S = 60  # the hard limit on every wait below


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _node_args() -> dict:
    """One CPU, loopback, and the agents' ports chosen here (a node left to pick them waits on a file the
    dashboard agent writes, which a busy machine writes too late)."""
    return dict(num_cpus=1, node_ip_address=LOOPBACK, metrics_agent_port=_free_port(),
                metrics_export_port=_free_port(), dashboard_agent_listen_port=_free_port(),
                runtime_env_agent_port=_free_port())


def _import_engine() -> None:
    import engine.llm  # noqa: F401
    import engine.serving.ray_engine  # noqa: F401
    import gateway.completion  # noqa: F401
    import tests.hf_models  # noqa: F401


@pytest.fixture(scope="module")
def cluster():
    """A head and two worker nodes, 1 CPU each; this process is the driver. Shut down whatever happens."""
    import os

    ray = pytest.importorskip("ray")  # here, not at collection: `make test` leaves these tests out unimported
    from ray.cluster_utils import Cluster

    # Ray on Linux turns 127.0.0.1 into the machine's address when it connects; without multi-machine clusters
    # it keeps loopback (the nodes, started from this process, inherit the setting).
    loopback_only = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False  # this process read it at import
    # One node at a time: each starts a raylet and two Python agents, which must be up within Ray's own 15 s.
    # The test's own imports (torch, the engine, transformers: seconds) while the nodes start.
    importing = threading.Thread(target=_import_engine, daemon=True)
    importing.start()
    # A node that stops answering is declared dead after 5 missed health checks, one every 0.5 s (Ray's default:
    # 5 of one every 3 s), so the lost node's bundles are freed within the test's time.
    nodes = Cluster(initialize_head=True, head_node_args={
        **_node_args(), "include_dashboard": False, "include_log_monitor": False,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 5}})
    try:
        for _ in range(2):
            nodes.add_node(**_node_args())
        ray.init(address=nodes.address, _node_ip_address=LOOPBACK, logging_level="ERROR", log_to_driver=False)
        importing.join(WAIT_S)
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()
        if loopback_only is None:
            del os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = loopback_only
        ray._private.ray_constants.ENABLE_RAY_CLUSTER = True


@pytest.mark.timeout(150)
def test_tp2_over_ray_nodes_gives_the_single_process_tokens_and_survives_a_lost_node(cluster, tmp_path):
    from engine import LLM
    from engine.core.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.serving.async_engine import EngineError
    from engine.serving.ray_engine import RayEngine
    from gateway.completion import engine_down
    from tests.hf_models import make_hf_model

    seed = random.randrange(2**31)
    rng = random.Random(seed)
    make_hf_model("qwen3_moe", str(tmp_path), seed=seed, vocab_size=VOCAB, num_layers=2)
    prompts = [[rng.randrange(1, VOCAB - 1) for _ in range(n)] for n in (7, 3, 12, 5)]
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    alone = LLM(str(tmp_path), **{**ENGINE, "cpu_threads": None})  # this process: its thread count left alone
    want = [out.token_ids for out in alone.generate(prompts, short)]
    alone.engine.close()
    config = EngineConfig(model=str(tmp_path), **ENGINE, tensor_parallel_size=2, enable_expert_parallel=True,
                          distributed_executor_backend="ray")

    async def tokens(engine, prompt, params) -> list[int]:
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    async def scenario():
        engine = RayEngine(config)
        await asyncio.wait_for(engine.start(), WAIT_S)
        try:
            nodes = [node for node, _ in engine.group.placement]
            assert len(set(nodes)) == 2, f"both ranks on one node of 1 CPU: {nodes} (seed={seed})"
            got = await asyncio.wait_for(asyncio.gather(*(tokens(engine, p, short) for p in prompts)), WAIT_S)
            assert list(got) == want, f"seed={seed}"

            # A node holding a rank leaves while every request is decoding (the head node stays: it holds Ray's
            # own control services).
            streams = [engine.generate(p, long) for p in prompts]
            firsts = await asyncio.wait_for(asyncio.gather(*(s.__anext__() for s in streams)), WAIT_S)
            assert all(out.token_ids for out in firsts)
            head = cluster.head_node.node_id
            victim = next(n for n in cluster.worker_nodes if n.node_id in nodes)
            cluster.remove_node(victim, allow_graceful=False)

            async def rest(stream) -> object:
                try:
                    return [t async for out in stream for t in out.token_ids]
                except EngineError as e:
                    return e

            start = time.monotonic()
            answers = await asyncio.wait_for(asyncio.gather(*(rest(s) for s in streams)), WAIT_S)
            failed = [a for a in answers if isinstance(a, EngineError)]
            assert failed, f"every request finished after its rank's node left: {answers} (seed={seed})"
            for a in answers:  # each one answered: its remaining tokens, or the gateway's 503
                assert isinstance(a, list) or engine_down(a).status == 503, a
            while engine.lost is None and time.monotonic() - start < 15:  # which rank: from Ray, within a second
                await asyncio.sleep(0.1)
            assert engine.dead and engine.lost and "rank" in engine.lost, (engine.dead_detail, engine.lost)
            assert time.monotonic() - start < 15, "the lost rank was noticed late"
            with pytest.raises(EngineError):  # until the supervisor restarts it
                await asyncio.wait_for(tokens(engine, prompts[0], short), WAIT_S)

            await asyncio.wait_for(engine.restart(), WAIT_S)  # what the gateway's supervisor does
            placed = {node for node, _ in engine.group.placement}
            assert victim.node_id not in placed and len(placed) == 2 and head in placed, placed
            again = await asyncio.wait_for(asyncio.gather(*(tokens(engine, p, short) for p in prompts)), WAIT_S)
            assert list(again) == want, f"seed={seed}"
        finally:
            await asyncio.wait_for(engine.shutdown(), WAIT_S)

    asyncio.run(scenario())
