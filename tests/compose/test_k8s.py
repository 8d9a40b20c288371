"""Static checks of compose/k8s/ (no cluster here): every manifest validates against the
Kubernetes schema of a fixed version (`kubernetes-validate` bundles the schemas: offline), and
the manifests agree with the code: every role has a workload with probes, every env name is a
setting the role reads, the gateway's probes are its real open endpoints, and the NATS and MinIO
chart values give the cluster the services' seed lists name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import types

import kubernetes_validate
import pytest
import yaml

from services import cli
from services.cluster_config import ROLES
from services.gateway.config import GatewayConfig
from services.gateway.http import OPEN_PATHS, build_app
from services.infra import nats_auth
from services.infra.minio_server import KV_BUCKET, KV_POLICY, KV_USER, bucket_policy
from services.infra.nats_server import MAX_PAYLOAD, nats_binary
from services.infra.procs import repo_root
from services.kvstore.config import KVStoreConfig
from services.scheduler.config import SchedulerConfig
from services.tokenizer.app import TokenizerConfig
from services.vision.app import VisionServiceConfig
from shared.config import ENV_PREFIX
from shared.nats_auth import NatsAuth
from shared.worker.config import WorkerConfig, drain_grace_s

K8S = os.path.join(repo_root(), "compose", "k8s")
KUBE_VERSION = "1.33.0"  # the schema every manifest must satisfy (strict: no unknown fields)

CONFIGS = {
    "gateway": GatewayConfig,
    "tokenizer": TokenizerConfig,
    "vision": VisionServiceConfig,
    "scheduler": SchedulerConfig,
    "prefill": WorkerConfig,
    "decode": WorkerConfig,
    "kvstore": KVStoreConfig,
}
# Read by every role's NATS connection (`NatsAuth.from_env`), beside the config fields.
NATS_ENV = {f"{ENV_PREFIX}NATS_{f.upper()}" for f in NatsAuth.model_fields} | {
    f"{ENV_PREFIX}NATS_PASSWORD_FILE"
}


def settings(role: str) -> set[str]:
    """Every env var ``role`` reads: its config's fields as `ServiceConfig.load` names them."""
    return {ENV_PREFIX + name.upper() for name in CONFIGS[role].model_fields} | NATS_ENV


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


@pytest.fixture(scope="module")
def kustomization() -> dict:
    (doc,) = load(os.path.join(K8S, "kustomization.yaml"))
    return doc


@pytest.fixture(scope="module")
def docs(kustomization) -> list[dict]:
    return [d for f in kustomization["resources"] for d in load(os.path.join(K8S, f))]


def find(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def workloads(docs: list[dict]) -> dict[str, dict]:
    """role -> its Deployment (StatefulSet for kvstore), by the `strata serve` command."""
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            (c,) = d["spec"]["template"]["spec"]["containers"]
            assert c["command"][:2] == ["strata", "serve"], d["metadata"]["name"]
            role = c["command"][2]
            assert role not in out, f"two workloads for {role}"
            out[role] = d
    return out


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


@pytest.fixture(scope="module")
def common(docs) -> dict[str, str]:
    return find(docs, "ConfigMap", "strata-common")["data"]


@pytest.fixture(scope="module")
def nats_values() -> dict:
    (doc,) = load(os.path.join(K8S, "helm", "nats-values.yaml"))
    return doc


@pytest.fixture(scope="module")
def minio_values() -> dict:
    (doc,) = load(os.path.join(K8S, "helm", "minio-values.yaml"))
    return doc


@pytest.fixture(scope="module")
def readme() -> str:
    with open(os.path.join(K8S, "README.md")) as f:
        return f.read()


def test_kustomization_lists_every_manifest(kustomization):
    files = {f for f in os.listdir(K8S) if f.endswith(".yaml") and f != "kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert kustomization["namespace"] == "strata"


def test_every_manifest_validates_against_the_kubernetes_schema(docs):
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "strata", doc["metadata"]["name"]


def test_the_validator_rejects_a_broken_manifest(docs):
    """The schema check can fail: a misspelt probe field and a string port are refused."""
    bad = json.loads(json.dumps(find(docs, "Deployment", "decode")))
    container(bad)["readinessProbe"]["tcpSocket"]["prot"] = 50051
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)
    bad = json.loads(json.dumps(find(docs, "Service", "gateway")))
    bad["spec"]["ports"][0]["port"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


def test_no_secret_is_committed(docs):
    assert not [d for d in docs if d["kind"] == "Secret"]


def test_every_role_has_a_workload_with_probes_and_resources(docs):
    with open(os.path.join(repo_root(), "compose", "docker-compose.yml")) as f:
        image = yaml.safe_load(f)["x-strata"]["image"]
    by_role = workloads(docs)
    assert sorted(by_role) == sorted(ROLES)
    for role, w in by_role.items():
        assert w["kind"] == ("StatefulSet" if role == "kvstore" else "Deployment"), role
        pod = w["spec"]["template"]
        assert w["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert pod["spec"]["restartPolicy"] == "Always"
        c = container(w)
        assert c["image"] == image  # compose/Dockerfile's image
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            spec = c[probe]
            action = spec.get("httpGet") or spec.get("tcpSocket")
            assert action and action["port"] in ports, (role, probe)
        assert {"cpu", "memory"} <= c["resources"]["requests"].keys(), role


def test_env_names_are_settings_the_role_reads(docs, common):
    everything = set().union(*(settings(r) for r in ROLES))
    for key, value in common.items():
        assert key in everything, f"ConfigMap: {key} is no Strata setting"
        assert isinstance(value, str)
    for role, w in workloads(docs).items():
        c = container(w)
        assert c["envFrom"] == [{"configMapRef": {"name": "strata-common"}}]
        env = {e["name"]: e for e in c["env"]}
        assert len(env) == len(c["env"]), f"{role}: duplicate env"
        for name in env:
            assert name in settings(role), f"{role}: {name} is not a setting it reads"
        assert env["STRATA_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["STRATA_NATS_USER"]["value"] == role
        ref = env["STRATA_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "strata-nats", "key": nats_auth.compose_password_var(role)}
        # gRPC and /metrics bind and advertise the pod's routable address, never loopback.
        ip = {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["STRATA_METRICS_HOST"]["valueFrom"] == ip
        if "grpc_host" in CONFIGS[role].model_fields:
            assert env["STRATA_GRPC_HOST"]["valueFrom"] == ip, role
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports["grpc"] == int(common["STRATA_GRPC_PORT"])
        metrics = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
        assert metrics == int(common["STRATA_METRICS_PORT"])


def test_gateway_probes_hit_its_open_health_endpoints(docs):
    w = find(docs, "Deployment", "gateway")
    c = container(w)
    env = {e["name"]: e.get("value") for e in c["env"]}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == int(env["STRATA_PORT"]) and env["STRATA_HOST"] == "0.0.0.0"
    # a public bind needs an API key (the gateway refuses to start without one)
    key = {e["name"]: e for e in c["env"]}["STRATA_API_KEYS"]["valueFrom"]["secretKeyRef"]
    assert key == {"name": "strata-gateway", "key": "apiKey"}
    # The app's routes (building it only registers them; nothing is served or called).
    cfg = GatewayConfig.load([], role="gateway")
    app = build_app(types.SimpleNamespace(cfg=cfg, auth=None))
    gets = {r.path for r in app.routes if "GET" in (getattr(r, "methods", None) or ())}
    live = c["livenessProbe"]["httpGet"]
    ready = c["readinessProbe"]["httpGet"]
    assert (live["path"], ready["path"]) == ("/health/live", "/health/ready")
    for probe in (live, ready, c["startupProbe"]["httpGet"]):
        assert probe["port"] == "http"
        assert probe["path"] in gets and probe["path"] in OPEN_PATHS  # no API key on a probe
    svc = find(docs, "Service", "gateway")
    assert svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"


def test_only_the_gateway_and_the_kvstore_shards_have_services(docs, common):
    """gRPC peers are reached at the pod address they advertise; the kvstore shards need stable
    names because clients hash blocks over STRATA_KVSTORE_ADDRS."""
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert sorted(services) == ["gateway", "kvstore"]
    kv = find(docs, "StatefulSet", "kvstore")
    head = services["kvstore"]["spec"]
    assert head["clusterIP"] == "None" and kv["spec"]["serviceName"] == "kvstore"
    n = kv["spec"]["replicas"]
    want = [f"kvstore-{i}.kvstore:{common['STRATA_GRPC_PORT']}" for i in range(n)]
    assert common["STRATA_KVSTORE_ADDRS"].split(",") == want


def test_prefill_and_decode_have_autoscaler_hints(docs):
    hpas = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"].startswith("Horiz")}
    assert sorted(hpas) == ["decode", "prefill"]
    for role, hpa in hpas.items():
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["apiVersion"]) == ("Deployment", "apps/v1")
        assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
        assert "replicas" not in find(docs, "Deployment", role)["spec"]  # the HPA owns it
        (metric,) = hpa["spec"]["metrics"]
        assert metric["resource"]["name"] == "cpu"  # needs the cpu request set above


def test_prefill_and_decode_drain_before_the_sigterm(docs, common, monkeypatch, tmp_path, capsys):
    """A pod removed (scale-down, rollout, eviction) retires as the planner retires an instance
    locally: its preStop hook `strata drain` reaches the instance on the socket the pod's env
    names, and the grace period covers the longest drain its settings allow (the drain itself on
    a real instance: tests/cluster/test_drain.py)."""
    for role in ("prefill", "decode"):
        w = find(docs, "Deployment", role)
        c = container(w)
        assert c["lifecycle"]["preStop"]["exec"]["command"] == ["strata", "drain"]
        env = {**common, **{e["name"]: e["value"] for e in c["env"] if "value" in e}}
        fields = {k[len(ENV_PREFIX) :].lower(): v for k, v in env.items()}
        cfg = WorkerConfig.load(
            [], role=role, **{k: v for k, v in fields.items() if k in WorkerConfig.model_fields}
        )
        assert cfg.drain_socket
        grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= drain_grace_s(cfg), (role, grace, drain_grace_s(cfg))
    # `strata drain` without arguments asks the socket STRATA_DRAIN_SOCKET names: the pod's env
    sock = tmp_path / "drain.sock"
    monkeypatch.setenv("STRATA_DRAIN_SOCKET", str(sock))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["drain"])
    assert exit_.value.code == 1
    assert f"cannot reach the instance at {sock}" in capsys.readouterr().err


def commands(readme: str) -> list[str]:
    """The README's shell lines, continuation lines (``\\``) joined."""
    return re.sub(r"\\\n\s*", " ", readme).splitlines()


def chart_install(readme: str, chart: str, values: str) -> str:
    """The release name of the README's `helm install <release> <chart> ... -f <values>`."""
    lines = [ln for ln in commands(readme) if ln.startswith("helm install ")]
    (line,) = [ln for ln in lines if f" {chart} " in ln]
    assert "-n strata" in line and f"-f {values}" in line, line
    assert os.path.isfile(os.path.join(repo_root(), values))
    return line.split()[2]


def test_nats_values_make_a_three_node_jetstream_cluster(nats_values, common, readme):
    cfg = nats_values["config"]
    assert cfg["cluster"]["enabled"] is True and cfg["cluster"]["replicas"] == 3
    # routes authenticate; the password comes from a generated file, never from the values
    assert cfg["cluster"]["routeURLs"] == {"user": "route"}
    (install,) = [ln for ln in commands(readme) if ln.startswith("helm install nats ")]
    assert "--set-file config.cluster.routeURLs.password=nats-route.password" in install
    assert any("openssl rand" in ln and "> nats-route.password" in ln for ln in commands(readme))
    js = cfg["jetstream"]
    assert js["enabled"] is True and js["fileStore"]["enabled"] is True
    assert js["fileStore"]["pvc"]["enabled"] is True
    release = chart_install(readme, "nats/nats", "compose/k8s/helm/nats-values.yaml")
    seeds = [f"nats://{release}-{i}.{release}-headless:4222" for i in range(3)]
    assert common["STRATA_NATS_URL"].split(",") == seeds
    assert common["STRATA_JS_REPLICAS"] == "3"


def test_nats_values_carry_the_per_role_users(nats_values, tmp_path):
    """The users are `nats_auth`'s, passwords read from the env the chart fills from the Secret;
    rendered as the chart does (JSON, "<< x >>" unquoted), nats-server accepts the config."""
    merge = nats_values["config"]["merge"]
    assert merge["max_payload"] == MAX_PAYLOAD
    users = merge["authorization"]["users"]
    assert [u["user"] for u in users] == list(nats_auth.USERS)
    env = nats_values["container"]["env"]
    for u in users:
        var = nats_auth.compose_password_var(u["user"])
        assert u["password"] == f"<< ${var} >>"
        assert u["permissions"] == nats_auth.permissions(u["user"])
        assert env[var] == {"valueFrom": {"secretKeyRef": {"name": "strata-nats", "key": var}}}
    assert "no_auth_user" not in json.dumps(merge)
    text = "\n".join(
        f"{k}: " + re.sub(r'"<< (.*?) >>"', r"\1", json.dumps(v)) for k, v in merge.items()
    )
    (tmp_path / "nats.conf").write_text(text + "\n")
    run_env = dict(os.environ, **{v: f"pw-{v}" for v in env})
    res = subprocess.run(
        [nats_binary(), "-t", "-c", str(tmp_path / "nats.conf")],
        capture_output=True,
        text=True,
        timeout=30,
        env=run_env,
    )
    assert res.returncode == 0 and "is valid" in res.stdout + res.stderr, res.stderr


def test_minio_values_make_distributed_minio_with_the_kv_user(minio_values, docs, common, readme):
    v = minio_values
    assert v["mode"] == "distributed"
    assert v["replicas"] * v["drivesPerNode"] * v["pools"] == 4 and v["replicas"] == 4
    release = chart_install(readme, "minio/minio", "compose/k8s/helm/minio-values.yaml")
    nodes = [f"{release}-{i}.{release}-svc:9000" for i in range(v["replicas"])]
    assert common["STRATA_MINIO_ENDPOINT"].split(",") == nodes
    assert v["existingSecret"] == "strata-minio"
    assert [b["name"] for b in v["buckets"]] == [KV_BUCKET]
    (policy,) = v["policies"]
    assert policy["name"] == KV_POLICY
    want = [
        {"resources": s["Resource"], "actions": s["Action"]}
        for s in bucket_policy(KV_BUCKET)["Statement"]
    ]
    assert policy["statements"] == want
    (user,) = v["users"]
    assert (user["accessKey"], user["policy"]) == (KV_USER, KV_POLICY)
    env = {e["name"]: e for e in container(find(docs, "StatefulSet", "kvstore"))["env"]}
    assert env["STRATA_MINIO_ACCESS_KEY"]["value"] == KV_USER
    ref = env["STRATA_MINIO_SECRET_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": user["existingSecret"], "key": user["existingSecretKey"]}


def test_readme_creates_every_secret_the_manifests_reference(docs, readme, nats_values):
    """Each (Secret, key) a pod or a chart reads is created by a README command."""
    refs = set()
    for w in workloads(docs).values():
        for e in container(w)["env"]:
            if ref := e.get("valueFrom", {}).get("secretKeyRef"):
                refs.add((ref["name"], ref["key"]))
    for e in nats_values["container"]["env"].values():
        ref = e["valueFrom"]["secretKeyRef"]
        refs.add((ref["name"], ref["key"]))
    refs |= {("strata-minio", "rootUser"), ("strata-minio", "rootPassword")}  # existingSecret
    assert {name for name, _ in refs} == {"strata-nats", "strata-minio", "strata-gateway"}
    creates = [ln for ln in commands(readme) if "kubectl create secret generic" in ln]
    (nats_cmd,) = [ln for ln in creates if "generic strata-nats " in ln]
    assert "--from-env-file" in nats_cmd  # `strata nats-credentials` writes every key
    assert "strata nats-credentials" in readme
    (minio_cmd,) = [ln for ln in creates if "generic strata-minio " in ln]
    (gateway_cmd,) = [ln for ln in creates if "generic strata-gateway " in ln]
    for name, key in refs:
        if name == "strata-minio":
            assert f"--from-literal={key}=" in minio_cmd, key
        if name == "strata-gateway":
            assert f"--from-literal={key}=" in gateway_cmd, key
