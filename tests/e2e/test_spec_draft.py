"""Draft-model speculation through the whole cluster, in the default colocated shape (decode
prefills itself): ``STRATA_SPECULATIVE_MODEL`` names the draft checkpoint (here the target
itself, so every draft must be accepted), and greedy output equals the engine's plain output.
The decode instance's spec-decode counters prove the drafts were proposed and verified."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.model.loader import load_model
from shared.model.tokenizer import Tokenizer
from shared.protocol.sampling import SamplingParams
from tests.cluster.conftest import scrape
from tests.e2e.conftest import start_cluster

pytestmark = pytest.mark.e2e

PROMPT = "List three shirts in stock and their colours:"


@pytest.fixture(scope="module")
def cluster(default_model_dir):
    c = start_cluster(
        default_model_dir,
        prefill=0,
        decode=1,
        vision=0,
        kvstore=0,
        env={
            "STRATA_NUM_SPECULATIVE_TOKENS": "3",
            "STRATA_SPECULATIVE_MODEL": default_model_dir,
        },
    )
    yield c
    c.stop()


def _counters(c, past: float) -> tuple[float, float]:
    """(draft tokens, accepted tokens) of decode-0 once the drafts exceed ``past`` (the
    counters move at the instance's next load report)."""
    deadline = time.monotonic() + 20
    while True:
        d, a = (
            sum(scrape(c, "decode-0", f"strata:spec_decode_num_{n}_tokens_total").values())
            for n in ("draft", "accepted")
        )
        if d > past or time.monotonic() > deadline:
            return d, a
        time.sleep(0.2)


def test_self_draft_accepts_every_draft_and_output_is_plain_greedy(cluster, default_model_dir):
    tok = Tokenizer.from_dir(default_model_dir)
    ids = tok.encode(PROMPT)
    torch.set_num_threads(1)
    want = LLMEngine(load_model(default_model_dir), EngineConfig()).generate(
        [ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )[0]
    with httpx.Client(base_url=cluster.gateway_url, timeout=60) as h:
        model = h.get("/v1/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = h.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        drafted, accepted = _counters(cluster, 0)
        assert drafted > 0 and accepted == drafted  # the self-draft is always right
        # sampled requests speculate too (rejection sampling)
        r = h.post("/v1/completions", json={**body, "temperature": 0.8, "seed": 3})
        assert r.status_code == 200, r.text
        assert _counters(cluster, drafted)[0] > drafted
