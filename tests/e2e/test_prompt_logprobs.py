"""vLLM's prompt_logprobs through a whole cluster, in the colocated shape (decode prefills) and
the PD shape (prefill=1 decode=1: the prefill instance computes them), against a transformers
forward of the served checkpoint: each prompt token's logprob within the acceptance oracle's
tolerance, its rank, and the top-n alternatives; a repeated prompt is recomputed (no cached
tokens), streamed and not, REST and the NATS API."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from tests.e2e.conftest import start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

LOGPROB_TOL = 2e-3  # tests/acceptance/test_user_checkpoints.py: the engine vs transformers
PROMPT = "Is the blue shirt in stock in every size, and can the store hold one for me today?"
TOP = 2


@pytest.fixture(scope="module", params=["colocated", "pd"])
def cluster(request, default_model_dir):
    prefill = 1 if request.param == "pd" else 0
    c = start_cluster(default_model_dir, prefill=prefill, decode=1, vision=0, kvstore=0)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def h(cluster):
    with httpx.Client(base_url=cluster.gateway_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(h) -> str:
    return h.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def oracle(default_model_dir):
    """prompt ids -> [len - 1, vocab] log-softmax of transformers' forward (row p-1: token p)."""
    import transformers as tf

    hf = tf.AutoModelForImageTextToText.from_pretrained(default_model_dir).float().eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1)

    return run


def _check(plp: list, ids: list[int], ref: torch.Tensor) -> None:
    assert plp[0] is None and len(plp) == len(ids)
    worst = 0.0
    for p in range(1, len(ids)):
        entry, row, tok = plp[p], ref[p - 1], ids[p]
        got = entry[str(tok)]
        worst = max(worst, abs(got["logprob"] - float(row[tok])))
        assert got["rank"] == int((row > row[tok]).sum()) + 1
        top = row.topk(TOP).indices.tolist()
        assert {str(t) for t in top} <= set(entry)
        assert [entry[str(t)]["rank"] for t in top] == [1, 2] or tok in top
    assert worst < LOGPROB_TOL, worst


def _cmpl(h, model, **kw) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, **kw}
    r = h.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_prompt_logprobs_match_transformers(h, model, oracle):
    out = _cmpl(h, model, prompt_logprobs=TOP, return_token_ids=True)
    choice = out["choices"][0]
    ids = choice["prompt_token_ids"]
    assert len(ids) > 16  # a full KV block, so a repeat would hit the prefix cache
    _check(choice["prompt_logprobs"], ids, oracle(ids))
    plain = _cmpl(h, model)
    assert "prompt_logprobs" not in plain["choices"][0]
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # a plain repeat hits
    again = _cmpl(h, model, prompt_logprobs=TOP)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed
    assert again["choices"][0]["prompt_logprobs"] == choice["prompt_logprobs"]
    assert again["choices"][0]["text"] == plain["choices"][0]["text"] == choice["text"]


def test_chat_streamed_and_nats_api_carry_them(h, cluster, model, oracle):
    msgs = [{"role": "user", "content": PROMPT}]
    body = {"model": model, "messages": msgs, "max_tokens": 3, "temperature": 0}
    r = h.post(
        "/v1/chat/completions", json={**body, "prompt_logprobs": TOP, "return_token_ids": True}
    )
    assert r.status_code == 200, r.text
    whole = r.json()
    ids = whole["prompt_token_ids"]
    _check(whole["prompt_logprobs"], ids, oracle(ids))
    r = h.post("/v1/chat/completions", json={**body, "prompt_logprobs": TOP, "stream": True})
    evs = [json.loads(x[6:]) for x in r.text.split("\n") if x.startswith("data: {")]
    carried = [e["prompt_logprobs"] for e in evs if "prompt_logprobs" in e]
    assert len(carried) == 1  # once, on the first token's chunk
    _check(carried[0], ids, oracle(ids))
    ev = asyncio.run(_nats_generate(cluster, {**body, "prompt_logprobs": TOP}))
    assert ev.done and ev.status == 200, ev
    _check(ev.data["prompt_logprobs"], ids, oracle(ids))


async def _nats_generate(c, body: dict):
    """One non-streamed request on ``strata.api.v1.generate`` as the cluster's ``api`` user."""
    from shared import bus
    from shared.protocol import subjects
    from shared.protocol.api import GenerateEvent, GenerateRequest
    from shared.protocol.codec import decode, encode

    nc = await bus.connect(c.nats_url, "api-client", c.nats_credentials("api"))
    try:
        rep = await nc.request(
            subjects.API_GENERATE, encode(GenerateRequest(body=body)), timeout=120
        )
        return decode(rep.data, GenerateEvent)
    finally:
        await nc.drain()
