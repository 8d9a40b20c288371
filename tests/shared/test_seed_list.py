"""STRATA_NATS_URL takes one URL or a comma-separated seed list (nats-py ``servers=[...]``), and
``js_replicas`` is a validated setting; both checked without a server."""

from __future__ import annotations

import pytest

from shared.bus import nats_servers
from shared.config import ConfigError, ServiceConfig


def test_one_url_and_a_seed_list():
    assert nats_servers("nats://127.0.0.1:4222") == ["nats://127.0.0.1:4222"]
    assert nats_servers("nats://10.0.0.1:4222, nats://10.0.0.2:4222,tls://n3:4222") == [
        "nats://10.0.0.1:4222",
        "nats://10.0.0.2:4222",
        "tls://n3:4222",
    ]


@pytest.mark.parametrize("bad", ["", "nats://a:4222,", "10.0.0.1:4222", "http://a:4222"])
def test_bad_seed_entry_names_the_setting(bad):
    with pytest.raises(ConfigError, match="STRATA_NATS_URL"):
        nats_servers(bad)


def test_js_replicas_setting(monkeypatch):
    assert ServiceConfig.load([]).js_replicas == 1
    monkeypatch.setenv("STRATA_JS_REPLICAS", "3")
    assert ServiceConfig.load([]).js_replicas == 3
    with pytest.raises(ConfigError, match="STRATA_JS_REPLICAS"):
        ServiceConfig.load(["--js-replicas", "0"])


def test_nats_url_is_a_typed_list(monkeypatch):
    assert ServiceConfig.load([]).nats_url == ["nats://127.0.0.1:4222"]
    monkeypatch.setenv("STRATA_NATS_URL", "nats://10.0.0.1:4222, nats://10.0.0.2:4222")
    cfg = ServiceConfig.load([])
    assert cfg.nats_url == ["nats://10.0.0.1:4222", "nats://10.0.0.2:4222"]
    assert nats_servers(cfg.nats_url) == cfg.nats_url
    assert ServiceConfig.load(["--nats-url", "tls://n3:4222"]).nats_url == ["tls://n3:4222"]
    assert ServiceConfig(nats_url=["nats://a:1"]).nats_url == ["nats://a:1"]


@pytest.mark.parametrize(
    "bad,why",
    [
        ("nats://a:4222,", "empty entry in the comma-separated list"),
        ("nats://a:4222,,nats://b:4222", "empty entry in the comma-separated list"),
        ("", "needs a nats://host:port URL"),
        ("nats://a:4222,10.0.0.1:4222", "'10.0.0.1:4222' is not a nats://host:port URL"),
    ],
)
def test_bad_nats_url_setting_names_it(bad, why):
    with pytest.raises(ConfigError) as err:
        ServiceConfig.load(["--nats-url", bad])
    assert f"STRATA_NATS_URL (--nats-url): Value error, {why}" in str(err.value)


def test_kvstore_addrs_and_minio_endpoint_are_typed_lists(monkeypatch):
    from services.kvstore.config import KVStoreConfig
    from shared.worker.config import WorkerConfig

    assert WorkerConfig.load([]).kvstore_addrs == []
    monkeypatch.setenv("STRATA_KVSTORE_ADDRS", "10.0.0.1:7001, 10.0.0.2:7001")
    assert WorkerConfig.load([]).kvstore_addrs == ["10.0.0.1:7001", "10.0.0.2:7001"]
    assert WorkerConfig.load([]).engine_config().collect_evicted_kv
    monkeypatch.setenv("STRATA_KVSTORE_ADDRS", "10.0.0.1:7001,,10.0.0.2:7001")
    with pytest.raises(ConfigError, match=r"STRATA_KVSTORE_ADDRS \(--kvstore-addrs\): .*empty"):
        WorkerConfig.load([])

    creds = dict(minio_access_key="k", minio_secret_key="s")
    assert KVStoreConfig.load([]).minio_endpoint == []
    got = KVStoreConfig.load(["--minio-endpoint", "m1:9000,m2:9000"], **creds).minio_endpoint
    assert got == ["m1:9000", "m2:9000"]
    with pytest.raises(ConfigError, match=r"STRATA_MINIO_ENDPOINT \(--minio-endpoint\): .*empty"):
        KVStoreConfig.load(["--minio-endpoint", "m1:9000,"], **creds)
