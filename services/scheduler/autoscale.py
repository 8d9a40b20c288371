"""Autoscaling: how many prefill and decode instances the load calls for, and which instance to
retire when there are too many (in the spirit of NVIDIA Dynamo's SLA planner and llm-d's
variant autoscaler: size each role from its load against per-instance capacity at the SLO).

Pure and synchronous, like `services.scheduler.planner` (AutoPD): the scheduler (`core.py`) and
the simulator (`loadtests/simulator/autoscale.py`) feed it the same `RoleLoad` rows each tick.

An instance's pressure is 1.0 when it holds what one instance is sized for:

- decode: the larger of its batch against ``batch_norm`` sequences and the prompt tokens it has
  queued (a colocated decode instance prefills its own prompts) at its prefill rate against the
  TTFT target (``ttft_s``);
- prefill: its queued prompt tokens at its prefill rate against the TTFT target.

A role's load is the sum of its routable instances' pressures, and the instances it needs are
``ceil(load / utilization)`` (``utilization`` < 1 keeps headroom for bursts). The TPOT target
(``tpot_s``) is checked on its own, not summed (a step's fixed cost does not add up across
instances): a decode instance whose recent engine steps (one token of every running stream)
take longer than it means the fleet is one short whatever the count says, and while any takes
longer than ``utilization`` of it, none is retired. The need is kept within ``[min, max]``. When the need stays above the instances there are for ``up_ticks`` ticks in a row, one
`ScaleAction` "add" is decided; when it stays below for ``down_ticks`` ticks, one "retire" of the
routable instance with the least work (it drains first: nothing is cancelled). After any
decision no other for ``cooldown_ticks`` ticks, so a new instance has time to load its model
and report before the load is measured again. Instances draining (AutoPD, or retiring) count
for nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.scheduler.planner import ROLES, RoleLoad
from shared.protocol.sched import RETIRED, RETIRED_EXIT

__all__ = ["RETIRED", "RETIRED_EXIT", "Autoscaler", "ScaleAction", "ScaleConfig"]


@dataclass(frozen=True)
class ScaleConfig:
    """Fields:
    min_prefill, max_prefill, min_decode, max_decode: instance bounds per role (a role whose
        max is 0 is never scaled: the colocated shape has no prefill instances).
    utilization: pressure per instance the fleet is sized for.
    ttft_s: prefill backlog seconds per instance counted as pressure 1.0.
    tpot_s: engine step seconds of a decode instance counted as pressure 1.0.
    batch_norm: running + waiting sequences of a decode instance counted as pressure 1.0.
    up_ticks, down_ticks: ticks the need must stay above / below the count before a decision.
    cooldown_ticks: ticks after a decision during which no other is made.
    default_rate: prefill tokens per second of an instance that reports none.
    lookahead_ticks: size for the load expected this many ticks ahead (about an instance's
        start time): the load plus its rising trend (a moving average of the per-tick change,
        never negative) times this; 0 sizes for the load now.
    """

    min_prefill: int = 0
    max_prefill: int = 0
    min_decode: int = 1
    max_decode: int = 1
    utilization: float = 0.7
    ttft_s: float = 2.0
    tpot_s: float = 0.1
    batch_norm: float = 64.0
    up_ticks: int = 4
    down_ticks: int = 20
    cooldown_ticks: int = 20
    default_rate: float = 8000.0
    lookahead_ticks: int = 0

    def bounds(self, role: str) -> tuple[int, int]:
        return (
            (self.min_prefill, self.max_prefill)
            if role == "prefill"
            else (self.min_decode, self.max_decode)
        )


@dataclass(frozen=True)
class ScaleAction:
    """One decision: ``action`` "add" (start one more ``role`` instance) or "retire"
    (``instance_id`` drains, then exits); ``need`` is the role's instance count it aims at."""

    role: str
    action: str
    need: int
    instance_id: str = ""


class Autoscaler:
    """Feed `tick` the routable instances each tick; it returns at most one `ScaleAction`."""

    def __init__(self, cfg: ScaleConfig | None = None) -> None:
        self.cfg = cfg or ScaleConfig()
        self.above = {r: 0 for r in ROLES}  # ticks in a row the need exceeded the count
        self.below = {r: 0 for r in ROLES}
        self.cooldown = 0
        self.need: dict[str, int] = {}
        self.actions = 0
        self._load: dict[str, float] = {}  # last tick's load per role
        self.trend: dict[str, float] = {r: 0.0 for r in ROLES}  # its moving per-tick change

    def pressure(self, x: RoleLoad) -> float:
        c = self.cfg
        backlog = x.queued_tokens / (x.prefill_tokens_per_s or c.default_rate) / c.ttft_s
        if x.role == "prefill":
            return backlog
        return max((x.num_running + x.num_waiting) / c.batch_norm, backlog)

    def needed(self, role: str, loads: list[RoleLoad]) -> tuple[int, int]:
        """(instances ``role`` needs, routable instances it has)."""
        c = self.cfg
        lo, hi = c.bounds(role)
        mine = [x for x in loads if x.role == role and not x.draining]
        load = sum(self.pressure(x) for x in mine)
        if c.lookahead_ticks:
            if role in self._load:
                self.trend[role] += 0.2 * (load - self._load[role] - self.trend[role])
            self._load[role] = load
            load += max(0.0, self.trend[role]) * c.lookahead_ticks
        need = math.ceil(round(load / c.utilization, 6))
        if role == "decode":
            slowest = max((x.step_s for x in mine), default=0.0)
            if slowest > c.tpot_s:
                need = max(need, len(mine) + 1)
            elif slowest > c.tpot_s * c.utilization:
                need = max(need, len(mine))
        return min(max(need, lo), hi), len(mine)

    def tick(self, loads: list[RoleLoad]) -> list[ScaleAction]:
        c = self.cfg
        decided: list[ScaleAction] = []
        for role in ROLES:
            if c.bounds(role)[1] == 0:
                continue
            need, have = self.needed(role, loads)
            self.need[role] = need
            self.above[role] = self.above[role] + 1 if need > have else 0
            self.below[role] = self.below[role] + 1 if need < have else 0
        if self.cooldown > 0:
            self.cooldown -= 1
            return []
        for role in ROLES:
            if c.bounds(role)[1] == 0:
                continue
            if self.above[role] >= c.up_ticks:
                decided.append(ScaleAction(role, "add", self.need[role]))
            elif self.below[role] >= c.down_ticks:
                mine = [x for x in loads if x.role == role and not x.draining]
                pick = min(
                    mine,
                    key=lambda x: (x.num_running + x.num_waiting, x.queued_tokens, x.instance_id),
                )
                decided.append(ScaleAction(role, "retire", self.need[role], pick.instance_id))
            if decided:
                break
        if decided:
            self.cooldown = c.cooldown_ticks
            self.above = {r: 0 for r in ROLES}
            self.below = {r: 0 for r in ROLES}
            self.actions += 1
        return decided
