"""The `strata` CLI: argument handling, role dispatch, and the env each service is given."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from services import cli
from services.cluster_config import DTYPE_ROLES, ROLES, ClusterConfig
from services.infra.nats_server import NatsServer
from services.launcher import Cluster


def test_up_flags_map_to_cluster_config():
    args = cli.up_parser().parse_args(
        [
            "--model",
            "/m",
            "--port",
            "9000",
            "--prefill",
            "2",
            "--decode",
            "3",
            "--no-minio",
            "--torch-threads",
            "2",
            "--env",
            "STRATA_DEVICE=cuda",
            "--env",
            "A=b=c",
            "--data-dir",
            "/tmp/d",
            "--vision",
            "0",
            "--metrics-port-base",
            "9100",
        ]
    )
    cfg = cli.config_from_args(args)
    assert (cfg.model, cfg.port, cfg.prefill, cfg.decode, cfg.minio) == ("/m", 9000, 2, 3, False)
    assert (cfg.torch_threads, cfg.vision, cfg.kvstore, cfg.metrics_port_base) == (2, 0, 1, 9100)
    assert cfg.env == {"STRATA_DEVICE": "cuda", "A": "b=c"}
    assert cfg.data_dir == "/tmp/d" and cfg.die_with_parent is True


def test_up_defaults():
    cfg = cli.config_from_args(cli.up_parser().parse_args([]))
    # prefill and torch threads unset: the launcher picks them from the machine (test_shape.py)
    assert (cfg.port, cfg.prefill, cfg.decode, cfg.torch_threads, cfg.minio) == (
        8000,
        None,
        1,
        None,
        True,
    )
    assert cfg.data_dir.endswith("/.data") and cfg.model == ""


def test_up_bad_arguments_exit_with_a_message(capsys):
    with pytest.raises(SystemExit, match="--env expects KEY=VALUE"):
        cli.config_from_args(cli.up_parser().parse_args(["--env", "NOVALUE"]))
    with pytest.raises(SystemExit) as e:
        cli.up_parser().parse_args(["--decode", "many"])
    assert e.value.code == 2 and "invalid int value: 'many'" in capsys.readouterr().err
    with pytest.raises(ValidationError, match="decode"):
        cli.config_from_args(cli.up_parser().parse_args(["--decode", "0"]))


def test_up_negated_and_switch_flags():
    d = cli.config_from_args(cli.up_parser().parse_args([]))
    assert (d.restart, d.nats_auth, d.minio, d.color, d.nats_tls_verify) == (
        True,
        True,
        True,
        None,
        False,
    )
    argv = ["--no-restart", "--no-nats-auth", "--no-minio", "--no-color", "--nats-tls-verify"]
    cfg = cli.config_from_args(cli.up_parser().parse_args(argv))
    assert (cfg.restart, cfg.nats_auth, cfg.minio, cfg.color, cfg.nats_tls_verify) == (
        False,
        False,
        False,
        False,
        True,
    )
    assert Cluster(config=cfg).sup.sink.color is False


def test_up_flags_are_derived_from_cluster_config():
    actions = {a.dest: a for a in cli.up_parser()._actions if a.dest != "help"}
    fields = {n: f for n, f in ClusterConfig.model_fields.items() if n not in cli.UP_SKIP}
    assert set(actions) == set(fields)
    for name, field in fields.items():
        flag = "--" + name.replace("_", "-")
        a = actions[name]
        assert a.option_strings in ([flag], ["--no-" + flag[2:]]), name
        assert field.description in a.help, name
        if name not in cli.UP_DEFAULTS:
            assert a.default in (field.get_default(call_default_factory=True), []), name


def _up_flags_table() -> set[str]:
    """Every flag the first column of docs/OPERATIONS.md's `strata up` flags table names."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md").read_text()
    section = text.split("### `strata up` flags", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {f for row in rows for f in re.findall(r"--[a-z][a-z0-9-]*", row.split("|")[1])}


def test_up_flags_table_in_operations_md_matches_help():
    parser = cli.up_parser()
    listed = {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}
    help_text = parser.format_help()
    assert all(flag in help_text for flag in listed)
    table = _up_flags_table()
    assert len(table) > 20
    assert listed - table == set(), "flags of `strata up --help` missing from OPERATIONS.md"
    assert table - listed == set(), "OPERATIONS.md lists flags `strata up` does not have"


def test_top_level_usage(capsys):
    for argv, code in (([], 2), (["--help"], 0), (["bogus"], 2), (["serve"], 2)):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == code, argv
    err = capsys.readouterr()
    assert "strata serve <role>" in err.out
    assert "unknown command 'bogus'" in err.err
    assert "roles: scheduler, tokenizer, vision, kvstore, prefill, decode, gateway" in err.err


def test_serve_unknown_role(capsys):
    assert cli.serve("nosuch", []) == 2
    assert "unknown role 'nosuch'" in capsys.readouterr().err


@pytest.fixture
def app_pkg(tmp_path, monkeypatch):
    """A throwaway app package: `recorder/decode/app.py` records its argv; no gateway app."""
    pkg = tmp_path / "recorder"
    (pkg / "decode").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "decode" / "app.py").write_text("CALLS = []\ndef main(argv):\n    CALLS.append(argv)\n")
    (pkg / "tokenizer").mkdir()
    (pkg / "tokenizer" / "app.py").write_text("import not_a_real_module_xyz\n")
    (pkg / "vision").mkdir()
    (pkg / "vision" / "app.py").write_text("main = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(cli.APP_PACKAGE_ENV, "recorder")
    yield "recorder"
    for name in [m for m in sys.modules if m.startswith("recorder")]:
        del sys.modules[name]


def test_serve_imports_the_role_app_lazily_and_passes_flags(app_pkg):
    assert cli.serve("decode", ["--nats-url", "nats://x:1", "--block-size", "4"]) == 0
    app = importlib.import_module("recorder.decode.app")
    assert app.CALLS == [["--nats-url", "nats://x:1", "--block-size", "4"]]


def test_serve_missing_app_is_a_clear_message(app_pkg, capsys):
    assert cli.serve("gateway", []) == 1
    err = capsys.readouterr().err
    assert "the gateway service is not available: module recorder.gateway.app not found" in err
    assert cli.serve("vision", []) == 1
    assert "recorder.vision.app has no main(argv) function" in capsys.readouterr().err


def test_serve_app_with_a_broken_import_shows_the_real_error(app_pkg):
    with pytest.raises(ModuleNotFoundError, match="not_a_real_module_xyz"):
        cli.serve("tokenizer", [])


def test_service_env_gives_each_role_its_settings(tmp_path):
    c = Cluster(
        str(tmp_path),
        decode=2,
        kvstore=2,
        port=8123,
        torch_threads=3,
        dtype="bfloat16",
        env={"STRATA_BLOCK_SIZE": "4"},
        role_args={"decode": ["--max-num-seqs", "8"]},
    )
    c.nats = NatsServer(4333, str(tmp_path))
    c.model_dir = str(tmp_path)
    c._kvstore_addrs = ["127.0.0.1:7001", "127.0.0.1:7002"]
    specs = {r: c.service_spec(r, 1 if r in ("decode", "kvstore") else 0) for r in ROLES}
    for role, spec in specs.items():
        e = spec.env
        assert e["STRATA_NATS_URL"] == "nats://127.0.0.1:4333"
        assert e["STRATA_INSTANCE_ID"] == spec.name
        assert e["STRATA_MODEL"] == str(tmp_path) and e["STRATA_BLOCK_SIZE"] == "4"
        assert int(e["STRATA_METRICS_PORT"]) > 0
        assert spec.argv[1:5] == ["-m", "services.cli", "serve", role]
        assert ("STRATA_TORCH_THREADS" in e) == (role in ("vision", "prefill", "decode"))
        # the tokenizer too: its block hashes carry the fingerprint, dtype included
        assert e.get("STRATA_DTYPE") == ("bfloat16" if role in DTYPE_ROLES else None), role
    assert specs["decode"].name == "decode-1"
    assert specs["decode"].argv[5:] == ["--max-num-seqs", "8"]
    assert specs["decode"].env["STRATA_TORCH_THREADS"] == "3"
    # the auto KV budget splits the memory among the model processes of this machine
    engines = str(c.cfg.prefill + 2)
    assert {r for r, s in specs.items() if "STRATA_HOST_ENGINES" in s.env} == {"prefill", "decode"}
    assert specs["decode"].env["STRATA_HOST_ENGINES"] == engines
    assert specs["decode"].env["STRATA_KVSTORE_ADDRS"] == "127.0.0.1:7001,127.0.0.1:7002"
    assert specs["kvstore"].env["STRATA_GRPC_PORT"] == "7002"
    assert "STRATA_MINIO_ENDPOINT" not in specs["kvstore"].env  # not started: no MinIO
    assert specs["gateway"].env["STRATA_PORT"] == "8123"
    assert len({s.env["STRATA_METRICS_PORT"] for s in specs.values()}) == len(ROLES)
    with pytest.raises(ValueError, match="unknown role 'router'"):
        c.service_spec("router", 0)


def test_metrics_ports_count_up_from_the_base(tmp_path):
    c = Cluster(str(tmp_path), metrics_port_base=9100)
    c.nats = NatsServer(4333, str(tmp_path))
    c.model_dir = str(tmp_path)
    ports = [c.service_spec("tokenizer", i).env["STRATA_METRICS_PORT"] for i in range(3)]
    assert ports == ["9100", "9101", "9102"]


def test_cluster_config_rejects_unknown_settings():
    with pytest.raises(ValidationError, match="prefil"):
        ClusterConfig(prefil=2)
    with pytest.raises(ValidationError, match="torch_threads"):
        Cluster("", torch_threads=0)


def test_model_commands_build_into_the_given_dir_or_the_cache(tmp_path, monkeypatch, capsys):
    from shared.model import default_model

    calls = []
    monkeypatch.setattr(
        default_model, "build_default_model", lambda out: calls.append(("default", str(out))) or out
    )
    monkeypatch.setattr(
        default_model,
        "build_benchmark_model",
        lambda out: calls.append(("benchmark", str(out))) or out,
    )
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    assert cli.model_cmd(["build-default", str(tmp_path / "m")]) == 0
    assert cli.model_cmd(["build-benchmark"]) == 0
    assert cli.model_cmd(["build-default"]) == 0
    assert calls == [
        ("default", str(tmp_path / "m")),
        ("benchmark", str(tmp_path / "cache" / "models" / "benchmark")),
        ("default", str(tmp_path / "cache" / "models" / "default")),
    ]
    assert capsys.readouterr().out.splitlines() == [
        str(tmp_path / "m"),
        str(tmp_path / "cache/models/benchmark"),
        str(tmp_path / "cache/models/default"),
    ]
    with pytest.raises(SystemExit):
        cli.model_cmd(["build-everything"])


def test_ensure_model_validates_the_checkpoint(tmp_path):
    from services.cluster_config import ensure_model
    from shared.model.errors import CheckpointError
    from tests.infra.fake_apps import write_fake_checkpoint

    with pytest.raises(CheckpointError, match="no config.json there"):
        ensure_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="unsupported architecture None"):
        ensure_model(str(tmp_path))
    assert ensure_model(write_fake_checkpoint(tmp_path)) == str(tmp_path)
