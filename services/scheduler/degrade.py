"""Degradation levels with hysteresis, driven by cluster load. Pure Python.

Levels: 0 normal; 1 trim optional work (speculation off, batch-class max_tokens capped);
2 refuse the batch class (429 + Retry-After); 3 admit only the highest priority.
A level is entered when load reaches ``up[level-1]`` and left only when load falls below
``down[level-1]`` (lower than ``up``), after at least ``min_dwell_s`` at the current level, so a
load hovering around one threshold does not flap.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DegradeThresholds:
    """Fields:
    up: cluster load at which levels 1, 2, 3 are entered.
    down: cluster load below which levels 1, 2, 3 are left (each below its ``up``).
    min_dwell_s: least time spent at a level before stepping down.
    """

    up: tuple[float, float, float] = (0.80, 0.90, 0.97)
    down: tuple[float, float, float] = (0.70, 0.82, 0.90)
    min_dwell_s: float = 2.0

    def __post_init__(self) -> None:
        if any(d >= u for d, u in zip(self.down, self.up, strict=True)):
            raise ValueError("every degrade 'down' threshold must be below its 'up' threshold")
        if list(self.up) != sorted(self.up):
            raise ValueError("degrade 'up' thresholds must increase")


class Degrader:
    def __init__(self, thresholds: DegradeThresholds | None = None) -> None:
        self.t = thresholds or DegradeThresholds()
        self.level = 0
        self.since = float("-inf")

    def update(self, load: float, now: float) -> int:
        """Feed the current cluster load (0 idle .. 1 saturated, may exceed 1); returns the level."""
        up = sum(1 for u in self.t.up if load >= u)
        if up > self.level:
            self.level, self.since = up, now
            return self.level
        if now - self.since < self.t.min_dwell_s:
            return self.level
        target = self.level
        while target > 0 and load < self.t.down[target - 1]:
            target -= 1
        if target < self.level:
            self.level, self.since = target, now
        return self.level


def cluster_load(
    prefill_queue_s: list[float],
    decode_kv_used: list[float],
    decode_batch_frac: list[float],
    queue_target_s: float,
) -> float:
    """Cluster load in [0, ~1+]: the worse of prefill queueing (mean queue time over its target)
    and decode pressure (mean of max(KV used, batch fill))."""
    pre = sum(prefill_queue_s) / len(prefill_queue_s) / queue_target_s if prefill_queue_s else 0.0
    dec = 0.0
    if decode_kv_used:
        dec = sum(max(k, b) for k, b in zip(decode_kv_used, decode_batch_frac, strict=True))
        dec /= len(decode_kv_used)
    return max(pre, dec)
