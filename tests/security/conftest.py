"""A throw-away CA and two certificates made by ``openssl`` for the TLS tests (NATS, gRPC,
HTTPS): ``server`` and ``client``, each valid for 127.0.0.1 only."""

from __future__ import annotations

import subprocess

import pytest


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=strata-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "san.ext",
            "-out",
            f"{name}.pem",
            cwd=d,
        )
    return {k: str(d / f"{k}.pem") for k in ("ca", "server", "client")} | {
        "server_key": str(d / "server.key"),
        "client_key": str(d / "client.key"),
    }
