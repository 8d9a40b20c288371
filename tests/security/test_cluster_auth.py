"""A real cluster (`Cluster`, as `strata up` starts it) with NATS auth on: every role logs in
as its own user and does its whole job without one permission violation (the nats-server log
records each), the external ``api`` user gets answers on `strata.api.v1.generate`, and an
anonymous client is refused."""

from __future__ import annotations

import asyncio
import base64
import io
import os

import httpx
import pytest
from PIL import Image

from services.launcher import Cluster, ensure_model
from shared import bus
from shared.config import ConfigError
from shared.nats_auth import NatsAuth
from shared.protocol import subjects
from shared.protocol.api import GenerateEvent, GenerateRequest
from shared.protocol.codec import decode, encode


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(
        ensure_model(""),
        log_stream=open(os.devnull, "w"),
        prefill=1,
        decode=1,
        kvstore=1,
        vision=1,
        ready_timeout=240.0,
        die_with_parent=True,
        data_dir=str(tmp_path_factory.mktemp("cluster")),
    )
    c.start()
    yield c
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
    r = httpx.post(cluster.gateway_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(
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
    r = httpx.post(cluster.gateway_url + "/v1/chat/completions", json=image_body, timeout=120)
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


def _model(c: Cluster) -> str:
    return httpx.get(c.gateway_url + "/v1/models", timeout=10).json()["data"][0]["id"]
