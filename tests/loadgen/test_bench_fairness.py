"""bench_fairness's pure parts: percentiles, the per-tenant summary and the table."""

import pytest

from loadtests.bench_fairness import main, pct, summary, table


def test_summary_counts_errors_and_takes_percentiles_of_successes():
    res = [(200, 0.010), (200, 0.030), (200, 0.020), (429, None), (200, None)]
    assert pct([0.3, 0.1, 0.2], 0.5) == 0.2 and pct([0.3, 0.1, 0.2], 0.99) == 0.3
    assert summary(res) == {"requests": 5, "errors": 1, "ttft_p50_ms": 20.0, "ttft_p99_ms": 30.0}


def test_table_has_one_row_per_mode():
    s = {"requests": 2, "errors": 0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0}
    row = {"B_unloaded": s, "B_loaded": s, "A_loaded": s, "load": 0.5}
    lines = table({"on": row, "off (FIFO)": row}).splitlines()
    assert lines[2] == "| on | 1.0 / 2.0 | 1.0 / 2.0 | 1.0 / 2.0 | 2 / 2 (0 / 0) | 0.5 |"
    assert lines[3].startswith("| off (FIFO) |")


def test_url_mode_needs_the_keys(capsys):
    with pytest.raises(SystemExit):
        main(["--url", "http://127.0.0.1:1"])
    assert "--url needs --key-a, --key-b and --served-model" in capsys.readouterr().err
