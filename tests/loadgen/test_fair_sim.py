"""loadtests.fair_sim drives the real engine scheduler: under a heavy tenant's growing backlog
the lead steps go to the light tenant, whose requests are admitted within a few steps."""

import json

from loadtests.fair_sim import main


def test_the_light_tenant_gets_the_lead_steps(capsys):
    main(["--steps", "600", "--step-s", "0.07"])
    got = json.loads(capsys.readouterr().out)
    assert got["B_admitted"] > 30 and got["A_backlog_at_end"] > 500
    leads = got["lead_steps_by_tenant"]
    assert leads.get("A", 0) < 0.1 * leads["B"]
    assert got["B_wait_steps_p50_p90_p99_max"][1] <= 3


def test_prompt_tokens_lengthen_the_steps_and_the_light_tenants_ttft(capsys):
    """With a cost per prompt token a step carrying prompts lasts longer, so B's simulated
    TTFT (arrival to the end of the step that sampled its first token) grows with it."""
    ttft = []
    for per_token in ("0", "0.001"):
        main(["--steps", "400", "--step-s", "0.03", "--prompt-token-s", per_token])
        got = json.loads(capsys.readouterr().out)
        p50, p90, p99, worst = got["B_ttft_ms_p50_p90_p99_max"]
        assert 0 < p50 <= p90 <= p99 <= worst
        ttft.append(p50)
    assert ttft[1] > ttft[0] + 150  # a 200-token prompt step: +200 ms at 1 ms a token
