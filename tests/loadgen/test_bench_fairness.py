"""bench_fairness's pure parts: percentiles, the per-tenant summary, the engine step counts
and the table."""

import pytest

from loadtests.bench_fairness import (
    cpu_table,
    engine_steps,
    gateway_ttft,
    main,
    pct,
    summary,
    table,
)


def test_summary_counts_errors_and_takes_percentiles_of_successes():
    res = [(200, 0.010), (200, 0.030), (200, 0.020), (429, None), (200, None)]
    assert pct([0.3, 0.1, 0.2], 0.5) == 0.2 and pct([0.3, 0.1, 0.2], 0.99) == 0.3
    assert summary(res) == {"requests": 5, "errors": 1, "ttft_p50_ms": 20.0, "ttft_p99_ms": 30.0}


def test_table_has_one_row_per_mode():
    s = {"requests": 2, "errors": 0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0}
    row = {"B_unloaded": s, "B_loaded": s, "A_loaded": s, "load": 0.5}
    steps = {"steps": 10, "step_mean_ms": 60.0, "steps_over_100ms_pct": 20.0, "split_steps": 4}
    steps["B_waits_over_100ms_pct"] = 12.5
    at_gw = {"requests": 2, "ttft_p50_ms": 0.9, "ttft_p99_ms": 1.8}
    on = {**row, "engine_loaded": steps, "B_loaded_at_gateway": at_gw}
    lines = table({"on": on, "off (FIFO)": row}).splitlines()
    assert lines[2] == (
        "| on | 1.0 / 2.0 | 1.0 / 2.0 | 1.0 / 2.0 | 2 / 2 (0 / 0) | 60.0, 20.0%, 4 of 10 "
        "| 12.5% | 0.9 / 1.8 | 0.5 |"
    )
    assert lines[3].startswith("| off (FIFO) |") and lines[3].endswith("| - | - | - | 0.5 |")


def test_engine_steps_are_the_loaded_phases_difference():
    before = {"strata:engine_step_seconds_count": 5, "strata:engine_step_seconds_sum": 0.5}
    before["le=0.1"] = 5
    after = {
        "strata:engine_step_seconds_count": 15,
        "strata:engine_step_seconds_sum": 1.3,
        "le=0.1": 13,
        "strata_fair_split_steps_total": 6,
        "wait:env-1:count": 8,  # tenant B's: 6 of 8 admitted within 100 ms
        "wait:env-1:le=0.1": 6,
        "wait:env-0:count": 50,  # tenant A's: not reported
    }
    assert engine_steps(before, after) == {
        "steps": 10,
        "step_mean_ms": 80.0,
        "steps_over_100ms_pct": 20.0,
        "split_steps": 6,
        "B_waits_over_100ms_pct": 25.0,
    }
    assert engine_steps(after, after) == {}  # no step ran: nothing to report


def test_url_mode_needs_the_keys(capsys):
    with pytest.raises(SystemExit):
        main(["--url", "http://127.0.0.1:1"])
    assert "--url needs --key-a, --key-b and --served-model" in capsys.readouterr().err


def test_cpu_table_has_a_column_per_kind_of_process():
    rows = {
        "on": {"cpu_loaded": {"decode": 1.1, "gateway": 0.3}},
        "off (FIFO)": {"cpu_loaded": {"decode": 1.0, "nats-server": 0.1}},
    }
    lines = cpu_table(rows).splitlines()
    assert lines[0] == "| cores used, loaded phase | decode | gateway | nats-server |"
    assert lines[2] == "| on | 1.1 | 0.3 | - |" and lines[3] == "| off (FIFO) | 1.0 | - | 0.1 |"
    assert cpu_table({"on": {}}) == ""


def test_gateway_ttft_reads_one_tenants_entries_of_the_phase_from_the_audit_logs(tmp_path):
    import json as _json

    lines = [
        {"identity": "env-1", "ts": 10.0, "ttft_ms": 50.0},
        {"identity": "env-1", "ts": 11.0, "ttft_ms": 900.0},
        {"identity": "env-0", "ts": 11.0, "ttft_ms": 5000.0},  # the other tenant
        {"identity": "env-1", "ts": 30.0, "ttft_ms": 7.0},  # after the phase
        {"identity": "env-1", "ts": 12.0, "ttft_ms": None},  # refused: no token
    ]
    path = tmp_path / "audit-gateway-0.jsonl"
    path.write_text("".join(_json.dumps(e) + "\n" for e in lines))
    got = gateway_ttft([str(path), str(tmp_path / "missing.jsonl")], "env-1", 9.0, 20.0)
    assert got == {"requests": 2, "ttft_p50_ms": 50.0, "ttft_p99_ms": 900.0}
    assert gateway_ttft([str(path)], "env-9", 0, 99) == {}
