"""TLS on NATS: a real nats-server with a certificate made here by ``openssl`` (CA, server cert
for 127.0.0.1, client cert). Clients that trust the CA log in, others are refused;
with ``tls_verify`` a client must also present a certificate signed by the CA."""

from __future__ import annotations

import shutil
import ssl

import nats
import pytest

from services.infra.nats_server import NatsServer
from services.infra.procs import free_port
from shared import bus
from shared.nats_auth import NatsAuth

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _server(tmp_path, certs, verify: bool) -> NatsServer:
    return NatsServer(
        free_port(),
        str(tmp_path / "nats"),
        auth=True,
        tls_cert=certs["server"],
        tls_key=certs["server_key"],
        tls_ca=certs["ca"],
        tls_verify=verify,
        die_with_parent=True,
    ).start()


async def _untrusting_client_refused(url: str, auth: NatsAuth) -> None:
    """Without our CA (nats-py then uses the system's), the server's certificate fails."""
    kw = auth.connect_kwargs()
    kw.pop("tls")
    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(
            url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2, **kw
        )


async def test_tls_server_accepts_clients_that_trust_its_ca(tmp_path, certs):
    srv = _server(tmp_path, certs, verify=False)
    try:
        assert "tls" in open(f"{srv.data_dir}/nats.conf").read()
        auth = srv.client_auth("gateway")
        assert auth.tls_ca == certs["ca"] and "tls" in auth.connect_kwargs()
        nc = await bus.connect(srv.url, "tls-gw", auth)
        assert nc.is_connected and nc.connected_server_version.major >= 2
        await nc.close()
        await _untrusting_client_refused(srv.url, auth)
    finally:
        srv.stop()


async def test_mutual_tls_needs_a_client_certificate(tmp_path, certs):
    srv = _server(tmp_path, certs, verify=True)
    try:
        no_cert = srv.client_auth("decode")
        with pytest.raises(OSError):  # the server ends the handshake (broken pipe / SSL error)
            await nats.connect(
                srv.url,
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=2,
                **no_cert.connect_kwargs(),
            )
        env = no_cert.env() | {
            "STRATA_NATS_TLS_CERT": certs["client"],
            "STRATA_NATS_TLS_KEY": certs["client_key"],
        }
        nc = await bus.connect(srv.url, "mtls-decode", NatsAuth.from_env(env))
        assert nc.is_connected
        await nc.close()
    finally:
        srv.stop()
