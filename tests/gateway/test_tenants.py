"""Tenants for fair queuing: API key name -> tenant and weight, carried in the `WorkItem`."""

from __future__ import annotations

import httpx
import pytest

from services.gateway.app import build_service
from services.gateway.auth import KeyPolicy
from services.gateway.config import GatewayConfig
from services.gateway.tenants import Tenants
from shared.protocol import subjects
from shared.protocol.api import GenerateEvent, GenerateRequest
from shared.protocol.codec import decode, encode
from shared.service import StartupError
from tests.gateway.harness import gateway

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_weights_by_key_name_and_defaults():
    t = Tenants.from_config(["team-a:3", "default:0.5"], ["team-a", "team-b"])
    assert t.of(KeyPolicy(name="team-a")) == ("team-a", 3.0)
    assert t.of(KeyPolicy(name="team-b")) == ("team-b", 1.0)
    assert t.of(None) == ("default", 0.5)  # auth off


def test_a_nats_api_client_without_a_key_is_its_own_tenant():
    t = Tenants.from_config(["nats:alice:2"], [])
    assert t.of(None, "alice") == ("nats:alice", 2.0)
    assert t.of(None, "bob") == ("nats:bob", 1.0)
    assert t.of(KeyPolicy(name="team-a"), "alice") == ("team-a", 1.0)  # a key wins


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("team-a", "expected 'keyname:weight'"),
        (":2", "expected 'keyname:weight'"),
        ("team-a:x", "weight 'x' is not a number"),
        ("team-a:0", "weight must be a positive number"),
        ("team-a:-1", "weight must be a positive number"),
        ("team-a:inf", "weight must be a positive number"),
        ("nobody:2", "no API key is named 'nobody' (names: default, team-a)"),
    ],
)
def test_bad_weight_entries_name_the_problem(spec, needle):
    with pytest.raises(ValueError) as exc:
        Tenants.from_config([spec], ["team-a"])
    assert needle in str(exc.value)


async def test_each_key_is_a_tenant_on_rest_and_nats(nats_url, nc):
    async with gateway(nats_url, api_keys="sk-aaa,sk-bbb", tenant_weights="env-0:3") as (
        url,
        peers,
        _s,
    ):
        async with httpx.AsyncClient(base_url=url) as c:
            for key in ("sk-aaa", "sk-bbb"):
                r = await c.post(
                    "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"}
                )
                assert r.status_code == 200, r.text
            req = GenerateRequest(kind="chat", body=CHAT, api_key="sk-bbb")
            ev = decode(
                (await nc.request(subjects.API_GENERATE, encode(req), 5)).data, GenerateEvent
            )
            assert ev.status == 200, ev
            got = [(i.tenant, i.tenant_weight) for i in peers.items]
            assert got == [("env-0", 3.0), ("env-1", 1.0), ("env-1", 1.0)]
            assert [r.submit.tenant for r in peers.routes] == ["env-0", "env-1", "env-1"]
            metrics = (await c.get("/metrics", headers={"Authorization": "Bearer sk-aaa"})).text
        assert 'strata_tenant_requests_total{tenant="env-0"} 1.0' in metrics
        assert 'strata_tenant_requests_total{tenant="env-1"}' in metrics
        assert "sk-aaa" not in metrics and "sk-bbb" not in metrics  # names only, never keys


async def test_weight_for_an_unknown_key_name_fails_start_up(nc):
    conf = GatewayConfig.load(
        [],
        role="gateway",
        nats_url="nats://127.0.0.1:1",
        api_keys="sk-aaa",
        tenant_weights="env-7:2",
    )
    with pytest.raises(StartupError, match="STRATA_TENANT_WEIGHTS: 'env-7:2': no API key"):
        await build_service(nc, conf)
