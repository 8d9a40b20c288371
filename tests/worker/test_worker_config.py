"""`WorkerConfig` derives its engine settings from `EngineConfig` (no hand-copied fields): every
engine field a worker may set is a setting, with the dataclass's default and docstring, and a
bad value or combination names its ``STRATA_*`` variable and flag. No model, no NATS."""

from __future__ import annotations

import dataclasses

import pytest

from shared.config import ConfigError, attribute_docs
from shared.engine.params import EngineConfig
from shared.worker.config import ENGINE_DERIVED, WorkerConfig


def load(argv: list[str] | None = None, **kw) -> WorkerConfig:
    return WorkerConfig.load(argv or [], role="decode", instance_id="d", **kw)


def test_every_settable_engine_field_is_a_setting_with_its_default_and_doc():
    docs = attribute_docs(EngineConfig)
    fields = WorkerConfig.model_fields
    for f in dataclasses.fields(EngineConfig):
        if f.name in ENGINE_DERIVED:
            assert f.name not in fields
            continue
        assert f.name in fields, f.name
        if f.name not in ("device", "dtype"):  # model settings, shared with vision
            assert fields[f.name].description.startswith(docs[f.name]), f.name
    assert fields["preemption_mode"].default == "recompute"
    assert (fields["ngram_min"].default, fields["ngram_max"].default) == (1, 4)
    assert fields["quantization"].default == "" and fields["async_scheduling"].default == "auto"


def test_defaults_build_the_default_engine_config():
    """Every setting's default is the engine's, but the step budget, which follows the device."""
    assert load().engine_config() == EngineConfig(max_num_batched_tokens=512)
    assert load(device="cuda").engine_config().max_num_batched_tokens == 2048
    assert load(max_num_seqs=1000).engine_config().max_num_batched_tokens == 1000
    assert load(max_num_batched_tokens=4096).engine_config().max_num_batched_tokens == 4096


def test_new_settings_from_env_and_flags(monkeypatch):
    monkeypatch.setenv("STRATA_PREEMPTION_MODE", "swap")
    monkeypatch.setenv("STRATA_NGRAM_MAX", "6")
    cfg = load(["--ngram-min", "2", "--quantization", "int8", "--dtype", "float32"])
    ec = cfg.engine_config()
    assert (ec.preemption_mode, ec.ngram_min, ec.ngram_max) == ("swap", 2, 6)
    assert (ec.quantization, ec.dtype, ec.async_scheduling) == ("int8", "float32", None)
    assert not ec.collect_evicted_kv
    assert load(kvstore_addrs="127.0.0.1:1").engine_config().collect_evicted_kv


def test_kv_pool_save_auto_by_device_and_old_boolean_words(monkeypatch):
    """auto: every block on CUDA, recurring ones on CPU; true/false keep meaning all/off; the
    engine gets the policy only with a kvstore."""
    pool = "127.0.0.1:1"
    assert load(kvstore_addrs=pool).kv_pool_save == "reused"
    assert load(kvstore_addrs=pool).engine_config().pool_save == "reused"
    assert load(kvstore_addrs=pool, device="cuda").kv_pool_save == "all"
    assert load().engine_config().pool_save == "off"
    for word, policy in (("true", "all"), ("false", "off"), ("reused", "reused"), ("all", "all")):
        monkeypatch.setenv("STRATA_KV_POOL_SAVE", word)
        assert load(kvstore_addrs=pool).engine_config().pool_save == policy
    monkeypatch.setenv("STRATA_KV_POOL_SAVE", "sometimes")
    with pytest.raises(ConfigError, match="KV_POOL_SAVE"):
        load()


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            ["--preemption-mode", "later"],
            'STRATA_PREEMPTION_MODE (--preemption-mode): must be "recompute" or "swap" '
            "(got 'later')",
        ),
        (["--ngram-min", "5"], "STRATA_NGRAM_MIN (--ngram-min): need 1 <= ngram_min <= ngram_max"),
        (["--quantization", "int4"], "STRATA_QUANTIZATION (--quantization): must be None or"),
        (
            ["--max-num-seqs", "64", "--max-num-batched-tokens", "32"],
            "STRATA_MAX_NUM_BATCHED_TOKENS (--max-num-batched-tokens): must be >= max_num_seqs",
        ),
        (["--block-size", "0"], "STRATA_BLOCK_SIZE (--block-size): Input should be greater"),
        (["--block-size", "2048"], "STRATA_BLOCK_SIZE (--block-size): Input should be less"),
        (["--async-scheduling", "maybe"], "STRATA_ASYNC_SCHEDULING (--async-scheduling)"),
    ],
)
def test_bad_engine_setting_names_the_setting(argv, needle):
    with pytest.raises(ConfigError) as err:
        load(argv)
    assert needle in str(err.value), str(err.value)
