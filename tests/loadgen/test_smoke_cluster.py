"""One short self-hosted run: the CLI starts a real Cluster on the default model, sends a few
streamed requests (Poisson arrivals, shared-prefix tenants), writes the report and stops it."""

from __future__ import annotations

import json

import pytest

from loadtests.loadgen.cli import main

pytestmark = pytest.mark.e2e


def test_start_cluster_run_writes_a_clean_report(tmp_path, default_model_dir):
    rc = main(
        [
            "--start-cluster",
            "--model",
            default_model_dir,
            "--prefill",
            "0",
            "--vision",
            "0",
            "--kvstore",
            "0",
            "--rate",
            "3",
            "--num-requests",
            "6",
            "--tenants",
            "2",
            "--system-prompt-tokens",
            "48",
            "--input-min",
            "8",
            "--input-max",
            "16",
            "--output-tokens",
            "5",
            "--duration",
            "60",
            "--request-timeout",
            "30",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    s = data["summary"]
    assert (s["requests"], s["ok"], s["errors_by_status"]) == (6, 6, {})
    assert s["completion_tokens"] == 6 * 5  # ignore_eos: every request runs to max_tokens
    # a chunk may carry several tokens (or none with text yet): at most 4 gaps for 5 tokens
    assert all(len(r["itl"]) <= 4 and 0 < r["ttft"] < r["e2e"] for r in data["requests"])
    assert sum(len(r["itl"]) for r in data["requests"]) >= 6
    assert s["prompt_tokens"] > 6 * (48 + 8)
    # tenant 0's system prompt is cached by the time its later requests arrive (same decode)
    assert s["cached_tokens"] >= 48
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 1000
