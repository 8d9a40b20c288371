"""The loadgen client against a real gateway with fake bus peers (fast): streaming timing,
usage counts, error buckets, and SLO pass-through to the scheduler's `RouteRequest`."""

from __future__ import annotations

import httpx

from loadtests.loadgen.client import RunConfig, run_jobs, served_model
from loadtests.loadgen.stats import summarize
from loadtests.loadgen.workload import Job
from tests.gateway.harness import gateway


def _jobs(n: int, max_tokens: int = 4) -> list[Job]:
    return [Job(i, max_tokens, messages=[{"role": "user", "content": f"hi {i}"}]) for i in range(n)]


async def test_closed_loop_run_times_every_token_and_passes_slo_headers(nats_url):
    async with gateway(nats_url, peers_kw={"max_model_len": 512}) as (url, peers, _):
        model = await served_model(url)
        assert model == "tiny"
        cfg = RunConfig(
            url,
            model,
            request_timeout=10,
            deadline=30,
            progress=False,
            headers={"X-Strata-Slo-Class": "batch", "X-Strata-TTFT-SLO-Ms": "250"},
        )
        jobs = _jobs(6) + [Job(6, 3, prompt="plain completion")]
        results, wall = await run_jobs(jobs, cfg, concurrency=3)
    assert [r.index for r in results] == list(range(7))
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.completion_tokens for r in results] == [4] * 6 + [3]
    assert all(len(r.itl) == r.completion_tokens - 1 for r in results)
    assert all(0 < r.ttft <= r.e2e for r in results)
    assert results[0].prompt_tokens == len("hi 0") and results[0].cached_tokens == 4
    s = summarize(results, wall, 3)
    assert s.ok == 7 and s.completion_tokens == 27
    assert len(peers.routes) == 7
    assert {(r.slo_class, r.ttft_slo_ms) for r in peers.routes} == {("batch", 250.0)}


async def test_slo_body_field_header_precedence_and_bad_values(nats_url):
    async with gateway(nats_url, peers_kw={"max_model_len": 512}) as (url, peers, _):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "ttft_slo_ms": 120.5,
        }
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
            r = await c.post(
                "/v1/chat/completions", json=body, headers={"X-Strata-TTFT-SLO-Ms": "80"}
            )
            assert r.status_code == 200
            plain = {k: v for k, v in body.items() if k != "ttft_slo_ms"}
            assert (await c.post("/v1/chat/completions", json=plain)).status_code == 200
            for bad in ("abc", "0", "-5", "nan", "inf"):
                r = await c.post(
                    "/v1/chat/completions", json=body, headers={"X-Strata-TTFT-SLO-Ms": bad}
                )
                assert r.status_code == 400, bad
                assert r.json()["error"]["param"] == "ttft_slo_ms"
            r = await c.post("/v1/chat/completions", json={**body, "ttft_slo_ms": -1})
            assert r.status_code == 400
    assert [r.ttft_slo_ms for r in peers.routes] == [120.5, 80.0, 0.0]


async def test_errors_are_bucketed_by_status(nats_url):
    async with gateway(nats_url) as (url, _, _):
        cfg = RunConfig(url, "no-such-model", request_timeout=10, deadline=30, progress=False)
        results, wall = await run_jobs(_jobs(2), cfg, concurrency=2)
    s = summarize(results, wall)
    assert s.ok == 0 and s.errors_by_status == {"404": 2}
    assert "no-such-model" in results[0].error
