"""Pure loadgen parts: trace mapping, scaling, workload shapes, statistics and report files."""

from __future__ import annotations

import json
import math

import pytest

from loadtests.loadgen.stats import RequestResult, cdf, percentile, summarize
from loadtests.loadgen.trace import (
    DEFAULT_TRACE,
    TraceRow,
    TraceScale,
    block_text,
    load_trace,
    row_prompt,
    scaled_lengths,
    trace_jobs,
)
from loadtests.loadgen.workload import SyntheticSpec, poisson_arrivals, synthetic_jobs


def test_block_text_is_a_pure_function_of_the_hash_id():
    assert block_text(7, 16) == block_text(7, 16)
    assert block_text(7, 16) != block_text(8, 16)
    assert block_text(7, 16, seed=1) != block_text(7, 16)
    assert block_text(7, 8) == block_text(7, 16)[:8]  # same stream, shorter run


def test_same_hash_prefix_gives_same_text_prefix_and_last_block_is_truncated():
    scale = TraceScale(length_scale=1 / 64, output_scale=1 / 10)  # 8 words per block
    a = TraceRow(0, 20 * 64, 100, (0, 1, 2))  # 20 scaled words: blocks 0, 1 and 4 of block 2
    b = TraceRow(5, 24 * 64, 100, (0, 1, 3))
    wa, wb = row_prompt(a, scale).split(), row_prompt(b, scale).split()
    assert len(wa) == 20 and len(wb) == 24
    assert wa[:16] == wb[:16] == block_text(0, 8) + block_text(1, 8)
    assert wa[16:] == block_text(2, 8)[:4]
    assert wb[16:] == block_text(3, 8)
    assert scaled_lengths(a, scale) == (20, 10)


def test_scaling_caps_and_time():
    scale = TraceScale(
        length_scale=0.5,
        output_scale=0.5,
        time_scale=0.25,
        max_input=100,
        max_output=7,
        max_requests=2,
    )
    rows = [
        TraceRow(1000, 1000, 1, (0, 1)),
        TraceRow(3000, 10, 100, (2,)),
        TraceRow(4000, 10, 10, (3,)),
    ]
    jobs = trace_jobs(rows, scale)
    assert len(jobs) == 2
    assert [j.arrival for j in jobs] == [0.0, 0.5]
    assert [j.max_tokens for j in jobs] == [1, 7]  # round(0.5) -> at least 1; capped at 7
    assert [len(j.prompt.split()) for j in jobs] == [100, 5]
    assert all(j.endpoint == "/v1/completions" for j in jobs)
    with pytest.raises(ValueError):
        TraceScale(time_scale=0)


def test_shared_trace_file_replays_deterministically():
    rows = load_trace(DEFAULT_TRACE, limit=5)
    assert len(rows) == 5 and rows[0].hash_ids[0] == 0
    one, two = (
        trace_jobs(rows, TraceScale()),
        trace_jobs(load_trace(DEFAULT_TRACE, 5), TraceScale()),
    )
    assert [j.prompt for j in one] == [j.prompt for j in two]
    # every row of this trace starts with hash id 0: the first block's words are shared
    first = [j.prompt.split()[:16] for j in one]
    assert all(f == first[0] for f in first)


def test_poisson_arrivals_are_seeded_increasing_with_the_right_rate():
    a = poisson_arrivals(4000, rate=20.0, seed=3)
    assert a == poisson_arrivals(4000, rate=20.0, seed=3)
    assert all(x < y for x, y in zip(a, a[1:], strict=False))
    assert a[-1] / len(a) == pytest.approx(1 / 20.0, rel=0.05)
    with pytest.raises(ValueError):
        poisson_arrivals(1, 0)


def test_synthetic_tenants_share_system_prompts_and_images_follow_the_fraction():
    spec = SyntheticSpec(
        num_requests=200,
        input_min=3,
        input_max=5,
        output_tokens=4,
        tenants=3,
        system_prompt_tokens=10,
        image_fraction=0.5,
        seed=1,
    )
    jobs = synthetic_jobs(spec)
    assert [j.tenant for j in jobs[:6]] == [0, 1, 2, 0, 1, 2]
    sys0 = {j.messages[0]["content"] for j in jobs if j.tenant == 0}
    assert len(sys0) == 1 and len(next(iter(sys0)).split()) == 10
    assert jobs[0].messages[0]["content"] != jobs[1].messages[0]["content"]
    n_img = sum(j.image for j in jobs)
    assert 70 <= n_img <= 130
    img = next(j for j in jobs if j.image)
    assert img.messages[-1]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert synthetic_jobs(spec)[5].messages == jobs[5].messages  # seeded
    comp = synthetic_jobs(SyntheticSpec(num_requests=2, input_min=4, input_max=4, chat=False))
    assert comp[0].endpoint == "/v1/completions" and len(comp[0].prompt.split()) == 4
    with pytest.raises(ValueError):
        SyntheticSpec(image_fraction=0.5, chat=False)


def test_percentile_matches_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert math.isnan(percentile([], 50))
    assert cdf([3.0, 1.0]) == ([1.0, 3.0], [0.5, 1.0])


def _results() -> list[RequestResult]:
    return [
        RequestResult(
            0,
            0.0,
            200,
            ttft=0.1,
            e2e=1.0,
            itl=[0.01, 0.03],
            prompt_tokens=10,
            completion_tokens=3,
            cached_tokens=4,
        ),
        RequestResult(
            1, 0.1, 200, ttft=0.3, e2e=2.0, itl=[0.02], prompt_tokens=20, completion_tokens=2
        ),
        RequestResult(2, 0.2, 429, error="overloaded"),
        RequestResult(3, 0.3, 0, error="ConnectError"),
        RequestResult(4, 0.4, 200, ttft=0.2, error="stream ended without [DONE]"),
    ]


def test_summary_counts_only_ok_requests_and_buckets_errors():
    s = summarize(_results(), duration_s=2.0, concurrency=4)
    assert (s.requests, s.ok) == (5, 2)
    assert s.errors_by_status == {"429": 1, "stream": 1, "transport": 1}
    assert s.output_tokens_per_s == 2.5
    assert s.total_tokens_per_s == 17.5
    assert s.request_throughput == 1.0
    assert s.cached_tokens == 4
    assert s.ttft.count == 2 and s.ttft.p50 == pytest.approx(0.2)
    assert s.tbt.count == 3 and s.tbt.p50 == pytest.approx(0.02) and s.tbt.max == 0.03
    assert s.e2e.mean == pytest.approx(1.5)


def test_report_writes_json_markdown_and_plots(tmp_path):
    from loadtests.loadgen.report import write_report

    res = _results()
    for r in res:
        r.concurrency = 1 if r.index < 2 else 4
    sweep = [summarize(res[:2], 1.0, 1), summarize(res[2:], 1.0, 4)]
    path = write_report(tmp_path, {"mode": "test"}, summarize(res, 2.0), res, sweep)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["summary"]["ok"] == 2 and len(data["requests"]) == 5
    assert [s["concurrency"] for s in data["sweep"]] == [1, 4]
    md = path.read_text()
    assert "| 1 | 2 | 2 | 0 |" in md and "429: 1" in md
    assert "throughput.png" in md and "#2 status 429: overloaded" in md
    for png in ("ttft_cdf.png", "tbt_cdf.png", "throughput.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loopback_only():
    from loadtests.loadgen.client import check_loopback

    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:1")
    with pytest.raises(ValueError):
        check_loopback("http://10.1.2.3:8000")
