"""`RolePlanner` at toy size: exact flips, hysteresis, cooldown, the per-role floor."""

from services.scheduler.planner import Flip, PlannerConfig, RoleLoad, RolePlanner

CFG = PlannerConfig(
    ratio=2.0, min_pressure=0.5, hold_ticks=2, cooldown_ticks=3, queue_target_s=1.0, batch_norm=4
)


def prefill_heavy(**kw) -> list[RoleLoad]:
    # prefill backlog: 1600 tokens at 100 tok/s over 1 instance = 16 s -> pressure 16
    return [
        RoleLoad("p0", "prefill", queued_tokens=1600, prefill_tokens_per_s=100),
        RoleLoad("d0", "decode", num_running=2, **kw),
        RoleLoad("d1", "decode", num_running=1),
    ]


def decode_heavy() -> list[RoleLoad]:
    return [
        RoleLoad("p0", "prefill", prefill_tokens_per_s=100),
        RoleLoad("p1", "prefill", queued_tokens=10, prefill_tokens_per_s=100),
        RoleLoad("d0", "decode", num_running=8, num_waiting=4),
    ]


def test_pressures_exact():
    pl = RolePlanner(CFG)
    assert pl.pressures(prefill_heavy()) == (16.0, 3 / 2 / 4)
    assert pl.pressures(decode_heavy()) == (10 / 100 / 2, 12 / 4)
    # unknown rate: the default one
    pl = RolePlanner(CFG, default_rate=400)
    assert pl.pressures([RoleLoad("p0", "prefill", queued_tokens=800)]) == (2.0, 0.0)


def test_flip_after_hold_ticks_picks_least_loaded_donor():
    pl = RolePlanner(CFG)
    assert pl.tick(prefill_heavy()) == []  # streak 1 < hold 2
    assert pl.tick(prefill_heavy()) == [Flip("d1", "decode", "prefill")]
    assert pl.flips == 1


def test_streak_resets_when_condition_breaks():
    pl = RolePlanner(CFG)
    calm = [RoleLoad("p0", "prefill"), RoleLoad("d0", "decode"), RoleLoad("d1", "decode")]
    assert pl.tick(prefill_heavy()) == []
    assert pl.tick(calm) == []  # idle: below min_pressure, streak reset
    assert pl.tick(prefill_heavy()) == []
    assert pl.tick(prefill_heavy()) == [Flip("d1", "decode", "prefill")]


def test_cooldown_then_next_flip():
    pl = RolePlanner(CFG)
    pl.tick(prefill_heavy())
    assert pl.tick(prefill_heavy()) == [Flip("d1", "decode", "prefill")]
    # d1 now counts as draining; d0 is the only routable decode instance but three are needed
    # for this test's next flip, so use a fresh decode set
    more = prefill_heavy() + [RoleLoad("d2", "decode", num_running=5)]
    for _ in range(3):  # cooldown
        assert pl.tick(more) == []
    assert pl.tick(more) == [Flip("d1", "decode", "prefill")]


def test_never_below_min_per_role_and_draining_not_counted():
    pl = RolePlanner(CFG)
    loads = prefill_heavy()
    loads[2] = RoleLoad("d1", "decode", num_running=1, draining=True)
    for _ in range(5):
        assert pl.tick(loads) == []  # only d0 is routable decode: kept
    assert pl.flips == 0


def test_decode_heavy_flips_prefill_to_decode():
    pl = RolePlanner(CFG)
    assert pl.tick(decode_heavy()) == []
    assert pl.tick(decode_heavy()) == [Flip("p0", "prefill", "decode")]


def test_balanced_load_never_flips():
    pl = RolePlanner(CFG)
    # prefill 1.0, decode 1.0: ratio 1 < 2
    loads = [
        RoleLoad("p0", "prefill", queued_tokens=100, prefill_tokens_per_s=100),
        RoleLoad("p1", "prefill", queued_tokens=100, prefill_tokens_per_s=100),
        RoleLoad("d0", "decode", num_running=4),
        RoleLoad("d1", "decode", num_running=4),
    ]
    for _ in range(10):
        assert pl.tick(loads) == []
