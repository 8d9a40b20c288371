"""The gateway refuses to listen beyond loopback without an API key: `strata serve gateway`
exits 1 with one fatal line naming the setting, before it binds or connects anywhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.gateway.app import check_public_bind, is_loopback
from services.gateway.config import GatewayConfig
from services.infra.procs import repo_root
from shared.service import FATAL_LINE, StartupError


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.5", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("gateway.example", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_public_bind_needs_a_key(tmp_path):
    with pytest.raises(StartupError, match="gateway bind 0.0.0.0 is not loopback and no API key"):
        check_public_bind(GatewayConfig.load([], role="gateway", host="0.0.0.0"))
    check_public_bind(GatewayConfig.load([], role="gateway", host="0.0.0.0", api_keys="k1"))
    keys = tmp_path / "keys.json"
    keys.write_text('{"k2": {"models": ["*"]}}')
    check_public_bind(GatewayConfig.load([], role="gateway", host="::", api_key_file=str(keys)))
    check_public_bind(GatewayConfig.load([], role="gateway", host="127.0.0.1"))


def test_strata_serve_gateway_prints_one_line():
    """The real start-up path: NATS points nowhere, so getting past the check would hang on the
    bus or fail differently; the refusal comes first and is one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_API_KEY")}
    env.update(
        STRATA_HOST="0.0.0.0", STRATA_PORT="0", STRATA_NATS_URL="nats://127.0.0.1:1",
        PYTHONPATH=repo_root(),
    )  # fmt: skip
    res = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "gateway"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith(f"{FATAL_LINE} gateway: gateway bind 0.0.0.0 is not loopback")
    assert "STRATA_API_KEYS" in lines[0]
