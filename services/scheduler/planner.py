"""AutoPD: the rule that moves an instance between the prefill and decode roles as the load
ratio of the two roles moves. Pure and synchronous: the scheduler (`core.py`) and the simulator
(`loadtests/simulator/autopd.py`) feed it the same `RoleLoad` rows each tick and act on the
`Flip` decisions it returns.

Pressure of a role is its per-instance load against a norm:

- prefill: queued prompt tokens / (instances x prefill rate) / ``queue_target_s`` (seconds of
  backlog per instance, 1.0 = the queue target);
- decode: (running + waiting sequences) / (instances x ``batch_norm``).

When prefill pressure exceeds ``ratio`` x decode pressure (and ``min_pressure``) for ``hold_ticks``
ticks in a row, the least loaded decode instance is flipped to prefill; the mirror rule flips a
prefill instance to decode. After a flip no other flip for ``cooldown_ticks`` ticks, a role never
drops below ``min_per_role`` routable instances, and an instance already draining (flipping)
counts for neither role.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class PlannerConfig:
    """Fields:
    ratio: pressure ratio (busy role over the other) that calls for a flip.
    min_pressure: the busy role's pressure must be at least this (an idle cluster never flips).
    hold_ticks: ticks the condition must hold in a row before a flip.
    cooldown_ticks: ticks after a flip during which no other flip is decided.
    min_per_role: routable instances a role keeps at least.
    queue_target_s: prefill backlog seconds per instance counted as pressure 1.0.
    batch_norm: sequences per decode instance counted as pressure 1.0.
    """

    ratio: float = 3.0
    min_pressure: float = 0.5
    hold_ticks: int = 4
    cooldown_ticks: int = 20
    min_per_role: int = 1
    queue_target_s: float = 2.0
    batch_norm: float = 64.0


@dataclass(frozen=True)
class RoleLoad:
    """One prefill or decode instance as its latest load report shows it."""

    instance_id: str
    role: str
    queued_tokens: int = 0  # prompt tokens waiting for prefill
    num_running: int = 0
    num_waiting: int = 0
    prefill_tokens_per_s: float = 0.0  # 0 = unknown: the planner's default rate
    draining: bool = False
    step_s: float = 0.0  # recent engine step seconds (the autoscaler's TPOT signal)


@dataclass(frozen=True)
class Flip:
    instance_id: str
    from_role: str
    to_role: str


class RolePlanner:
    """Feed `tick` the routable instances each tick; it returns the flips to make (at most one)."""

    def __init__(self, cfg: PlannerConfig | None = None, default_rate: float = 8000.0) -> None:
        self.cfg = cfg or PlannerConfig()
        self.default_rate = default_rate
        self.streak: dict[str, int] = {"prefill": 0, "decode": 0}  # ticks a role was the busy one
        self.cooldown = 0
        self.flips = 0

    def pressures(self, loads: list[RoleLoad]) -> tuple[float, float]:
        """(prefill pressure, decode pressure) over the instances that are not draining."""
        pre = [x for x in loads if x.role == "prefill" and not x.draining]
        dec = [x for x in loads if x.role == "decode" and not x.draining]
        p = 0.0
        if pre:
            backlog_s = sum(
                x.queued_tokens / (x.prefill_tokens_per_s or self.default_rate) for x in pre
            )
            p = backlog_s / len(pre) / self.cfg.queue_target_s
        d = 0.0
        if dec:
            d = sum(x.num_running + x.num_waiting for x in dec) / len(dec) / self.cfg.batch_norm
        return p, d

    def busy_role(self, loads: list[RoleLoad]) -> str:
        """The role whose pressure calls for one more instance now ("" = neither)."""
        p, d = self.pressures(loads)
        c = self.cfg
        if p >= c.min_pressure and p > c.ratio * d:
            return "prefill"
        if d >= c.min_pressure and d > c.ratio * p:
            return "decode"
        return ""

    def tick(self, loads: list[RoleLoad]) -> list[Flip]:
        busy = self.busy_role(loads)
        for role in ROLES:
            self.streak[role] = self.streak[role] + 1 if role == busy else 0
        if self.cooldown > 0:
            self.cooldown -= 1
            return []
        if not busy or self.streak[busy] < self.cfg.hold_ticks:
            return []
        donor = "decode" if busy == "prefill" else "prefill"
        cands = [x for x in loads if x.role == donor and not x.draining]
        if len(cands) <= self.cfg.min_per_role:
            return []
        pick = min(cands, key=lambda x: (_work(x), x.instance_id))
        self.cooldown = self.cfg.cooldown_ticks
        self.streak = {r: 0 for r in ROLES}
        self.flips += 1
        return [Flip(pick.instance_id, donor, busy)]


def _work(x: RoleLoad) -> tuple[int, int]:
    """What draining ``x`` waits for: its sequences, then its queued prompt tokens."""
    return (x.num_running + x.num_waiting, x.queued_tokens)
