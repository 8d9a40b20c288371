"""Start-up failures are one line naming the problem and the fix, never a traceback, and a
non-zero exit: `strata up` (bad checkpoint, busy ports, bad flags and settings, no MinIO) and
`strata serve <role>` (bad setting, bad checkpoint, busy port), run as real subprocesses."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from services.infra.procs import free_port, repo_root
from services.infra.supervisor import ProcSpec, ServiceFailed, Supervisor
from services.launcher import Cluster
from tests.infra.fake_apps import write_fake_apps, write_fake_checkpoint


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    res = subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=repo_root(),
        env=dict(os.environ, **(env or {})),
        text=True,
        capture_output=True,
        timeout=timeout,
    )
    assert "Traceback" not in res.stderr + res.stdout, res.stderr + res.stdout
    return res


def up(tmp_path, model: str, *extra: str, env: dict[str, str] | None = None):
    return run_cli(
        "up",
        "--model",
        model,
        "--port",
        str(free_port()),
        "--data-dir",
        str(tmp_path / "data"),
        "--no-color",
        *extra,
        env=env,
    )


def one_failure_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if "start-up failed" in ln]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture
def model(tmp_path) -> str:
    return write_fake_checkpoint(tmp_path / "model")


def _break(model: str, how: str) -> None:
    if how == "no config.json":
        os.remove(os.path.join(model, "config.json"))
    elif how == "corrupt config.json":
        with open(os.path.join(model, "config.json"), "w") as f:
            f.write('{"architectures": [')
    elif how == "unsupported architecture":
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump({"architectures": ["GPT2LMHeadModel"]}, f)
    elif how == "no weights":
        os.remove(os.path.join(model, "model.safetensors"))
    elif how == "no tokenizer":
        os.remove(os.path.join(model, "tokenizer.json"))


BAD_MODELS = [
    ("no config.json", "no config.json there; pass a Hugging Face checkpoint directory"),
    ("corrupt config.json", "config.json: invalid JSON"),
    ("unsupported architecture", "unsupported architecture 'GPT2LMHeadModel' (Strata serves"),
    ("no weights", "no model.safetensors or model.safetensors.index.json"),
    ("no tokenizer", "no tokenizer.json"),
]


@pytest.mark.parametrize("how,needle", BAD_MODELS, ids=[b[0] for b in BAD_MODELS])
def test_up_with_a_bad_checkpoint_fails_before_starting_anything(tmp_path, model, how, needle):
    _break(model, how)
    res = up(tmp_path, model)
    assert res.returncode == 1
    line = one_failure_line(res.stderr)
    assert "bad --model checkpoint:" in line and needle in line, line
    assert not (tmp_path / "data" / "logs").exists()  # no process was started


def test_up_with_a_bad_flag_names_it(tmp_path, model):
    res = up(tmp_path, model, "--torch-threads", "0")
    assert res.returncode == 2
    assert "bad setting --torch-threads: Input should be greater than or equal to 1 (got 0)" in (
        res.stderr
    )


@pytest.mark.parametrize(
    "flag,what", [("--port", "gateway"), ("--nats-port", "nats-server"), ("--minio-port", "MinIO")]
)
def test_up_refuses_busy_ports(tmp_path, model, flag, what):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = up(tmp_path, model, flag, str(port))
    assert res.returncode == 1
    line = one_failure_line(res.stderr)
    assert f"{what} port {port} is already in use (pass {flag}" in line, line


def test_up_without_a_minio_binary_says_how_to_get_one(tmp_path, model):
    env = {"STRATA_CACHE": str(tmp_path / "cache"), "PATH": os.path.dirname(sys.executable)}
    res = up(tmp_path, model, env=env)
    assert res.returncode == 1
    line = one_failure_line(res.stderr)
    assert "minio not found" in line and "or pass --no-minio" in line, line
    res = up(tmp_path, model, env={"STRATA_MINIO_BIN": str(tmp_path / "nope")})
    line = one_failure_line(res.stderr)
    assert f"STRATA_MINIO_BIN={tmp_path / 'nope'}: no such file" in line, line


def test_up_reports_a_service_bad_setting_in_one_line(tmp_path, model):
    root = write_fake_apps(tmp_path / "apps")
    env = {
        "STRATA_APP_PACKAGE": "fakeapps",
        "FAKE_LOAD_CONFIG": "1",
        "PYTHONPATH": os.pathsep.join([repo_root(), root]),
    }
    res = up(tmp_path, model, "--no-minio", "--env", "STRATA_METRICS_PORT=abc", env=env)
    assert res.returncode == 1
    line = one_failure_line(res.stderr)
    assert re.search(
        r"start-up failed: [a-z]+-0: invalid setting STRATA_METRICS_PORT "
        r"\(--metrics-port\): ",
        line,
    ), line
    assert "(got 'abc')" in line and "last log lines" not in res.stderr


@pytest.mark.parametrize(
    "role,args,env,needle",
    [
        (
            "tokenizer",
            [],
            {"STRATA_BLOCK_SIZE": "abc"},
            "invalid setting STRATA_BLOCK_SIZE (--block-size): Input should be a valid integer",
        ),
        ("decode", ["--torch-threads", "0"], {}, "invalid setting STRATA_TORCH_THREADS"),
        (
            "decode",
            ["--model", "/nonexistent/ckpt"],
            {},
            "/nonexistent/ckpt: does not exist; pass a Hugging Face checkpoint directory",
        ),
        ("tokenizer", ["--model", "/nonexistent/ckpt"], {}, "/nonexistent/ckpt: does not exist"),
        (
            "scheduler",
            ["--no-such-flag", "1"],
            {},
            "unknown option(s) for scheduler: --no-such-flag",
        ),
    ],
)
def test_serve_with_a_bad_setting_or_model_is_one_line(model, role, args, env, needle):
    res = run_cli(
        "serve",
        role,
        *args,
        env={"STRATA_MODEL": model, "STRATA_NATS_URL": "nats://127.0.0.1:1", **env},
    )
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]  # one line
    assert res.stderr.startswith(f"STRATA_FATAL {role}: ") and needle in res.stderr, res.stderr


def test_serve_gateway_on_a_busy_port(model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = run_cli(
            "serve", "gateway", "--port", str(port), env={"STRATA_NATS_URL": "nats://127.0.0.1:1"}
        )
    assert res.returncode == 1
    assert res.stderr.startswith(
        f"STRATA_FATAL gateway: gateway port {port} on 127.0.0.1 "
        "cannot be bound (Address already in use); pass --port"
    )


def test_supervisor_reports_the_fatal_line_not_the_tail():
    sup = Supervisor()
    code = "print('loading...'); print('STRATA_FATAL decode: bad thing; fix it'); exit(1)"
    sup.start(ProcSpec("decode-0", [sys.executable, "-c", code]))
    with pytest.raises(ServiceFailed) as err:
        sup.wait_ready(["decode-0"], 30)
    assert str(err.value) == "decode-0: bad thing; fix it"
    assert err.value.fatal == "decode: bad thing; fix it" and "loading..." in err.value.tail
    sup.stop_all(1)


def test_a_text_only_cluster_tells_the_gateway_to_refuse_images(tmp_path):
    from services.infra.nats_server import NatsServer

    for vision, want in ((0, "0"), (1, None)):
        c = Cluster(str(tmp_path), vision=vision)
        c.nats = NatsServer(4333, str(tmp_path))
        c.model_dir = str(tmp_path)
        assert c.service_spec("gateway", 0).env.get("STRATA_MAX_IMAGES") == want
