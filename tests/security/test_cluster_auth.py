"""A real cluster (`Cluster`, as `strata up` starts it) with NATS auth on and its gateway on
HTTPS (``--tls-cert`` / ``--tls-key``, an openssl-made CA): every role logs in as its own user
and does its whole job without one permission violation (the nats-server log records each), the
external ``api`` user gets answers on `strata.api.v1.generate`, and an anonymous client is
refused. Clients that trust the CA get answers; plain HTTP and clients that do not trust it are
refused. A bad certificate pair fails before anything starts, in one line."""

from __future__ import annotations

import asyncio
import base64
import io
import os

import httpx
import pytest
from PIL import Image

from services.cluster_config import ensure_model
from services.infra import nats_clients
from services.launcher import Cluster
from shared import bus
from shared.config import ConfigError
from shared.nats_auth import NatsAuth
from shared.protocol import subjects
from shared.protocol.api import GenerateEvent, GenerateRequest
from shared.protocol.codec import decode, encode


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, certs):
    c = Cluster(
        ensure_model(""),
        tls_cert=certs["server"],
        tls_key=certs["server_key"],
        log_stream=open(os.devnull, "w"),
        prefill=1,
        decode=1,
        kvstore=1,
        vision=1,
        ready_timeout=240.0,
        die_with_parent=True,
        data_dir=str(tmp_path_factory.mktemp("cluster")),
    )
    c.start()  # waits for /health over HTTPS: the launcher's probe trusts the served cert
    c.http = httpx.Client(verify=certs["ca"], timeout=120)
    yield c
    c.http.close()
    c.stop()


def violations(c: Cluster) -> list[str]:
    with open(os.path.join(c.log_dir, "nats.log")) as f:
        return [line for line in f if "Violation" in line]


def test_every_role_serves_under_its_own_user(cluster):
    assert cluster.cfg.nats_auth
    for name in cluster.names():
        role = name.rsplit("-", 1)[0]
        env = cluster.specs[name].env
        assert env["STRATA_NATS_USER"] == role and "STRATA_NATS_PASSWORD" not in env
    body = {
        "model": _model(cluster),
        "max_tokens": 4,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": "Hello there"}],
    }
    r = cluster.http.post(cluster.gateway_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    r = cluster.http.post(
        cluster.gateway_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120
    )
    assert r.status_code == 200 and "[DONE]" in r.text
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 60)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    image_body = {
        **body,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    }
    r = cluster.http.post(
        cluster.gateway_url + "/v1/chat/completions", json=image_body, timeout=120
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 16, r.text
    asyncio.run(_api_user_generates(cluster, body))
    assert violations(cluster) == []


async def _api_user_generates(c: Cluster, body: dict) -> None:
    with pytest.raises(ConfigError, match="anonymous"):
        await bus.connect(c.nats_url, "anon", NatsAuth())
    nc = await bus.connect(c.nats_url, "api-client", c.nats_credentials("api"))
    try:
        rep = await nc.request(
            subjects.API_GENERATE, encode(GenerateRequest(body=body)), timeout=120
        )
        ev = decode(rep.data, GenerateEvent)
        assert ev.done and ev.status == 200 and ev.data["choices"][0]["message"]["content"]
        done = asyncio.Event()
        got: list[GenerateEvent] = []

        async def on_ev(msg) -> None:
            got.append(decode(msg.data, GenerateEvent))
            if got[-1].done:
                done.set()

        await nc.subscribe("_INBOX.api.stream-1", cb=on_ev)
        await nc.publish(
            subjects.API_GENERATE,
            encode(
                GenerateRequest(body={**body, "stream": True}, stream_subject="_INBOX.api.stream-1")
            ),
        )
        await asyncio.wait_for(done.wait(), 120)
        assert got[-1].error is None and any(e.data and e.data.get("choices") for e in got)
    finally:
        await nc.drain()


def test_a_client_issued_while_the_cluster_runs(cluster):
    """`strata creds add` on the running cluster: the new client generates on its own subject
    and streams into its own inbox (the gateway's permissions grew by the reload, on its open
    connection: no violation), then `revoke` shuts it out; nothing restarted."""
    said: list[str] = []
    argv = ["--data-dir", cluster.data_dir]
    assert nats_clients.cli(["add", "alice", *argv], "", say=said.append) == 0, said
    assert "reloaded nats-server" in said[-1]
    with open(os.path.join(cluster.nats.cred_dir, "alice.password")) as f:
        auth = NatsAuth(user="alice", password=f.read().strip())
    body = {
        "model": _model(cluster),
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hello"}],
        "stream": True,
    }
    asyncio.run(_alice_streams(cluster, auth, body))
    assert nats_clients.cli(["revoke", "alice", *argv], "", say=said.append) == 0, said
    with pytest.raises(ConfigError, match="refused login as 'alice'"):
        asyncio.run(bus.connect(cluster.nats_url, "alice-again", auth))
    assert violations(cluster) == []
    secrets = [auth.password]
    for name in os.listdir(cluster.nats.cred_dir):
        with open(os.path.join(cluster.nats.cred_dir, name)) as f:
            secrets.append(f.read().strip())
    texts = [cluster.http.get(cluster.gateway_url + "/metrics").text]  # the gateway's REST one
    for d in (cluster.log_dir, cluster.nats.data_dir):  # every log, nats.conf and auth.conf
        for name in os.listdir(d):
            if os.path.isfile(os.path.join(d, name)):
                with open(os.path.join(d, name), errors="replace") as f:
                    texts.append(f.read())
    assert len(secrets) == 9 and not [s for s in secrets for t in texts if s in t]


async def _alice_streams(c: Cluster, auth: NatsAuth, body: dict) -> None:
    nc = await bus.connect(c.nats_url, "alice", auth)
    try:
        done = asyncio.Event()
        got: list[GenerateEvent] = []

        async def on_ev(msg) -> None:
            got.append(decode(msg.data, GenerateEvent))
            if got[-1].done:
                done.set()

        await nc.subscribe("_INBOX.alice.s1", cb=on_ev)
        req = GenerateRequest(body=body, stream_subject="_INBOX.alice.s1")
        await nc.publish(subjects.api_generate("alice"), encode(req))
        await asyncio.wait_for(done.wait(), 120)
        assert got[-1].error is None and any(e.data and e.data.get("choices") for e in got)
    finally:
        await nc.drain()


def _model(c: Cluster) -> str:
    return c.http.get(c.gateway_url + "/v1/models").json()["data"][0]["id"]


def test_gateway_serves_https_only_to_clients_that_trust_it(cluster):
    assert cluster.gateway_url.startswith("https://127.0.0.1:")
    assert cluster.http.get(cluster.gateway_url + "/health").status_code == 200
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(cluster.gateway_url + "/health", timeout=10)  # the system CAs only
    plain = cluster.gateway_url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain + "/health", timeout=10)


def test_a_bad_certificate_pair_fails_before_start_in_one_line(certs, tmp_path):
    def start(**tls) -> str:
        c = Cluster(ensure_model(""), log_stream=open(os.devnull, "w"), **tls)
        with pytest.raises(RuntimeError) as err:
            c.start()
        assert c.nats is None  # nothing was started
        assert "\n" not in str(err.value)
        return str(err.value)

    assert "go together" in start(tls_cert=certs["server"])
    assert "key values mismatch" in start(tls_cert=certs["server"], tls_key=certs["client_key"])
    missing = str(tmp_path / "nope.pem")
    assert "No such file" in start(tls_cert=missing, tls_key=certs["server_key"])
