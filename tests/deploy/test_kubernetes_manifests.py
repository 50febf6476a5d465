"""deploy/kubernetes/: every overlay renders (our kustomize subset, checked against the real kustomize where it is
installed) and validates (Kubernetes' own schemas for the built-in kinds, the upstream CRDs' schemas for
LeaderWorkerSet and InferencePool); every moegate command in them parses with moegate's real parsers and builds
its config; the probes and Services point at the ports and paths the gateway really serves; the worker pods' rank
script gives every rank of a two-node engine its torchrun variables."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import stat
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest

from engine import engine_flags
from engine.serving.engine_server import parse_address
from gateway.cli import build_parser
from gateway.cli import gateway_flags
from tests.deploy import kustomize_subset

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (ROOT / "overlays").iterdir() if (p / "kustomization.yaml").exists())
# group_version_Kind.json: the openAPIV3Schema of a CRD's version, from its upstream definition.
CRD_SCHEMAS = {tuple(path.stem.split("_")): path for path in (ROOT / "crd-schemas").glob("*.json")}
KUBERNETES_VERSION = "1.33.0"
# What the $(VAR) references in args stand for when the parsers read them (Kubernetes fills them in from the env).
ENV_STANDINS = {"LWS_LEADER_ADDRESS": "moegate-engine-0.moegate-engine.moegate", "POD_IP": "10.1.2.3",
                "POD_NAMESPACE": "moegate"}


@cache
def rendered(overlay: str) -> tuple[dict, ...]:
    return tuple(kustomize_subset.build(ROOT / "overlays" / overlay))


def by_kind(overlay: str, kind: str) -> list[dict]:
    return [d for d in rendered(overlay) if d["kind"] == kind]


def pod_specs(doc: dict) -> list[dict]:
    if doc["kind"] == "Deployment":
        return [doc["spec"]["template"]["spec"]]
    if doc["kind"] == "LeaderWorkerSet":
        t = doc["spec"]["leaderWorkerTemplate"]
        return [t["leaderTemplate"]["spec"]] + ([t["workerTemplate"]["spec"]] if "workerTemplate" in t else [])
    return []


def moegate_containers(overlay: str):
    for doc in rendered(overlay):
        for spec in pod_specs(doc):
            for c in spec.get("initContainers", []) + spec["containers"]:
                if "moegate" in c["image"].rpartition("/")[2]:
                    yield doc, spec, c


def test_every_layout_has_an_overlay():
    assert set(OVERLAYS) == {"one-gpu", "one-node-8", "two-nodes-8", "pd", "inference-pool"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_subset_renders_as_real_kustomize(overlay):
    """Where the real kustomize is installed, it renders each overlay to the same objects as our subset."""
    pykustomize = pytest.importorskip("pykustomize")
    real = asyncio.run(pykustomize.build(ROOT / "overlays" / overlay)).documents
    import yaml

    def keyed(docs):
        return {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs}

    assert keyed(yaml.safe_load(d) for d in real) == keyed(rendered(overlay))


def _closed(schema):
    """The CRD schema, with objects that list their properties closed to others (the API server would drop an
    unknown field silently; a test should name it)."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    return [_closed(v) for v in schema] if isinstance(schema, list) else schema


@cache
def crd_validator(group: str, version: str, kind: str):
    schema = json.loads(CRD_SCHEMAS[(group, version, kind)].read_text())
    return jsonschema.Draft7Validator(_closed(schema))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates(overlay):
    """Built-in kinds against Kubernetes' schemas (unknown fields refused), the CRDs against their own."""
    docs = rendered(overlay)
    assert docs
    for doc in docs:
        group, _, version = doc["apiVersion"].rpartition("/")
        if (group, version, doc["kind"]) in CRD_SCHEMAS:
            errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                      for e in crd_validator(group, version, doc["kind"]).iter_errors(doc)]
            assert not errors, (doc["kind"], doc["metadata"]["name"], errors[:5])
        else:  # a kind it has no schema for is SchemaNotFoundError: a failure too
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert doc["metadata"].get("namespace") == "moegate"


def test_validation_catches_a_misspelled_field():
    """The checks above can fail: a typo in a LeaderWorkerSet and in a Deployment is refused."""
    lws = json.loads(json.dumps(by_kind("one-gpu", "LeaderWorkerSet")[0]))
    lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["arg"] = ["x"]
    assert list(crd_validator("leaderworkerset.x-k8s.io", "v1", "LeaderWorkerSet").iter_errors(lws))
    deployment = json.loads(json.dumps(by_kind("one-gpu", "Deployment")[0]))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@cache
def parser():
    return build_parser()


def parsed_command(container: dict):
    argv = container["command"] + container.get("args", [])
    argv = [re.sub(r"\$\((\w+)\)", lambda m: ENV_STANDINS[m.group(1)], a) for a in argv]
    assert argv[0] == "moegate", argv
    return parser().parse_args(argv[1:])  # a bad flag or value is SystemExit(2)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_commands_are_moegate_commands(overlay):
    """Each moegate command in the manifests parses with moegate's parser and builds its configs (the engine's
    rule table included); the gateway attaches engine addresses that are Services the overlay creates, and its
    secrets come from the environment by the names the code reads."""
    commands = {}
    for doc, _, c in moegate_containers(overlay):
        if c["command"][0] == "bash":  # the worker pods' rank script: test_worker_ranks_script
            continue
        args = parsed_command(c)
        commands.setdefault(args.command, []).append((doc, c, args))
        env = {e["name"] for e in c.get("env", [])}
        if args.command in ("serve", "db"):
            assert "MOEGATE_DATABASE_URL" in env
        if args.command in ("serve", "engine"):
            engine_flags.engine_config(args)
        if args.command == "engine":
            assert "MOEGATE_ENGINE_KEY" in env
            assert parse_address(args.listen)[1] == c["ports"][0]["containerPort"]
    # (engine-rank: the worker template the API requires of a one-pod group, never started)
    assert set(commands) - {"engine-rank"} == {"serve", "db"} | ({"engine"} if overlay != "inference-pool" else set())
    (doc, gateway, serve), = commands["serve"]
    config = gateway_flags.gateway_config(serve)
    assert config.host == "0.0.0.0" and config.metrics_host == "0.0.0.0"
    assert {"MOEGATE_ADMIN_TOKEN", "MOEGATE_DATABASE_URL"} <= {e["name"] for e in gateway["env"]}
    assert all("value" not in e for e in gateway["env"])  # secrets by reference only
    leaders = {f"{lws['metadata']['name']}-0.{lws['metadata']['name']}": lws for lws in by_kind(overlay, "LeaderWorkerSet")}
    remote = {"--engine": serve.engine, "--prefill-engine": serve.prefill_engine, "--decode-engine": serve.decode_engine}
    attached = {parse_address(a)[0]: flag for flag, addresses in remote.items() for a in addresses}
    assert set(attached) == set(leaders)  # every engine set attached, each by its leader's name
    for host, flag in attached.items():
        leader = leaders[host]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
        role = parsed_command(leader).role
        assert {"--engine": "both", "--prefill-engine": "prefill", "--decode-engine": "decode"}[flag] == role
    if overlay == "inference-pool":
        assert serve.local_replicas == 1 and not attached
        assert gateway["resources"]["limits"]["nvidia.com/gpu"] == "1"
    else:
        assert serve.local_replicas == 0 and "nvidia.com/gpu" not in gateway["resources"].get("requests", {})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_services_match_the_gateway(overlay):
    """Readiness asks /health, a GET route of the gateway's app, on the port it listens on; the API's Service
    reaches that port and the metrics Service the /metrics listener's; the InferencePool targets the API port."""
    from gateway.app import create_app
    from gateway.config import GatewayConfig

    routes = {(r.method, r.resource.canonical) for r in create_app(GatewayConfig(), object()).router.routes()}
    deployment, = [d for d in by_kind(overlay, "Deployment") if d["metadata"]["name"] == "moegate-gateway"]
    gateway, = deployment["spec"]["template"]["spec"]["containers"]
    config = gateway_flags.gateway_config(parsed_command(gateway))
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports == {"http": config.port, "metrics": config.metrics_port}
    probe = gateway["readinessProbe"]["httpGet"]
    assert ("GET", probe["path"]) in routes and probe["path"] == "/health" and ports[probe["port"]] == config.port
    assert ports[gateway["livenessProbe"]["tcpSocket"]["port"]] == config.port
    services = {s["metadata"]["name"]: s for s in by_kind(overlay, "Service")}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for name, port in (("moegate", "http"), ("moegate-metrics", "metrics")):
        service = services[name]["spec"]
        assert service["type"] == "ClusterIP" and [p["targetPort"] for p in service["ports"]] == [port]
        assert service["selector"].items() <= labels.items()
    pdb, = by_kind(overlay, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for pool in by_kind(overlay, "InferencePool"):
        assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert [p["number"] for p in pool["spec"]["targetPorts"]] == [config.port]
        picker = services[pool["spec"]["endpointPickerRef"]["name"]]["spec"]
        assert [p["port"] for p in picker["ports"]] == [pool["spec"]["endpointPickerRef"]["port"]["number"]]
        epp, = [d for d in by_kind(overlay, "Deployment") if d["spec"]["template"]["metadata"]["labels"].items()
                >= picker["selector"].items()]
        epp_args = dict(a.split("=", 1) for a in epp["spec"]["template"]["spec"]["containers"][0]["args"])
        assert epp_args["--pool-name"] == pool["metadata"]["name"]
        assert int(epp_args["--model-server-metrics-port"]) == config.metrics_port  # it scrapes the queue metrics
        assert deployment["spec"]["replicas"] >= 2 and pdb["spec"]["minAvailable"] == 1


def test_gpus_and_parallel_sizes_agree():
    """Each engine group asks for as many GPUs as it runs ranks: its size times the GPUs of a pod is the
    engine's tensor x pipeline world, and the leader starts one rank per GPU of its own pod."""
    for overlay, world in (("one-gpu", 1), ("one-node-8", 8), ("two-nodes-8", 16), ("pd", 1)):
        for lws in by_kind(overlay, "LeaderWorkerSet"):
            t = lws["spec"]["leaderWorkerTemplate"]
            leader = t["leaderTemplate"]["spec"]["containers"][0]
            gpus = int(leader["resources"]["limits"]["nvidia.com/gpu"])
            config = engine_flags.engine_config(parsed_command(leader))
            assert config.tensor_parallel_size * config.pipeline_parallel_size == world == t.get("size", 1) * gpus
            assert config.local_ranks in (None, gpus)


def test_worker_ranks_script(tmp_path):
    """The two-node worker pod's script, run with LeaderWorkerSet's variables and a stand-in moegate that
    records its environment: ranks 8-15 of a world of 16 on GPUs 0-7, meeting at the leader's rendezvous port,
    each a `moegate engine-rank` that parses, started again when it ends."""
    lws, = by_kind("two-nodes-8", "LeaderWorkerSet")
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    container, = worker["containers"]
    configmap, = by_kind("two-nodes-8", "ConfigMap")
    mount, = [m for m in container["volumeMounts"] if m["name"] == "worker-ranks"]
    volume, = [v for v in worker["volumes"] if v["name"] == "worker-ranks"]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    script_name = container["command"][1].removeprefix(mount["mountPath"] + "/")
    (tmp_path / script_name).write_text(configmap["data"][script_name])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "moegate"
    # Records each start; the second start of a rank ends its restart loop (its parent subshell).
    fake.write_text('#!/usr/bin/env bash\nrecord="$RECORDS/$RANK"\n'
                    'if [ -e "$record" ]; then echo again >> "$record.restarted"; kill -TERM $PPID; exit 1; fi\n'
                    'printf "%s\\n" "$RANK $LOCAL_RANK $WORLD_SIZE $MASTER_ADDR $MASTER_PORT" "$*" > "$record"\n'
                    'exit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    records = tmp_path / "records"
    records.mkdir()
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORDS": str(records),
           "LWS_LEADER_ADDRESS": ENV_STANDINS["LWS_LEADER_ADDRESS"], "LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2",
           **{e["name"]: e["value"] for e in container["env"]}}
    script = subprocess.run(["bash", str(tmp_path / script_name)], env=env, timeout=60, capture_output=True)
    assert script.returncode == 0, script.stderr
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    init = parsed_command(leader).distributed_init_method.removeprefix("tcp://")
    for rank in range(8, 16):
        variables, argv = (records / str(rank)).read_text().splitlines()
        assert variables.split() == [str(rank), str(rank - 8), "16", *init.split(":")]
        assert parser().parse_args(shlex.split(argv)).command == "engine-rank"
        assert (records / f"{rank}.restarted").exists()
    assert sorted(int(p.name) for p in records.iterdir() if "." not in p.name) == list(range(8, 16))
