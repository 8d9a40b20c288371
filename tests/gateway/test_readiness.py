"""Gateway readiness against a real nats-server: 503 + Retry-After naming what is missing until
every role a request needs answers, /health vs /health/live, the probe cache, and error messages
that name roles, never subjects."""

from __future__ import annotations

import asyncio
import json

import httpx

from services.gateway.app import needs_vision
from services.gateway.config import GatewayConfig
from services.gateway.readiness import BUSY, Readiness, summarize
from shared.protocol import subjects
from shared.protocol.api import GenerateEvent, GenerateRequest
from shared.protocol.codec import decode, encode
from shared.protocol.sched import InstanceInfo, InstancesReply
from tests.gateway.harness import gateway

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_summarize_starting_ready_degraded():
    seen: set[str] = set()
    st = summarize({"tokenizer": False, "scheduler": False, "decode": None}, seen)
    assert st.status == "starting" and not st.ready
    assert st.checks == {"tokenizer": "starting", "scheduler": "starting", "decode": "unknown"}
    assert st.message == "starting: tokenizer not ready; scheduler not ready"
    st = summarize({"tokenizer": True, "scheduler": True, "decode": False}, seen)
    assert (st.status, st.message) == ("starting", "starting: no decode instance is ready")
    assert seen == {"tokenizer", "scheduler"}
    st = summarize({"tokenizer": True, "vision": True, "scheduler": True, "decode": True}, seen)
    assert st.ready and st.message == "" and set(st.checks.values()) == {"ok"}
    assert st.body() == {
        "status": "ready",
        "checks": {"tokenizer": "ok", "vision": "ok", "scheduler": "ok", "decode": "ok"},
    }
    # once seen, a missing role is a failure, not start-up
    st = summarize({"tokenizer": False, "vision": False, "scheduler": True, "decode": True}, seen)
    assert st.status == "degraded" and st.checks["tokenizer"] == "down"
    assert st.message == "tokenizer not available; vision encoder not available"
    st = summarize({"tokenizer": True, "scheduler": False, "decode": None}, seen)
    assert st.status == "degraded" and st.message == "scheduler not available"


def test_a_slow_role_that_was_up_is_busy_not_down():
    """A probe that times out (the role is there, answering slowly under load) does not make the
    gateway refuse requests once the role was ok; before that it is still starting."""
    seen: set[str] = set()
    st = summarize({"tokenizer": BUSY, "scheduler": True, "decode": True}, seen)
    assert st.status == "starting" and st.message == "starting: tokenizer not ready"
    summarize({"tokenizer": True, "scheduler": True, "decode": True}, seen)
    st = summarize({"tokenizer": BUSY, "scheduler": BUSY, "decode": True}, seen)
    assert st.ready and st.checks == {"tokenizer": "busy", "scheduler": "busy", "decode": "ok"}


async def test_readiness_tells_a_slow_scheduler_from_a_gone_one(nats_url, nc):
    """Against a real nats-server: a scheduler that answers, then answers later than the probe
    waits, keeps the gateway ready (decode as last seen); once nobody subscribes it is down."""
    from tests.gateway.peers import Peers

    cfg = GatewayConfig(nats_url=nats_url, health_timeout=0.3, ready_cache_s=0)
    peers = await Peers(nc).start(("tokenizer",))
    delay = [0.0]

    async def instances(msg) -> None:
        await asyncio.sleep(delay[0])
        await msg.respond(
            encode(
                InstancesReply(
                    instances=[
                        InstanceInfo(
                            instance_id="dec-s",
                            role="decode",
                            incarnation="x",
                            grpc_addr="",
                            alive=True,
                        )
                    ]
                )
            )
        )

    sub = await nc.subscribe(subjects.SCHED_INSTANCES, cb=instances)
    try:
        r = Readiness(nc, cfg, need_vision=False)
        assert (await r.state()).ready
        delay[0] = 1.0  # three times the probe's wait
        st = await r.state()
        assert st.ready and st.checks == {"tokenizer": "ok", "scheduler": "busy", "decode": "ok"}
        await r.require()  # a request is not refused
        await sub.unsubscribe()
        st = await r.state()
        assert not st.ready and st.message == "scheduler not available"
        assert st.checks["scheduler"] == "down"
    finally:
        await peers.stop()


def test_vision_is_needed_only_for_a_multimodal_model_that_takes_images(tmp_path):
    llava, llama = tmp_path / "llava", tmp_path / "llama"
    for d, arch in ((llava, "LlavaForConditionalGeneration"), (llama, "LlamaForCausalLM")):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
    assert needs_vision(GatewayConfig(model=str(llava)))
    assert not needs_vision(GatewayConfig(model=str(llava), max_images=0))
    assert not needs_vision(GatewayConfig(model=str(llama)))
    assert not needs_vision(GatewayConfig(model=""))


async def _chat_error(c: httpx.AsyncClient) -> tuple[int, str, httpx.Headers]:
    r = await c.post("/v1/chat/completions", json=CHAT)
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "code"}, body  # OpenAI-style
    return r.status_code, body["error"]["message"], r.headers


async def test_not_ready_until_each_role_appears(nats_url):
    async with gateway(nats_url, decodes=(), roles=(), ready_cache_s=0) as (url, peers, svc):
        async with httpx.AsyncClient(base_url=url) as c:
            assert (await c.get("/health/live")).json() == {"status": "live"}
            # /v1/models: 503 until first ready (clients poll it as vLLM's readiness)
            r = await c.get("/v1/models")
            assert r.status_code == 503 and r.headers["Retry-After"]
            assert r.json()["error"]["message"].startswith("starting: tokenizer not ready")
            status, msg, headers = await _chat_error(c)
            assert status == 503 and int(headers["Retry-After"]) >= 1
            assert msg.startswith("starting: tokenizer not ready") and "strata." not in msg
            r = await c.get("/health")
            assert r.status_code == 503 and r.headers["Retry-After"]
            assert r.json() == {
                "status": "starting",
                "checks": {"tokenizer": "starting", "scheduler": "starting", "decode": "unknown"},
            }
            assert (await c.get("/health/ready")).status_code == 503

            # the same over the NATS API
            rep = await svc.readiness.nc.request(
                subjects.API_GENERATE, encode(GenerateRequest(body=CHAT)), timeout=5
            )
            ev = decode(rep.data, GenerateEvent)
            assert ev.status == 503 and "tokenizer not ready" in ev.error.message

            await peers.start_role("tokenizer")
            status, msg, _ = await _chat_error(c)
            assert (status, msg) == (503, "starting: scheduler not ready")
            assert (await c.get("/health")).json()["checks"]["tokenizer"] == "ok"

            await peers.start_role("scheduler")  # no decode instance yet
            status, msg, _ = await _chat_error(c)
            assert (status, msg) == (503, "starting: no decode instance is ready")
            assert (await c.get("/health")).json()["checks"] == {
                "tokenizer": "ok",
                "scheduler": "ok",
                "decode": "starting",
            }
            assert (await c.get("/health/live")).status_code == 200

            assert (await c.get("/v1/models/tiny")).status_code == 503
            await peers.add_decode("dec-0")
            assert (await c.get("/v1/models")).json()["data"][0]["id"] == "tiny"
            r = await c.get("/health")
            assert r.status_code == 200 and r.json()["status"] == "ready"
            assert (await c.get("/health/ready")).status_code == 200
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "t0 t1 "

            await peers.stop_role("tokenizer")  # seen before: degraded, not starting
            r = await c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "degraded"
            assert r.json()["checks"]["tokenizer"] == "down"
            status, msg, _ = await _chat_error(c)
            assert (status, msg) == (503, "tokenizer not available")
            assert (await c.get("/health/live")).status_code == 200
            assert (await c.get("/v1/models")).status_code == 200  # ready once: it answers
        assert len(peers.items) == 1  # only the request sent while ready reached a decode


async def test_no_responders_on_the_request_path_name_the_role(nats_url):
    """With readiness cached as ready, a role that vanishes fails the request with its name."""
    async with gateway(nats_url, ready_cache_s=300) as (url, peers, _):
        async with httpx.AsyncClient(base_url=url) as c:
            assert (await c.get("/health")).status_code == 200
            await peers.stop_role("scheduler")
            status, msg, _ = await _chat_error(c)
            assert (status, msg) == (503, "scheduler not available")
            await peers.stop_role("tokenizer")
            status, msg, _ = await _chat_error(c)
            assert (status, msg) == (503, "tokenizer not available")
        assert peers.routes == []


async def test_readiness_is_cached_so_probes_do_not_flood_the_bus(nats_url):
    async with gateway(nats_url, ready_cache_s=300) as (url, _, svc):
        async with httpx.AsyncClient(base_url=url) as c:
            codes = await asyncio.gather(*(c.get("/health") for _ in range(20)))
            assert {r.status_code for r in codes} == {200}
            for _ in range(3):
                assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert svc.readiness.probes == 1  # 20 concurrent checks + 3 requests: one probe round


async def test_vision_is_checked_when_the_model_takes_images(nats_url, nc):
    cfg = GatewayConfig(nats_url=nats_url, health_timeout=0.5, ready_cache_s=0)
    from tests.gateway.peers import Peers

    peers = await Peers(nc).start(("tokenizer", "scheduler"))
    await peers.add_decode("dec-v")
    try:
        assert (await Readiness(nc, cfg, need_vision=False).state()).ready
        r = Readiness(nc, cfg, need_vision=True)
        st = await r.state()
        assert st.checks["vision"] == "starting"
        assert st.message == "starting: vision encoder not ready"
        await peers.start_role("vision")
        assert (await r.state()).ready and r.probes == 2
    finally:
        await peers.stop()
