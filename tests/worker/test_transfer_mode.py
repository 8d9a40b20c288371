"""The prefill -> decode transfer mode setting: what ``auto`` resolves to, and bad values."""

from __future__ import annotations

import pytest

from shared.config import ConfigError
from shared.worker.config import LAYERWISE_SPARE_CORES, WorkerConfig, layerwise_auto, usable_cores


def test_auto_is_on_for_cuda_and_on_cpu_only_with_spare_cores():
    assert layerwise_auto("cuda", 1, 1) and layerwise_auto("cuda:1", 8, 8)
    assert LAYERWISE_SPARE_CORES == 2
    assert not layerwise_auto("cpu", 1, 2)  # the shared 2-core box: copies compete
    assert layerwise_auto("cpu", 1, 3)
    assert not layerwise_auto("cpu", 4, 4)  # a pinned strata-up process: no spare core
    assert not layerwise_auto("cpu", 4, 5) and layerwise_auto("cpu", 4, 6)


def load(**kw) -> WorkerConfig:
    return WorkerConfig.load([], role="prefill", instance_id="p", **kw)


def test_setting_parses_auto_true_false(monkeypatch):
    monkeypatch.delenv("STRATA_LAYERWISE_TRANSFER", raising=False)
    cfg = load()  # the default is auto, decided for this process
    assert cfg.layerwise_transfer is layerwise_auto(cfg.device, cfg.torch_threads, usable_cores())
    assert load(layerwise_transfer="AUTO", device="cuda").layerwise_transfer is True
    every_core = dict(device="cpu", torch_threads=usable_cores())
    assert load(layerwise_transfer="auto", **every_core).layerwise_transfer is False
    monkeypatch.setenv("STRATA_LAYERWISE_TRANSFER", "true")
    assert load().layerwise_transfer is True
    monkeypatch.setenv("STRATA_LAYERWISE_TRANSFER", "0")
    assert load().layerwise_transfer is False
    assert load(layerwise_transfer=True).layerwise_transfer is True  # a bool passes as is


def test_bad_value_names_the_setting(monkeypatch):
    monkeypatch.setenv("STRATA_LAYERWISE_TRANSFER", "sometimes")
    with pytest.raises(ConfigError) as err:
        load()
    msg = str(err.value)
    assert "STRATA_LAYERWISE_TRANSFER" in msg and "expected auto, true or false" in msg
    assert "'sometimes'" in msg
