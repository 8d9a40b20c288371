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
