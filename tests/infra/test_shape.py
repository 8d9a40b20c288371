"""The deployment shape: the pure decision from cores / accelerators / flags, the affinity
setting, and a cluster of dummy apps (real nats-server) that starts the chosen shape pinned."""

from __future__ import annotations

import io
import os

import pytest

import services.launcher as launcher
from services import shape
from services.cluster_config import ROLES
from services.infra.nats_server import NatsServer
from services.launcher import Cluster
from services.serving_dtype import checkpoint_dtype, serving_dtype, weight_bytes
from services.shape import choose_shape, format_cpus, parse_cpus
from tests.infra.fake_apps import write_fake_apps, write_fake_checkpoint


def test_two_cores_colocate_with_every_core_as_threads():
    s = choose_shape([0, 1])
    assert (s.prefill, s.decode, s.torch_threads, s.colocated) == (0, 1, 2, True)
    assert s.model_cpus == {"decode-0": [0, 1]} and s.service_cpus == []
    assert s.line == (
        "shape: colocated prefill+decode on 2 cores (1 decode x 2 torch threads); "
        "pass --prefill 1 to disaggregate"
    )


def test_few_cores_colocate_and_keep_a_core_for_services_from_four():
    s = choose_shape([0, 1, 2, 3])
    assert (s.prefill, s.torch_threads) == (0, 3)
    assert s.model_cpus == {"decode-0": [0, 1, 2]} and s.service_cpus == [3]
    s = choose_shape(list(range(6)), decode=2)  # the leftover core goes to decode-0
    assert s.prefill == 0 and s.model_cpus == {"decode-0": [0, 1, 4], "decode-1": [2, 3]}
    assert s.service_cpus == [5] and s.torch_threads == 2


def test_enough_cores_disaggregate_on_separate_cores():
    s = choose_shape(list(range(8)))
    assert (s.prefill, s.decode, s.torch_threads, s.colocated) == (1, 1, 3, False)
    assert s.model_cpus == {"prefill-0": [0, 1, 2], "decode-0": [3, 4, 5, 6]}
    assert s.service_cpus == [7]
    assert "disaggregated, 1 prefill + 1 decode on 8 cores" in s.line
    s = choose_shape(list(range(32)), decode=2)
    assert s.prefill == 1 and s.service_cpus == [28, 29, 30, 31]
    assert [len(s.model_cpus[n]) for n in ("prefill-0", "decode-0", "decode-1")] == [9, 10, 9]
    assert set().union(*map(set, s.model_cpus.values())).isdisjoint(s.service_cpus)


def test_one_accelerator_per_model_process_disaggregates_on_few_cores():
    assert choose_shape([0, 1], accelerators=2).prefill == 1
    assert choose_shape([0, 1], accelerators=2).torch_threads == 1
    assert choose_shape([0, 1], accelerators=1).prefill == 0  # one device for two processes
    assert choose_shape([0, 1], accelerators=2, decode=2).prefill == 0


def test_explicit_flags_win():
    s = choose_shape([0, 1], prefill=1)
    assert (s.prefill, s.torch_threads) == (1, 1)
    assert s.model_cpus == {"prefill-0": [0], "decode-0": [1]}
    assert "pass --prefill" not in s.line  # the user chose
    s = choose_shape(list(range(16)), prefill=0, torch_threads=4)
    assert (s.prefill, s.torch_threads, s.model_cpus["decode-0"]) == (0, 4, list(range(14)))
    s = choose_shape([0, 1], prefill=0, torch_threads=4)  # more threads than cores: not pinned
    assert (s.torch_threads, s.model_cpus) == (4, {})
    s = choose_shape([0, 1], prefill=2, decode=2)  # more processes than cores: not pinned
    assert (s.prefill, s.torch_threads, s.model_cpus) == (2, 1, {})
    with pytest.raises(ValueError, match="no usable cores"):
        choose_shape([])


def test_cpu_lists_round_trip_and_bad_ones_name_the_setting():
    assert parse_cpus("0-2,5, 7-8") == [0, 1, 2, 5, 7, 8]
    assert format_cpus([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    assert format_cpus([3]) == "3" and parse_cpus("3") == [3]
    for bad in ("x", "3-1", "-1", ",", "1-2-3"):
        with pytest.raises(ValueError, match="STRATA_CPU_AFFINITY"):
            parse_cpus(bad)


def test_apply_affinity_pins_to_the_usable_part(monkeypatch):
    calls = []
    monkeypatch.setattr(shape, "usable_cores", lambda: [0, 1, 2])
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append((pid, cpus)))
    assert shape.apply_affinity({}) is None and calls == []
    assert shape.apply_affinity({"STRATA_CPU_AFFINITY": "1-5"}) == [1, 2]
    assert calls == [(0, {1, 2})]
    with pytest.raises(ValueError, match="none of these cores is usable"):
        shape.apply_affinity({"STRATA_CPU_AFFINITY": "7"})


def test_service_env_carries_the_shape(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "usable_cores", lambda: list(range(16)))
    c = Cluster(str(tmp_path))
    c.nats = NatsServer(4333, str(tmp_path))
    c.model_dir = str(tmp_path)
    c._kvstore_addrs = ["127.0.0.1:7001"]
    assert (c.cfg.prefill, c.cfg.torch_threads) == (1, 7)
    env = {r: c.service_spec(r, 0).env for r in ROLES}
    assert env["prefill"]["STRATA_CPU_AFFINITY"] == "0-6"
    assert env["decode"]["STRATA_CPU_AFFINITY"] == "7-13"
    assert env["decode"]["STRATA_TORCH_THREADS"] == "7"
    for role in ("gateway", "tokenizer", "scheduler", "kvstore", "vision"):
        assert env[role]["STRATA_CPU_AFFINITY"] == "14-15", role
        assert env[role]["OMP_NUM_THREADS"] == "1", role
    assert env["vision"]["STRATA_TORCH_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in env["decode"]


@pytest.mark.parametrize(
    "cores,kw,want",
    [
        (2, {"dp": 2}, (0, 2, 1)),  # colocated: two decode replicas, a core each
        (2, {"dp": 3, "decode": 1}, (0, 3, 1)),
        (16, {"dp": 2}, (2, 2, 3)),  # the machine chose PD: 2 prefill + 2 decode
        (16, {"dp": 2, "prefill": 1, "decode": 2}, (2, 4, 2)),
    ],
)
def test_dp_multiplies_the_model_instances(tmp_path, monkeypatch, cores, kw, want):
    """``--dp N``: N replicas of each model-serving instance, each its own instance with its
    own share of the cores (the scheduler balances them as it does any instances)."""
    monkeypatch.setattr(launcher, "usable_cores", lambda: list(range(cores)))
    c = Cluster(str(tmp_path), **kw)
    assert (c.cfg.prefill, c.cfg.decode, c.cfg.torch_threads) == want
    assert c.cfg.role_args["scheduler"][-2:] == ["--policy", "prefix_aware"]
    if c.shape.model_cpus:  # pinned (enough cores): one disjoint slice per instance
        names = [n for n in c.shape.model_cpus if n.startswith(("prefill", "decode"))]
        assert len(names) == want[0] + want[1]
        cpus = [set(c.shape.model_cpus[n]) for n in names]
        assert all(not (a & b) for i, a in enumerate(cpus) for b in cpus[i + 1 :])


@pytest.fixture
def fake(tmp_path):
    root = write_fake_apps(tmp_path / "apps")
    model = write_fake_checkpoint(tmp_path / "model", "Qwen3ForCausalLM")
    env = {
        "STRATA_APP_PACKAGE": "fakeapps",
        "PYTHONPATH": os.pathsep.join([launcher.repo_root(), root]),
    }
    return {"env": env, "model": model}


need_two = pytest.mark.skipif(len(shape.usable_cores()) < 2, reason="needs 2 usable cores")


@need_two
def test_cluster_starts_the_colocated_shape_on_two_cores(fake, monkeypatch):
    cores = shape.usable_cores()[:2]
    monkeypatch.setattr(launcher, "usable_cores", lambda: cores)
    out = io.StringIO()
    with Cluster(fake["model"], minio=False, vision=0, env=fake["env"], log_stream=out) as c:
        assert "[strata] shape: colocated prefill+decode on 2 cores" in out.getvalue()
        assert c.names() == ["scheduler-0", "tokenizer-0", "kvstore-0", "decode-0", "gateway-0"]
        assert "decode-0 starting argv=[] threads=2" in c.logs("decode-0")
        assert os.sched_getaffinity(c.sup.procs["decode-0"].pid) == set(cores)


@need_two
def test_cluster_pins_prefill_and_decode_to_their_own_cores(fake, monkeypatch):
    cores = shape.usable_cores()[:2]
    monkeypatch.setattr(launcher, "usable_cores", lambda: cores)
    with Cluster(fake["model"], minio=False, vision=0, prefill=1, env=fake["env"]) as c:
        assert c.names("prefill") == ["prefill-0"]
        assert "decode-0 starting argv=[] threads=1" in c.logs("decode-0")
        assert os.sched_getaffinity(c.sup.procs["prefill-0"].pid) == {cores[0]}
        assert os.sched_getaffinity(c.sup.procs["decode-0"].pid) == {cores[1]}
        assert len(os.sched_getaffinity(c.sup.procs["gateway-0"].pid)) >= 2  # not pinned


def test_native_half_reads_the_cpu_flags():
    from shared.model.cpu_kernels import native_half

    assert native_half("bfloat16", "flags : fpu avx2 avx512f avx512_bf16")
    assert native_half("bfloat16", "flags : fpu avx2 amx_bf16 amx_tile")
    assert not native_half("bfloat16", "flags : fpu avx2 avx512f avx512_vnni")
    assert not native_half("float16", "flags : fpu avx2 avx512_bf16")
    assert native_half("float32", "flags : fpu")


def test_a_half_checkpoint_is_served_in_float32_where_the_cpu_emulates_it(tmp_path):
    ck = write_fake_checkpoint(tmp_path / "bf16")
    (tmp_path / "bf16" / "config.json").write_text('{"text_config": {"torch_dtype": "bfloat16"}}')
    (tmp_path / "bf16" / "README.md").write_text("not weights")
    assert checkpoint_dtype(ck) == "bfloat16"
    assert checkpoint_dtype(str(tmp_path / "missing")) == "float32"
    assert weight_bytes(ck) == 10  # model.safetensors: an 8-byte length and "{}"
    assert weight_bytes(str(tmp_path / "missing")) == 0
    dtype, why = serving_dtype("bfloat16", "", "cpu", native=False)
    assert dtype == "float32" and "--dtype bfloat16 keeps it" in why
    # asked for, native, on a GPU, or already fp32: left alone, without a word
    assert serving_dtype("bfloat16", "bfloat16", "cpu", native=False) == ("bfloat16", "")
    assert serving_dtype("bfloat16", "", "cpu", native=True) == ("", "")
    assert serving_dtype("bfloat16", "", "cuda", native=False) == ("", "")
    assert serving_dtype("float32", "", "cpu", native=False) == ("", "")
    # float32 weights would take more than half of memory: the half type stays, and it says so
    gib = 2**30
    dtype, why = serving_dtype("bfloat16", "", "cpu", False, weights=7 * gib, memory=24 * gib)
    assert dtype == "" and "bfloat16 kept: float32 weights (14.0 GiB)" in why
    assert serving_dtype("bfloat16", "", "cpu", False, weights=gib, memory=24 * gib)[0] == (
        "float32"
    )


@need_two
def test_the_start_up_line_says_when_a_bf16_checkpoint_runs_in_float32(fake, monkeypatch):
    import json

    path = os.path.join(fake["model"], "config.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        json.dump({**cfg, "torch_dtype": "bfloat16"}, f)
    monkeypatch.setattr("shared.model.cpu_kernels.native_half", lambda dtype: False)
    out = io.StringIO()
    with Cluster(fake["model"], minio=False, vision=0, env=fake["env"], log_stream=out) as c:
        assert "[strata] dtype float32: the checkpoint is bfloat16" in out.getvalue()
        assert c.service_spec("decode", 1).env["STRATA_DTYPE"] == "float32"
        assert c.service_spec("tokenizer", 1).env["STRATA_DTYPE"] == "float32"


def test_a_model_process_warns_when_it_runs_an_emulated_half_type(monkeypatch, caplog):
    import torch

    from shared.worker.runtime import warn_emulated_half

    monkeypatch.setattr("shared.model.cpu_kernels.native_half", lambda dtype: dtype == "float32")
    assert warn_emulated_half(torch.bfloat16, "cpu")
    assert "running bfloat16 on a CPU without a native bfloat16 matrix unit" in caplog.text
    assert not warn_emulated_half(torch.float32, "cpu")
    assert not warn_emulated_half(torch.bfloat16, "cuda")
