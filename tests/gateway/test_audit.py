"""The audit log: one line per API request, REST and NATS, refused or served, in the file and in
the JetStream stream STRATA_AUDIT (real nats-server with JetStream); key names, never keys; no
prompt unless the operator opts in."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from services.gateway.audit import STREAM
from shared.protocol import subjects
from shared.protocol.api import GenerateEvent, GenerateRequest
from shared.protocol.codec import decode, encode
from tests.gateway.harness import gateway

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "secret plans"}], "max_tokens": 4}
KEY = "sk-audit-test-0123456789"


def key_file(tmp_path) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": {KEY: {"name": "team-a", "models": ["*"]}}}))
    return str(path)


def lines(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


async def wait_lines(path, n: int) -> list[dict]:
    for _ in range(100):
        got = lines(path)
        if len(got) >= n:
            return got
        await asyncio.sleep(0.05)
    return lines(path)


async def test_one_entry_per_request_refused_or_served_rest_and_nats(nats_url, nc, tmp_path):
    audit = tmp_path / "audit.jsonl"
    auth = {"Authorization": f"Bearer {KEY}"}
    async with gateway(nats_url, api_key_file=key_file(tmp_path), audit_file=str(audit)) as (
        url,
        _p,
        _s,
    ):
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            ok = await c.post("/v1/chat/completions", json=CHAT, headers=auth)
            assert ok.status_code == 200, ok.text
            bad_key = await c.post(
                "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-nope"}
            )
            assert bad_key.status_code == 401
            bad_body = await c.post(
                "/v1/chat/completions", json={**CHAT, "max_tokens": -1}, headers=auth
            )
            assert bad_body.status_code == 400
        req = GenerateRequest(kind="chat", body=CHAT, api_key=KEY, request_id="nats-req-1")
        ev = decode(
            (await nc.request(subjects.api_generate("alice"), encode(req), timeout=10)).data,
            GenerateEvent,
        )
        assert ev.done and ev.status == 200, ev
        got = await wait_lines(audit, 3)
    # The HTTP 401 is refused by the key middleware before any request is opened; the
    # generation routes' own check (`GatewayService.open`) audits what reaches it.
    by_outcome = {(e["transport"], e["outcome"]): e for e in got}
    served = by_outcome[("http", "length")]
    assert served["identity"] == "team-a" and served["status"] == 200
    assert served["model"] == "tiny" and served["kind"] == "chat"
    assert served["prompt_tokens"] > 0 and served["completion_tokens"] == 4
    assert served["latency_ms"] > 0 and served["request_id"]
    assert 0 < served["ttft_ms"] <= served["latency_ms"]  # its first token came before the end
    refused = by_outcome[("http", "bad_request")]
    assert refused["status"] == 400 and refused["identity"] == "team-a"
    assert refused["ttft_ms"] is None  # no token came
    via_nats = by_outcome[("nats", "length")]
    assert via_nats["request_id"] == "nats-req-1" and via_nats["identity"] == "team-a"
    assert via_nats["client"] == "alice" and served["client"] == ""
    text = audit.read_text()
    assert KEY not in text, "an API key reached the audit log"
    assert "secret plans" not in text and "prompt" not in got[0], "prompt logged without opt-in"
    assert oct(audit.stat().st_mode & 0o777) == "0o600"


async def test_nats_api_refusals_are_audited_with_the_outcome(nats_url, nc, tmp_path):
    audit = tmp_path / "audit.jsonl"
    async with gateway(nats_url, api_key_file=key_file(tmp_path), audit_file=str(audit)):
        req = GenerateRequest(kind="chat", body=CHAT, api_key="sk-wrong")
        ev = decode(
            (await nc.request(subjects.API_GENERATE, encode(req), timeout=10)).data, GenerateEvent
        )
        assert ev.status == 401
        (entry,) = await wait_lines(audit, 1)
    assert entry["transport"] == "nats" and entry["status"] == 401
    assert entry["identity"] == "unauthenticated" and entry["outcome"] == ev.error.code


async def test_prompts_only_when_the_operator_opts_in(nats_url, tmp_path):
    audit = tmp_path / "audit.jsonl"
    async with gateway(nats_url, audit_file=str(audit), audit_prompts=True) as (url, _p, _s):
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        (entry,) = await wait_lines(audit, 1)
    assert entry["identity"] == "anonymous"  # auth off
    assert entry["prompt"]["messages"][0]["content"] == "secret plans"


async def test_entries_reach_the_bounded_jetstream_stream(nats_url, nc, tmp_path):
    js = nc.jetstream()
    async with gateway(
        nats_url, audit_file="", audit_max_age=3600.0, audit_max_bytes=1 << 20, instance_id="gw-a"
    ) as (url, _p, _s):
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert r.status_code == 200
        info = None
        for _ in range(100):
            info = await js.stream_info(STREAM)
            if info.state.messages:
                break
            await asyncio.sleep(0.05)
    assert info is not None and info.state.messages >= 1
    assert info.config.max_bytes == 1 << 20 and info.config.max_age == pytest.approx(3600.0)
    msg = await js.get_last_msg(STREAM, "strata.audit.gw-a")
    entry = json.loads(msg.data)
    assert entry["gateway"] == "gw-a" and entry["outcome"] == "length"
    assert entry["completion_tokens"] == 4


async def test_a_client_that_goes_away_is_audited_as_aborted(nats_url, tmp_path):
    audit = tmp_path / "audit.jsonl"
    slow = {**CHAT, "max_tokens": 400, "stream": True}
    async with gateway(
        nats_url, decodes=(), audit_file=str(audit), peers_kw={"max_model_len": 4096}
    ) as (url, peers, _s):
        await peers.add_decode("dec-slow", gap=0.02)
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            async with c.stream("POST", "/v1/chat/completions", json=slow) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        break  # hang up mid-stream
        (entry,) = await wait_lines(audit, 1)
    assert entry["outcome"] == "aborted" and entry["status"] == 499
    assert 0 < entry["completion_tokens"] < 400
