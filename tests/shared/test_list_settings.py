"""Every list setting is a typed list, written comma-separated in env and flags: the gateway's
API keys, image formats and remote image hosts, the scheduler's long-prompt instances and
degradation thresholds (floats). Checked without a server."""

from __future__ import annotations

import typing

import pytest

from services.gateway.config import GatewayConfig
from services.kvstore.config import KVStoreConfig
from services.scheduler.config import SchedulerConfig
from shared.config import ConfigError, ServiceConfig
from shared.worker.config import WorkerConfig


def test_gateway_lists(monkeypatch):
    cfg = GatewayConfig.load([])
    assert cfg.api_keys == [] and cfg.remote_image_hosts == []
    assert cfg.image_formats == ["PNG", "JPEG", "WEBP", "GIF", "BMP"]
    monkeypatch.setenv("STRATA_API_KEYS", "sk-1, sk-2")
    cfg = GatewayConfig.load(["--image-formats", "png", "--remote-image-hosts", "a.test,b.test"])
    assert cfg.api_keys == ["sk-1", "sk-2"]
    assert (cfg.image_formats, cfg.remote_image_hosts) == (["png"], ["a.test", "b.test"])
    with pytest.raises(ConfigError, match=r"STRATA_API_KEYS \(--api-keys\).*empty entry"):
        GatewayConfig.load(["--api-keys", "sk-1,,sk-2"])


def test_scheduler_lists():
    cfg = SchedulerConfig.load([])
    assert cfg.degrade_up == [0.8, 0.9, 0.97] and cfg.long_instances == []
    cfg = SchedulerConfig.load(
        ["--degrade-up", "0.5, 0.6,0.7", "--degrade-down", "0.4,0.5,0.6"]
        + ["--long-instances", "p-1,p-2"]
    )
    assert (cfg.thresholds().up, cfg.thresholds().down) == ((0.5, 0.6, 0.7), (0.4, 0.5, 0.6))
    assert cfg.long_instance_set() == frozenset({"p-1", "p-2"})
    with pytest.raises(ConfigError, match="STRATA_DEGRADE_DOWN.*three comma-separated"):
        SchedulerConfig.load(["--degrade-down", "0.5,0.6"])
    with pytest.raises(ConfigError, match="STRATA_DEGRADE_UP"):
        SchedulerConfig.load(["--degrade-up", "0.5,high,0.7"])


@pytest.mark.parametrize(
    "model", [ServiceConfig, GatewayConfig, SchedulerConfig, KVStoreConfig, WorkerConfig]
)
def test_no_setting_is_a_comma_separated_string(model):
    """A field whose description says comma-separated is a list."""
    for name, field in model.model_fields.items():
        if "comma-separated" in (field.description or "").lower():
            assert typing.get_origin(field.annotation) is list, f"{model.__name__}.{name}"
