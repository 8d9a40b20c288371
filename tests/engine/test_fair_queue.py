"""Start-time fair queuing at toy size: exact service orders."""

import pytest

from shared.engine.fair_queue import FairQueue, Tenant

A, B = Tenant("a"), Tenant("b")


def drain(q: FairQueue) -> list[str]:
    return [q.pop() for _ in range(len(q))]


def test_equal_weights_alternate_whatever_the_arrival_order():
    q = FairQueue()
    for i in range(4):
        q.push(f"a{i}", A)
    for i in range(4):
        q.push(f"b{i}", B)
    assert drain(q) == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]


def test_weights_three_to_one_give_three_services_to_one():
    q = FairQueue()
    a3 = Tenant("a", weight=3)
    for i in range(6):
        q.push(f"a{i}", a3)
    for i in range(2):
        q.push(f"b{i}", B)
    # a's tags 0, 1/3, 2/3, 1, 4/3, 5/3; b's 0, 1 (ties: arrival order)
    assert drain(q) == ["a0", "b0", "a1", "a2", "a3", "b1", "a4", "a5"]


def test_cost_counts_against_the_tenant():
    q = FairQueue()
    q.push("a-long", A, cost=3)
    q.push("a-short", A, cost=1)
    for i in range(3):
        q.push(f"b{i}", B, cost=1)
    # a's tags 0, 3; b's 0, 1, 2: a's long request is worth three of b's
    assert drain(q) == ["a-long", "b0", "b1", "b2", "a-short"]


def test_an_idle_tenant_banks_no_credit():
    q = FairQueue()
    for i in range(10):
        q.push(f"a{i}", A)
    assert drain(q) == [f"a{i}" for i in range(10)]  # b sent nothing meanwhile
    assert q.vtime == 9
    for i in range(5):
        q.push(f"b{i}", B)  # b starts at V = 9, not at 0
    for i in range(10, 15):
        q.push(f"a{i}", A)  # a continues from its finish tag 10
    assert drain(q) == ["b0", "b1", "a10", "b2", "a11", "b3", "a12", "b4", "a13", "a14"]


def test_priorities_win_across_classes():
    q = FairQueue()
    for i in range(2):
        q.push(f"b{i}", B, priority=1)  # lower tags, worse class
    for i in range(3):
        q.push(f"a{i}", A, priority=0)
    assert drain(q) == ["a0", "a1", "a2", "b0", "b1"]


def test_disabled_is_first_come_first_served():
    q = FairQueue(enabled=False)
    for i in range(3):
        q.push(f"a{i}", A)
    q.push("b0", B)
    assert drain(q) == ["a0", "a1", "a2", "b0"]


def test_weight_must_be_positive():
    with pytest.raises(ValueError, match="tenant 'x': weight must be > 0"):
        Tenant("x", weight=0)


def test_forgotten_tenants_restart_at_virtual_time():
    q = FairQueue()
    for i in range(FairQueue.PRUNE_AT + 1):
        q.tag(Tenant(f"t{i}"))  # every finish tag is 1
    q.served(2.0)  # past all of them: pruned, and a new tag starts at V either way
    assert q.finish_tag("t0") == 0.0
    assert q.tag(Tenant("t0")) == 2.0
