"""TLS on the KVTransfer gRPC traffic and on the gateway's HTTP API, with a CA and certificates
made here by ``openssl`` (tests/security/conftest.py): a real grpc.aio server and a real uvicorn
gateway; clients that trust the CA get through, plaintext and untrusting clients do not, and
with client verification only clients presenting a CA-signed certificate do."""

from __future__ import annotations

import shutil
import ssl

import httpx
import pytest
import torch

from services.gateway.config import GatewayConfig
from shared.config import ConfigError
from shared.kvtransfer.client import KVClient
from shared.kvtransfer.frames import tensor_to_frames
from shared.kvtransfer.server import KVTransferHandler, start_kv_server
from shared.kvtransfer.tls import GrpcTls
from shared.protocol.errors import StrataError
from tests.gateway.harness import gateway
from tests.kvtransfer.test_grpc import MemoryPeer

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _tls(certs, who: str = "", ca: bool = True, verify: bool = False) -> GrpcTls:
    return GrpcTls.from_files(
        cert=certs[who] if who else "",
        key=certs[f"{who}_key"] if who else "",
        ca=certs["ca"] if ca else "",
        verify_clients=verify,
    )


async def _round_trip(addr: str, tls: GrpcTls) -> list[str]:
    client = KVClient(addr, tls=tls)
    try:
        frames = tensor_to_frames(torch.arange(8, dtype=torch.float32), key="k1", fingerprint="fp")
        await client.push(frames, timeout=5)
        return sorted(await client.query(["k1", "k2"], timeout=5))
    finally:
        await client.close()


async def test_grpc_over_tls_only_for_clients_that_trust_the_ca(certs):
    server, addr = await start_kv_server(MemoryPeer(), "127.0.0.1", 0, tls=_tls(certs, "server"))
    try:
        assert await _round_trip(addr, _tls(certs)) == ["k1"]
        with pytest.raises(StrataError) as plain:  # a plaintext client gets no answer
            await _round_trip(addr, GrpcTls())
        assert plain.value.code == "unavailable"
        with pytest.raises(StrataError):  # TLS, but trusting another CA (the server's own cert)
            await _round_trip(addr, GrpcTls(ca=open(certs["client"], "rb").read()))
    finally:
        await server.stop(0)


async def test_grpc_mutual_tls_refuses_clients_without_a_certificate(certs):
    tls = _tls(certs, "server", verify=True)
    server, addr = await start_kv_server(KVTransferHandler(), "127.0.0.1", 0, tls=tls)
    peer_server, peer_addr = await start_kv_server(MemoryPeer(), "127.0.0.1", 0, tls=tls)
    try:
        assert await _round_trip(peer_addr, _tls(certs, "client")) == ["k1"]
        with pytest.raises(StrataError):  # trusts the CA but presents no certificate
            await _round_trip(peer_addr, _tls(certs))
    finally:
        await server.stop(0)
        await peer_server.stop(0)


def test_grpc_tls_settings_are_checked(certs, monkeypatch):
    with pytest.raises(ConfigError, match="STRATA_GRPC_TLS_CERT / STRATA_GRPC_TLS_KEY"):
        GrpcTls.from_files(cert=certs["server"])
    with pytest.raises(ConfigError, match="STRATA_GRPC_TLS_VERIFY_CLIENTS"):
        GrpcTls.from_files(ca=certs["ca"], verify_clients=True)
    with pytest.raises(ConfigError, match="STRATA_GRPC_TLS_CA: cannot read /nonexistent"):
        GrpcTls.from_files(ca="/nonexistent/ca.pem")
    monkeypatch.setenv("STRATA_GRPC_TLS_CERT", certs["server"])
    monkeypatch.setenv("STRATA_GRPC_TLS_KEY", certs["server_key"])
    monkeypatch.setenv("STRATA_GRPC_TLS_CA", certs["ca"])
    env = GrpcTls.from_env()  # what start_kv_server and KVClient use by default
    assert env.serves_tls and env.dials_tls and not env.verify_clients


async def test_gateway_serves_https(nats_url, certs):
    tls = dict(tls_cert=certs["server"], tls_key=certs["server_key"])
    async with gateway(nats_url, **tls) as (url, _peers, _svc):
        assert url.startswith("https://")
        ctx = ssl.create_default_context(cafile=certs["ca"])
        async with httpx.AsyncClient(base_url=url, verify=ctx) as c:
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
        async with httpx.AsyncClient(base_url=url) as c:  # the system CAs do not know ours
            with pytest.raises(httpx.ConnectError):
                await c.get("/health/live")
        plain = url.replace("https://", "http://")
        async with httpx.AsyncClient(base_url=plain) as c:
            with pytest.raises(httpx.HTTPError):
                await c.get("/health/live")


async def test_gateway_mutual_tls(nats_url, certs):
    tls = dict(tls_cert=certs["server"], tls_key=certs["server_key"], tls_client_ca=certs["ca"])
    async with gateway(nats_url, **tls) as (url, _peers, _svc):
        with_cert = ssl.create_default_context(cafile=certs["ca"])
        with_cert.load_cert_chain(certs["client"], certs["client_key"])
        async with httpx.AsyncClient(base_url=url, verify=with_cert) as c:
            assert (await c.get("/health/live")).status_code == 200
        no_cert = ssl.create_default_context(cafile=certs["ca"])
        async with httpx.AsyncClient(base_url=url, verify=no_cert) as c:
            with pytest.raises(httpx.HTTPError):
                await c.get("/health/live")


def test_gateway_tls_settings_name_the_problem(certs):
    with pytest.raises(ConfigError, match="STRATA_TLS_KEY"):
        GatewayConfig.load(["--tls-cert", certs["server"]])
    with pytest.raises(ConfigError, match="STRATA_TLS_CLIENT_CA"):
        GatewayConfig.load(["--tls-client-ca", certs["ca"]])
