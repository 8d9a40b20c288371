"""The KV plane is mutual TLS by default: a `strata up`-shaped cluster (default colocated shape,
kvstore + MinIO) makes a CA and one certificate per process in ``<data-dir>/pki``, every gRPC
server requires a client certificate from that CA, and KV moves over it (decode's write-through
reaches the kvstore). Dialed from outside with real gRPC and real TLS: plaintext, TLS without a
client certificate, a certificate from another CA and an expired one are all refused; the
cluster's own client certificate gets an answer."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import stat

import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from services.infra.kv_pki import ensure_pki, issue, make_ca
from shared.kvtransfer.client import KVClient
from shared.kvtransfer.tls import GrpcTls
from shared.protocol.errors import StrataError
from tests.cluster_kv.conftest import SHARED_PREFIX, metric, start_cluster, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    c = start_cluster(model_dir, data_dir=str(tmp_path_factory.mktemp("mtls")), prefill=0)
    yield c
    c.stop()


def _query(addr: str, tls: GrpcTls) -> dict[str, str]:
    async def go():
        client = KVClient(addr, tls=tls)
        try:
            return await client.query(["0" * 32], timeout=5.0)
        finally:
            await client.close()

    return asyncio.run(go())


def _kvstore_addr(cluster) -> str:
    return cluster.specs["decode-0"].env["STRATA_KVSTORE_ADDRS"].split(",")[0]


def test_every_process_gets_its_own_certificate_and_keys_are_private(cluster):
    assert cluster.certs, "kv_tls is on by default"
    for name in ("decode-0", "kvstore-0"):
        env = cluster.specs[name].env
        assert env["STRATA_GRPC_TLS_CERT"].endswith(f"{name}.pem")
        assert env["STRATA_GRPC_TLS_VERIFY_CLIENTS"] == "true"
        assert stat.S_IMODE(os.stat(env["STRATA_GRPC_TLS_KEY"]).st_mode) == 0o600
        with open(env["STRATA_GRPC_TLS_CERT"], "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        cn = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value
        assert cn == name
    assert stat.S_IMODE(os.stat(cluster.pki_dir).st_mode) == 0o700


def test_kv_moves_over_mtls(cluster):
    client = openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    for tail in ("mTLS?", "TLS 1.3?"):  # the second reuses the prefix: the pool gets it
        r = client.completions.create(
            model=model, prompt=SHARED_PREFIX + tail, max_tokens=2, temperature=0.0
        )
    blocks = r.usage.prompt_tokens_details.cached_tokens // 16
    assert blocks > 0
    wait_until(
        lambda: (
            metric(cluster, "kvstore-0", "strata_kvstore_puts_total", outcome="stored") >= blocks
        ),
        30,
        "decode's write-through reaching the kvstore over mTLS",
    )
    assert _query(_kvstore_addr(cluster), cluster.client_tls()) == {}


def test_plaintext_and_no_client_certificate_are_refused(cluster):
    addr = _kvstore_addr(cluster)
    with pytest.raises(StrataError):
        _query(addr, GrpcTls())
    with open(cluster.certs["client"].ca, "rb") as f:
        ca = f.read()
    with pytest.raises(StrataError):
        _query(addr, GrpcTls(ca=ca))


def test_other_ca_and_expired_certificates_are_refused(cluster):
    addr = _kvstore_addr(cluster)
    own = cluster.certs["client"]
    with open(own.ca, "rb") as f:
        ca_pem = f.read()
    other_ca, other_key = make_ca("someone else's CA")
    cert, key = issue("intruder", ["127.0.0.1"], other_ca, other_key)
    with pytest.raises(StrataError):
        _query(addr, GrpcTls(cert=cert, key=key, ca=ca_pem))

    with open(os.path.join(cluster.pki_dir, "ca.key"), "rb") as f:
        ca_key = serialization.load_pem_private_key(f.read(), password=None)
    ca_cert = x509.load_pem_x509_certificate(ca_pem)
    old = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    cert, key = issue("expired", ["127.0.0.1"], ca_cert, ca_key, not_before=old, days=1)
    with pytest.raises(StrataError):
        _query(addr, GrpcTls(cert=cert, key=key, ca=ca_pem))
    # the same CA with a valid certificate is accepted: the refusals above are the cert's
    cert, key = issue("fresh", ["127.0.0.1"], ca_cert, ca_key)
    assert _query(addr, GrpcTls(cert=cert, key=key, ca=ca_pem)) == {}


def test_certificates_are_reused_rotated_and_reissued_under_a_new_ca(tmp_path):
    d = str(tmp_path / "pki")

    def pem(c):
        with open(c.cert, "rb") as f:
            return f.read()

    first = ensure_pki(d, ["decode-0"], ["127.0.0.1"])["decode-0"]
    a = pem(first)
    assert pem(ensure_pki(d, ["decode-0"], ["127.0.0.1"])["decode-0"]) == a
    with open(first.ca, "rb") as f:
        ca = f.read()
    b = pem(ensure_pki(d, ["decode-0"], ["127.0.0.1"], rotate=True)["decode-0"])
    assert b != a
    with open(first.ca, "rb") as f:
        assert f.read() == ca  # leaf rotation keeps the CA
    c = ensure_pki(d, ["decode-0"], ["127.0.0.1"], rotate_ca=True)["decode-0"]
    with open(c.ca, "rb") as f:
        assert f.read() != ca
    assert pem(c) != b
    # a new address the services dial gets a certificate that names it
    e = ensure_pki(d, ["decode-0"], ["10.0.0.7"])["decode-0"]
    with open(e.cert, "rb") as f:
        sans = x509.load_pem_x509_certificate(f.read()).extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        )
    assert "10.0.0.7" in [str(ip) for ip in sans.value.get_values_for_type(x509.IPAddress)]
