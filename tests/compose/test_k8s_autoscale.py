"""compose/k8s-autoscale/: the prefill and decode Deployments sized by the scheduler's planner
(`strata_scheduler_desired_instances{role}`), through KEDA (`keda/`: a ScaledObject per role
with a Prometheus trigger) or through prometheus-adapter (`hpa/`: the HPAs on an External
metric), checked offline.

The real kustomize, the one kubectl 1.33 embeds (built by scripts/setup.sh from its Go module),
builds compose/k8s and both overlays. Every Kubernetes object validates against the 1.33 schema
(strict), and so does the HPA KEDA makes of each ScaledObject. KEDA's CRD schema itself is on no
registry reached here; the ScaledObjects pass the validators npm's `@kubernetes-models/keda`
compiles from KEDA's API schema (types, required fields: installed by setup.sh), which accept
unknown fields, so their field names are checked here against the same package's type
declarations. The metric, its labels, the scheduler's bounds and settings are the code's:
imported, not repeated.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import kubernetes_validate
import pytest
from prometheus_client import REGISTRY, generate_latest

from services.infra.procs import cache_dir, repo_root
from services.infra.scaler import parse_need
from services.scheduler import metrics
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.planner import ROLES
from shared.config import ENV_PREFIX
from tests.compose.test_k8s import K8S, KUBE_VERSION, container, find, load

KUSTOMIZE_VERSION = "v5.6.0"  # scripts/setup.sh builds this one: kubectl 1.33's
KEDA_MODELS_VERSION = "2.0.0"  # npm @kubernetes-models/keda, installed by scripts/setup.sh
OVERLAYS = os.path.join(repo_root(), "compose", "k8s-autoscale")
GAUGE = metrics.DESIRED_INSTANCES
TARGET_LABELS = {"namespace"}  # added by Prometheus' Kubernetes scrape, not by the scheduler
PROMETHEUS_METADATA = {"serverAddress", "query", "threshold", "ignoreNullValues"}
"""The Prometheus scaler parameters used, each documented by KEDA (scalers/prometheus)."""
KEDA_TYPES = os.path.join(
    cache_dir(), "node", "keda", "node_modules", "@kubernetes-models", "keda", "keda.sh", "v1alpha1"
)


def kustomize(path: str) -> list[dict]:
    binary = os.path.join(cache_dir(), "bin", "kustomize")
    res = subprocess.run([binary, "version"], capture_output=True, text=True)
    if res.stdout.strip() != KUSTOMIZE_VERSION:
        pytest.fail(
            f"kustomize {KUSTOMIZE_VERSION} not in {binary}: run scripts/setup.sh --compose"
        )
    res = subprocess.run([binary, "build", path], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    import yaml

    return [d for d in yaml.safe_load_all(res.stdout) if d]


def keda_fields(interface: str) -> set[str]:
    """Field names of a KEDA type, from `@kubernetes-models/keda`'s declarations."""
    path = os.path.join(KEDA_TYPES, f"{interface}.d.ts")
    if not os.path.isfile(path):
        pytest.fail(f"{path} missing: run scripts/setup.sh --compose (npm installs it)")
    with open(path) as f:
        text = f.read()
    (body,) = re.findall(rf"export interface I{interface} \{{\n(.*?)\n\}}", text, re.S)
    return set(re.findall(r'^    "(\w+)"\??:', body, re.M))


def keda_validate(objects: list[dict]) -> list[str]:
    """The error of each object under `@kubernetes-models/keda`'s ScaledObject validator."""
    script = (
        'import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1";\n'
        'import fs from "fs";\n'
        "const out = JSON.parse(fs.readFileSync(0)).map((d) => {\n"
        '  try { new ScaledObject(d).validate(); return ""; } catch (e) { return e.message; }\n'
        "});\n"
        "console.log(JSON.stringify(out));\n"
    )
    res = subprocess.run(
        ["node", "--input-type=module", "-e", script],
        input=json.dumps(objects),
        cwd=os.path.join(cache_dir(), "node", "keda"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def scheduler_config(docs: list[dict]) -> SchedulerConfig:
    """The scheduler's settings as its pod gets them: the ConfigMap, then its env values."""
    env = dict(find(docs, "ConfigMap", "strata-common")["data"])
    env.update(
        {
            e["name"]: e["value"]
            for e in container(find(docs, "Deployment", "scheduler"))["env"]
            if "value" in e
        }
    )
    fields = {k[len(ENV_PREFIX) :].lower(): v for k, v in env.items()}
    return SchedulerConfig.load(
        [],
        role="scheduler",
        **{k: v for k, v in fields.items() if k in SchedulerConfig.model_fields},
    )


def selector(query: str) -> tuple[str, dict[str, str]]:
    """(metric, label matchers) of ``max(metric{a="x",b="y"})``: the one form used."""
    m = re.fullmatch(r'max\((\w+)\{((?:\w+="[^"]*",?)*)\}\)', query)
    assert m, query
    return m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))


def exported(cfg: SchedulerConfig) -> str:
    """The scheduler's /metrics text once its core exported the need (no load: each role's
    minimum)."""
    SchedulerCore(cfg).plan_scale()
    return generate_latest(REGISTRY).decode()


def samples(text: str, metric: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = re.fullmatch(rf"{metric}\{{(.*)\}} (\S+)", line)
        if m:
            out.append((dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))), float(m.group(2))))
    return out


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return kustomize(K8S)


@pytest.fixture(scope="module")
def keda() -> list[dict]:
    return kustomize(os.path.join(OVERLAYS, "keda"))


@pytest.fixture(scope="module")
def hpa() -> list[dict]:
    return kustomize(os.path.join(OVERLAYS, "hpa"))


def test_setup_pins_the_tools_this_test_expects():
    with open(os.path.join(repo_root(), "scripts", "setup.sh")) as f:
        text = f.read()
    assert f'KUSTOMIZE_VERSION="{KUSTOMIZE_VERSION}"' in text
    assert f'KEDA_MODELS_VERSION="{KEDA_MODELS_VERSION}"' in text


def test_the_default_kustomization_builds_to_the_manifests(base):
    """`kubectl apply -k compose/k8s` (no KEDA, no adapter) applies exactly the files."""
    (kust,) = load(os.path.join(K8S, "kustomization.yaml"))
    files = [d for f in kust["resources"] for d in load(os.path.join(K8S, f))]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(base, key=key) == sorted(files, key=key)


def _same_but_scaling(overlay: list[dict], base: list[dict], dropped: set[str]) -> None:
    """``overlay`` is ``base`` but for the scheduler's env and the HPAs."""
    rest = lambda docs: {  # noqa: E731
        (d["kind"], d["metadata"]["name"]): d
        for d in docs
        if d["kind"] not in dropped and d["metadata"]["name"] != "scheduler"
    }
    assert rest(overlay) == rest(base)
    env = container(find(overlay, "Deployment", "scheduler"))["env"]
    before = container(find(base, "Deployment", "scheduler"))["env"]
    added = [e for e in env if e not in before]
    assert len(env) == len(before) + len(added)  # the pod's own settings are all kept
    assert all(e["name"].startswith(f"{ENV_PREFIX}AUTOSCALE") for e in added), added


@pytest.mark.parametrize("overlay", ["keda", "hpa"])
def test_the_scheduler_exports_the_need_and_leaves_retiring_to_kubernetes(overlay, request):
    docs = request.getfixturevalue(overlay)
    cfg = scheduler_config(docs)
    assert cfg.autoscale and not cfg.autoscale_retire
    assert cfg.autoscale_max_prefill > 0  # both roles scaled (the disaggregated shape)
    for d in docs:
        if d["kind"] != "ScaledObject":
            kubernetes_validate.validate(d, KUBE_VERSION, strict=True)


def test_keda_scales_each_role_to_the_planners_need(keda, base):
    _same_but_scaling(keda, base, {"HorizontalPodAutoscaler", "ScaledObject"})
    assert not [d for d in keda if d["kind"] == "HorizontalPodAutoscaler"]  # KEDA makes its own
    cfg = scheduler_config(keda)
    text = exported(cfg)
    objs = {d["metadata"]["name"]: d for d in keda if d["kind"] == "ScaledObject"}
    assert sorted(objs) == sorted(ROLES)
    for role, so in objs.items():
        spec = so["spec"]
        target = spec["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"], target["name"]) == (
            "apps/v1",
            "Deployment",
            role,
        )
        assert "replicas" not in find(keda, "Deployment", role)["spec"]  # KEDA's HPA owns it
        lo, hi = cfg.scale_config().bounds(role)
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (lo, hi)
        (trig,) = spec["triggers"]
        assert (trig["type"], trig["metricType"]) == ("prometheus", "AverageValue")
        meta = trig["metadata"]
        assert set(meta) == PROMETHEUS_METADATA
        assert meta["threshold"] == "1" and meta["ignoreNullValues"] == "false"
        name, labels = selector(meta["query"])
        assert name == GAUGE._name
        assert set(labels) - TARGET_LABELS == set(GAUGE._labelnames)
        assert labels == {"namespace": so["metadata"]["namespace"], "role": role}
        # the series the query selects is the one the scheduler exports, at the planner's need
        (value,) = [v for lab, v in samples(text, name) if lab.items() >= {"role": role}.items()]
        assert value == lo == parse_need(text, role)  # what `strata up`'s scaler reads too


def test_scaledobjects_use_only_kedas_fields(keda):
    spec_fields = keda_fields("ScaledObjectSpec")
    for so in (d for d in keda if d["kind"] == "ScaledObject"):
        assert set(so) - {"apiVersion", "kind", "metadata", "spec"} == set()
        assert set(so["spec"]) <= spec_fields, set(so["spec"]) - spec_fields
        assert set(so["spec"]["advanced"]) <= keda_fields("AdvancedConfig")
        hpa_config = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]
        assert set(hpa_config) <= keda_fields("HorizontalPodAutoscalerConfig")
        for trig in so["spec"]["triggers"]:
            assert set(trig) <= keda_fields("ScaleTriggers")


def test_scaledobjects_pass_kedas_schema(keda):
    objs = [d for d in keda if d["kind"] == "ScaledObject"]
    assert keda_validate(objs) == [""] * len(objs)
    # the validator can fail: a number where KEDA wants a string, a string for an integer
    bad = json.loads(json.dumps(objs[0]))
    bad["spec"]["triggers"][0]["metadata"]["threshold"] = 1
    bad["spec"]["minReplicaCount"] = "1"
    (err,) = keda_validate([bad])
    assert "minReplicaCount must be integer" in err and "threshold must be string" in err


def test_the_hpa_keda_makes_validates(keda):
    """KEDA turns a ScaledObject into an autoscaling/v2 HPA on an External metric whose target
    is the trigger's threshold, with the ScaledObject's bounds and behavior: that HPA passes the
    Kubernetes schema, and its arithmetic gives the need as the replica count."""
    for so in (d for d in keda if d["kind"] == "ScaledObject"):
        spec, name = so["spec"], so["metadata"]["name"]
        (trig,) = spec["triggers"]
        made = {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": f"keda-hpa-{name}", "namespace": so["metadata"]["namespace"]},
            "spec": {
                "scaleTargetRef": spec["scaleTargetRef"],
                "minReplicas": spec["minReplicaCount"],
                "maxReplicas": spec["maxReplicaCount"],
                "metrics": [
                    {
                        "type": "External",
                        "external": {
                            "metric": {
                                "name": "s0-prometheus",
                                "selector": {"matchLabels": {"scaledobject.keda.sh/name": name}},
                            },
                            "target": {"type": trig["metricType"], "averageValue": "1"},
                        },
                    }
                ],
                "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
            },
        }
        kubernetes_validate.validate(made, KUBE_VERSION, strict=True)
        # AverageValue: replicas = ceil(metric / target), whatever the current count
        assert int(trig["metadata"]["threshold"]) == 1


def test_hpas_read_the_need_through_prometheus_adapter(hpa, base):
    _same_but_scaling(hpa, base, {"HorizontalPodAutoscaler"})
    cfg = scheduler_config(hpa)
    hpas = {d["metadata"]["name"]: d for d in hpa if d["kind"] == "HorizontalPodAutoscaler"}
    assert sorted(hpas) == sorted(ROLES)
    for role, h in hpas.items():
        kubernetes_validate.validate(h, KUBE_VERSION, strict=True)
        assert (h["spec"]["minReplicas"], h["spec"]["maxReplicas"]) == cfg.scale_config().bounds(
            role
        )
        (m,) = h["spec"]["metrics"]
        ext = m["external"]
        assert ext["metric"]["name"] == GAUGE._name
        assert ext["metric"]["selector"] == {"matchLabels": {"role": role}}
        assert ext["target"] == {"type": "AverageValue", "averageValue": "1"}
    (values,) = load(os.path.join(OVERLAYS, "hpa", "prometheus-adapter-values.yaml"))
    (rule,) = values["rules"]["external"]
    series, labels = re.fullmatch(r"(\w+)\{(.*)\}", rule["seriesQuery"]).groups()
    assert series == GAUGE._name == rule["name"]["as"]
    assert set(re.findall(r"(\w+)!=", labels)) == set(GAUGE._labelnames) | TARGET_LABELS
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}}
    assert rule["metricsQuery"] == "max(<<.Series>>{<<.LabelMatchers>>})"


@pytest.mark.parametrize("overlay", ["base", "keda", "hpa"])
def test_decode_scales_down_one_drain_at_a_time(overlay, request):
    """A removed decode pod may drain for its whole grace period: the next one goes after."""
    docs = request.getfixturevalue(overlay)
    grace = find(docs, "Deployment", "decode")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    for d in docs:
        if d["kind"] == "ScaledObject" and d["metadata"]["name"] == "decode":
            behavior = d["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        elif d["kind"] == "HorizontalPodAutoscaler" and d["metadata"]["name"] == "decode":
            behavior = d["spec"]["behavior"]
    (policy,) = behavior["scaleDown"]["policies"]
    assert (policy["type"], policy["value"]) == ("Pods", 1) and policy["periodSeconds"] >= grace
