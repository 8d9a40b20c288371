"""The gateway imports no torch (so no xgrammar): structured-output constraints are compiled by
the tokenizer service, whose bad_request comes back to the client as the same 400 naming the
field, before anything is routed. Real nats-server, the real tokenizer service on the default
model, fake scheduler and decode (tests/gateway/peers.py)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from services.cluster_config import ensure_model
from services.tokenizer.app import serve_tokenizer
from services.tokenizer.core import TokenizerCore
from shared import bus
from shared.protocol import subjects
from tests.gateway.harness import gateway

MSGS = [{"role": "user", "content": "hi"}]
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nosuchtype"}}}
GOOD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("module", ["services.gateway.app", "services.gateway"])
def test_importing_the_gateway_imports_no_torch(module):
    code = (
        f"import {module}, sys; bad = [m for m in ('torch', 'xgrammar') if m in sys.modules]; "
        "assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_gateway_reads_a_checkpoint_without_torch():
    """What the gateway loads of a checkpoint at start (tokenizer, tool-call syntax, token
    speller, whether it takes images) imports no torch either."""
    model = ensure_model("")  # builds it here if missing (that needs torch; the child does not)
    code = (
        "import sys; from services.gateway.app import model_text, needs_vision, token_speller; "
        "from services.gateway.config import GatewayConfig; "
        f"cfg = GatewayConfig.load([], role='gateway', model={model!r}); "
        "text = model_text(cfg.model); token_speller(cfg.model)(5); needs_vision(cfg); "
        "assert text['tokenizer'] is not None; "
        "bad = [m for m in ('torch', 'xgrammar') if m in sys.modules]; assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.fixture(scope="module")
def core():
    return TokenizerCore(ensure_model(""))


async def test_bad_constraint_is_a_400_from_the_tokenizer(nats_url, core):
    roles = ("vision", "scheduler")  # the tokenizer is the real one
    async with gateway(nats_url, roles=roles) as (url, peers, service):
        nc = service.pipeline.nc
        subs = [
            await serve_tokenizer(nc, core),
            await bus.serve_ping(nc, subjects.TOK_PING, "tokenizer", "tok-real"),
        ]
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                misses = core.grammars.misses
                for stream in (False, True):
                    body = {"model": "tiny", "messages": MSGS, "guided_json": BAD_SCHEMA}
                    r = await c.post("/v1/chat/completions", json={**body, "stream": stream})
                    assert r.status_code == 400, r.text
                    err = r.json()["error"]
                    assert err["param"] == "guided_json", err
                    assert err["message"].startswith("guided_json: invalid json_schema"), err
                rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}
                r = await c.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": "x", "response_format": rf},
                )
                assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
                assert "response_format: invalid json_schema" in r.text
                assert peers.routes == []  # refused before anything was routed
                assert core.grammars.misses == misses + 3  # the tokenizer compiled each
                peers.script = ['{"a": 1}']
                r = await c.post(
                    "/v1/chat/completions",
                    json={"model": "tiny", "messages": MSGS, "guided_json": GOOD_SCHEMA},
                )
                assert r.status_code == 200, r.text
                assert core.grammars.misses == misses + 4
                assert peers.items[-1].sampling.structured.kind == "json_schema"
        finally:
            for sub in subs:
                await sub.unsubscribe()
