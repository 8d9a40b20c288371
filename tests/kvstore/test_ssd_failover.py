"""`MinioTier._call` over several endpoints (one distributed MinIO): which answers move a call to
the next node, and when a round is repeated. The node calls are faked; the real distributed
MinIO losing a node is tests/multihost/test_minio_distributed.py."""

from __future__ import annotations

import pytest

from services.kvstore import ssd
from services.kvstore.ssd import MinioTier, ObjectStoreError


def tier_with(answers: dict[int, list[str]], monkeypatch) -> tuple[MinioTier, list, list]:
    """A 3-endpoint tier whose node ``i`` answers ``answers[i]`` in turn ("ok", or an error
    kind); returns (tier, nodes called, pauses slept)."""
    tier = MinioTier("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", "u", "p", "b")
    called, slept = [], []

    def call_one(fn, *args, **kwargs):
        node = tier.current
        called.append(node)
        answer = answers[node].pop(0) if len(answers[node]) > 1 else answers[node][0]
        if answer != "ok":
            raise ObjectStoreError(f"node {node}: {answer}", kind=answer)
        return f"done by {node}"

    monkeypatch.setattr(tier, "_call_one", call_one)
    monkeypatch.setattr(ssd.time, "sleep", slept.append)
    return tier, called, slept


def test_a_busy_node_passes_the_call_to_the_next_without_waiting(monkeypatch):
    tier, called, slept = tier_with({0: ["busy"], 1: ["ok"], 2: ["ok"]}, monkeypatch)
    assert tier._call(None) == "done by 1"
    assert (called, slept, tier.current, tier.failovers) == ([0, 1], [], 1, 1)


def test_a_round_is_repeated_after_a_short_pause_only_while_a_node_says_busy(monkeypatch):
    answers = {0: ["unreachable"], 1: ["busy", "busy", "ok"], 2: ["busy", "busy", "ok"]}
    tier, called, slept = tier_with(answers, monkeypatch)
    assert tier._call(None) == "done by 1"
    assert slept == [0.5, 1.0]  # two rounds refused; never a 503's 60 s Retry-After
    assert called == [0, 1, 2, 2, 0, 1, 1]  # a round starts on the node the last one ended on


def test_every_node_down_fails_at_once(monkeypatch):
    tier, called, slept = tier_with(
        {0: ["unreachable"], 1: ["unreachable"], 2: ["unreachable"]}, monkeypatch
    )
    with pytest.raises(ObjectStoreError, match="node 2: unreachable"):
        tier._call(None)
    assert (called, slept) == ([0, 1, 2], [])


def test_busy_everywhere_gives_up_after_the_last_pause(monkeypatch):
    tier, called, slept = tier_with({0: ["busy"], 1: ["busy"], 2: ["busy"]}, monkeypatch)
    with pytest.raises(ObjectStoreError, match="busy"):
        tier._call(None)
    assert slept == list(ssd.BUSY_WAITS_S) and len(called) == 3 * (len(ssd.BUSY_WAITS_S) + 1)


def test_an_error_answer_is_not_retried_elsewhere(monkeypatch):
    tier, called, slept = tier_with({0: ["refused"], 1: ["ok"], 2: ["ok"]}, monkeypatch)
    with pytest.raises(ObjectStoreError, match="refused"):
        tier._call(None)
    assert (called, slept, tier.failovers) == ([0], [], 0)
