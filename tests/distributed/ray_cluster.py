"""A local Ray cluster of three 1-CPU nodes on loopback for the ``ray``-marked tests (``make test-ray``): the
``cluster`` fixture (one per test module) and the limits those tests share.

Import the fixture into a test module (``from tests.distributed.ray_cluster import cluster``); Ray itself is
imported only when the fixture runs, so ``make test`` (without Ray) never imports it."""

import os
import socket
import threading

import pytest

LOOPBACK = "127.0.0.1"  # every node, the driver and the ranks' groups on loopback only
WAIT_S = 60  # the hard limit on every wait of a test on this cluster


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
    import gateway.app  # noqa: F401
    import tests.hf_models  # noqa: F401


@pytest.fixture(scope="module")
def cluster():
    """A head and two worker nodes, 1 CPU each; this process is the driver. Shut down whatever happens."""
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
