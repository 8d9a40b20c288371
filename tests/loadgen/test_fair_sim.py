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
