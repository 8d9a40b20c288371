"""Cluster-level tests of the KV pool: a real subprocess cluster (`Cluster`) with MinIO, the
built-in tiny model, Prometheus metrics scraped from each service's ``STRATA_METRICS_PORT``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.simulator.realcluster import start_cluster as retrying_start
from services.cluster_config import ensure_model
from services.infra.procs import repo_root
from services.launcher import Cluster

SHARED_PREFIX = (
    "You are the storage assistant of a large inference cluster. Every answer must be short, "
    "precise and name the tier that served the data: engine memory, the kvstore DRAM tier or "
    "the MinIO object store, which keeps blocks across restarts. Blocks are sixteen tokens long "
    "and identified by a chained hash of their tokens, salted with the model fingerprint. "
)


@pytest.fixture(scope="session")
def model_dir() -> str:
    return ensure_model("")


def start_cluster(model_dir: str, **overrides) -> Cluster:
    """A small cluster (1 prefill, 1 decode, 1 kvstore, no vision) with logs in its data dir."""
    overrides.setdefault("ready_timeout", 240.0)
    overrides.setdefault("die_with_parent", True)
    # the tests assert the layer-wise push; its default (auto) depends on the machine's cores
    overrides.setdefault("env", {"STRATA_LAYERWISE_TRANSFER": "true"})
    for role, n in (("prefill", 1), ("decode", 1), ("kvstore", 1), ("vision", 0)):
        overrides.setdefault(role, n)
    return retrying_start(model_dir, **overrides)  # again when a port picked free was taken


def metrics(cluster: Cluster, name: str) -> dict[tuple[str, tuple], float]:
    """``(sample name, sorted labels) -> value`` scraped from service ``name``."""
    port = cluster.specs[name].env["STRATA_METRICS_PORT"]
    with urllib.request.urlopen(f"http://{cluster.cfg.host}:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(cluster: Cluster, name: str, sample: str, **labels: str) -> float:
    """Sum of the samples called ``sample`` whose labels include ``labels`` (0 if none)."""
    want = set(labels.items())
    return sum(
        v for (n, lbl), v in metrics(cluster, name).items() if n == sample and want <= set(lbl)
    )


def transfer_counters(cluster: Cluster) -> dict[str, float]:
    """The KV transfer counters of every prefill and decode service, summed: ``"sent:<mode>"``,
    ``"received:<mode>"`` (bytes) and ``"fallback:<reason>"``, as in `tests.worker.kv_counters`."""
    from shared.worker.kv_metrics import FALLBACK_REASONS, TRANSFER_MODES

    names = [n for n in cluster.specs if n.startswith(("prefill-", "decode-"))]
    samples = {}
    for n in names:
        for key, v in metrics(cluster, n).items():
            samples[key] = samples.get(key, 0.0) + v
    out = {}
    for m in TRANSFER_MODES:
        for kind in ("sent", "received"):
            key = (f"strata_kv_transfer_{kind}_bytes_total", (("mode", m),))
            out[f"{kind}:{m}"] = samples.get(key, 0.0)
    for r in FALLBACK_REASONS:
        out[f"fallback:{r}"] = samples.get(
            ("strata_kv_transfer_fallback_total", (("reason", r),)), 0.0
        )
    return out


def moved_since(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before[k]) for k, v in after.items() if v != before[k]}


def kv_bytes_per_token(model_dir: str) -> int:
    """Float32-engine KV payload bytes of one token: layers x 2 x kv_heads x head_dim x 4."""
    import torch

    from shared.model.loader import load_model

    m = load_model(model_dir).model
    elem = torch.empty((), dtype=m.dtype).element_size()
    return m.num_layers * 2 * m.num_kv_heads * m.head_dim * elem


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def serve_decode_at_once(model: str, flag_sets) -> dict[tuple[str, ...], tuple[int, str]]:
    """``strata serve decode --model MODEL`` with each of ``flag_sets`` (lists of flags), all
    started at once (each spends its seconds importing torch before it reads the checkpoint)
    and none reaching NATS: ``tuple(flags) -> (exit code, stdout + stderr)``."""
    env = dict(os.environ, STRATA_NATS_URL="nats://127.0.0.1:9")  # never reached
    argv = [sys.executable, "-m", "services.cli", "serve", "decode", "--model", model]
    procs = {
        tuple(args): subprocess.Popen(
            argv + list(args),
            cwd=repo_root(),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for args in flag_sets
    }
    out = {}
    try:
        for args, p in procs.items():
            text = p.communicate(timeout=120)[0]
            out[args] = (p.returncode, text)
        return out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
