"""compose/k8s/helm/minio-values.yaml rendered by the upstream MinIO chart itself.

`helm template` (helm built by scripts/setup.sh from its pinned Go module) renders the chart that
ships in the Go module of the MinIO `strata up` runs (github.com/minio/minio at MINIO_VERSION,
folder helm/minio, chart 5.4.0: the one compose/k8s/README.md installs), read from the module
cache setup fills; nothing is fetched here. Every rendered object validates against the
Kubernetes schema, and the render is the store the services are configured for: 4 nodes x 1
drive behind `minio-svc` (the seed list in strata-common), root credentials only from the Secret,
the KV bucket, and the kvstore's user with exactly the policy `strata up` provisions.

The NATS chart (nats-io/k8s) is on no registry CI reaches; compose/k8s/README.md records its
render by hand."""

from __future__ import annotations

import json
import os
import re
import subprocess

import kubernetes_validate
import pytest
import yaml

from services.infra.minio_server import KV_BUCKET, KV_POLICY, KV_USER, MINIO_VERSION, bucket_policy
from services.infra.procs import cache_dir, repo_root
from tests.compose.test_k8s import K8S, KUBE_VERSION, chart_install, load

HELM_VERSION = "v3.22.0"  # scripts/setup.sh builds this one (HELM_VERSION there)
CHART_VERSION = "5.4.0"
VALUES = "compose/k8s/helm/minio-values.yaml"


def helm_binary() -> str:
    path = os.path.join(cache_dir(), "bin", "helm")
    res = subprocess.run([path, "version", "--short"], capture_output=True, text=True)
    if not os.access(path, os.X_OK) or not res.stdout.startswith(HELM_VERSION):
        pytest.fail(
            f"helm {HELM_VERSION} not in {path}: run scripts/setup.sh --compose (it builds it)"
        )
    return path


def minio_chart() -> str:
    chart = os.path.join(
        cache_dir(), "go", "mod", "github.com", "minio", f"minio@{MINIO_VERSION}", "helm", "minio"
    )
    if not os.path.isfile(os.path.join(chart, "Chart.yaml")):
        pytest.fail(
            f"the MinIO chart is not in {chart}: run scripts/setup.sh --compose (it downloads it)"
        )
    return chart


def test_setup_pins_the_helm_this_test_expects():
    with open(os.path.join(repo_root(), "scripts", "setup.sh")) as f:
        assert f'HELM_VERSION="{HELM_VERSION}"' in f.read()


@pytest.fixture(scope="module")
def readme() -> str:
    with open(os.path.join(K8S, "README.md")) as f:
        return f.read()


@pytest.fixture(scope="module")
def rendered(readme) -> list[dict]:
    """The objects of the README's `helm install` of MinIO, rendered offline."""
    release = chart_install(readme, "minio/minio", VALUES)
    chart = minio_chart()
    with open(os.path.join(chart, "Chart.yaml")) as f:
        assert yaml.safe_load(f)["version"] == CHART_VERSION
    assert f"--version {CHART_VERSION}" in readme, "the README must pin the rendered chart"
    res = subprocess.run(
        [helm_binary(), "template", release, chart, "-n", "strata", "-f", VALUES]
        + ["--kube-version", KUBE_VERSION],
        cwd=repo_root(),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HELM_CACHE_HOME": os.path.join(cache_dir(), "helm")},
    )
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def find(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_every_rendered_object_validates(rendered):
    kinds = sorted({d["kind"] for d in rendered})
    assert {"StatefulSet", "Service", "ConfigMap", "Job", "PodDisruptionBudget"} <= set(kinds)
    for d in rendered:
        kubernetes_validate.validate(d, KUBE_VERSION, strict=True)


def test_four_nodes_one_drive_each_behind_the_seed_list(rendered):
    sts = find(rendered, "StatefulSet", "minio")
    assert sts["spec"]["replicas"] == 4 and sts["spec"]["serviceName"] == "minio-svc"
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    cmd = " ".join(c["command"])
    assert "http://minio-{0...3}.minio-svc.strata.svc/export " in cmd, cmd
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "100Gi"
    common = {}
    for d in load(os.path.join(K8S, "configmap.yaml")):
        common.update(d.get("data", {}))
    hosts = [ep.split(":")[0] for ep in common["STRATA_MINIO_ENDPOINT"].split(",")]
    assert hosts == [f"minio-{i}.minio-svc" for i in range(4)]
    svc = find(rendered, "Service", "minio-svc")
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["port"] for p in svc["spec"]["ports"]} == {9000}
    pdb = find(rendered, "PodDisruptionBudget", "minio")
    assert pdb["spec"]["maxUnavailable"] == 1


def test_root_credentials_come_only_from_the_secret(rendered):
    assert not [d for d in rendered if d["kind"] == "Secret"], "the chart made a Secret"
    (c,) = find(rendered, "StatefulSet", "minio")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    for name, key in (("MINIO_ROOT_USER", "rootUser"), ("MINIO_ROOT_PASSWORD", "rootPassword")):
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "strata-minio", "key": key}


def test_the_kv_bucket_user_and_policy_are_those_strata_up_provisions(rendered):
    data = find(rendered, "ConfigMap", "minio")["data"]
    (policy_file,) = [k for k in data if k.startswith("policy_")]
    assert json.loads(data[policy_file]) == bucket_policy(KV_BUCKET)
    policy = policy_file.removesuffix(".json")
    assert re.search(rf"^ *createPolicy {KV_POLICY} {policy}$", data["add-policy"], re.M)
    assert re.search(rf'^ *createBucket {KV_BUCKET} "none" false\b', data["initialize"], re.M)
    user = data["add-user"]
    assert re.search(rf"^ *echo {KV_USER} > ", user, re.M), user
    assert re.search(r"^ *cat /config/secrets/strata-minio/kvPassword >> ", user, re.M), user
    assert re.search(rf"^ *createUser {KV_POLICY}$", user, re.M), user
    # one post-install Job runs the three scripts, with the user's password from the Secret
    (job,) = [d for d in rendered if d["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    scripts = [c["command"][-1] for c in pod["initContainers"] + pod["containers"]]
    assert sorted(scripts) == ["/config/add-policy", "/config/add-user", "/config/initialize"]
    items = [
        (src["secret"]["name"], item["key"])
        for vol in pod["volumes"]
        for src in vol.get("projected", {}).get("sources", [])
        if "secret" in src
        for item in src["secret"].get("items", [])
    ]
    assert items == [("strata-minio", "kvPassword")], pod["volumes"]
