"""The simulator runs the service's `RolePlanner` on a bursty trace: it moves a decode instance
to prefill during the long-prompt burst and instances back to decode in the long-output phase,
and that beats the static split on the same trace (deterministic: seeded trace, no clock)."""

from loadtests.simulator.autopd import SIM, bursty_trace, run


def test_autopd_flips_both_ways_and_beats_static_split():
    trace = bursty_trace(seed=1, burst_s=40.0, tail_s=60.0)
    static, auto = run(trace, SIM, None), run(trace, SIM)
    assert static.flips == []
    moves = [(old, new) for _, _, old, new in auto.flips]
    assert moves[0] == ("decode", "prefill")
    assert ("prefill", "decode") in moves[1:]
    assert len(auto.flips) >= 2
    assert len(auto.sim.ttfts) == len(static.sim.ttfts) == len(trace)  # every request finished
    assert auto.sim.ttft_p99 < static.sim.ttft_p99
    assert auto.e2e_p99 < static.e2e_p99
    assert auto.makespan_s < static.makespan_s
